"""``freetoken convert``: an HF MoE checkpoint directory -> a GGUF file llama.cpp and freetoken both load."""

from __future__ import annotations

import argparse
import sys

CONVERT_DESCRIPTION = """\
Write an HF MoE checkpoint (Qwen3-MoE, Qwen2-MoE, Mixtral, OLMoE, GLM-4.5, gpt-oss, DeepSeek-V2/V3, Qwen3-Next,
Qwen3.5-MoE; bf16/f16/f32, block-FP8 or gpt-oss MXFP4 safetensors) as a GGUF file with llama.cpp's architecture,
tensor names and metadata (qwen3moe, qwen2moe, llama, olmoe, glm4moe, gpt-oss, deepseek2, qwen3next, qwen35moe) and
the tokenizer embedded. Routed experts are quantized to --experts (default q4_0); embeddings, attention (linear
attention's projections too), shared experts and dense MLPs to --other (default f16); norms, biases and routers stay
f32. Multi-token-prediction layers are left out. The file appears only when complete.

An OUTPUT ending in .ftw writes freetoken's own FTW file instead (docs/ftw.md): one record per routed expert
with its format and checksum. Its MODEL may be an HF directory, a GGUF file or another FTW file; the experts keep
the formats the source stores them in (bit for bit), or are quantized to --expert-format; the other tensors are
kept as stored (GGUF blocks, block-FP8 rows) or as the narrowest exact float (bf16, f16, f32).

Examples: freetoken convert path/to/Qwen3-30B-A3B qwen3-30b-a3b-q4_0.gguf
          freetoken convert path/to/Qwen3-30B-A3B qwen3-30b-a3b.ftw --expert-format mxfp4
          freetoken convert qwen3-30b-a3b-q4_k_m.gguf qwen3-30b-a3b-q4_k_m.ftw
"""


def _cmd_convert(args: argparse.Namespace) -> int:
    if args.output.endswith(".ftw"):
        from freetoken.convert.ftw_export import write_ftw
        from freetoken.engine.sources import open_source

        src = open_source(args.model)
        out = write_ftw(src, args.output, expert_format=args.expert_format, progress=sys.stderr.isatty(),
                        force=args.force)
        print(f"wrote {out} ({out.stat().st_size / 2**20:.1f} MiB)")
        return 0
    if args.expert_format is not None:
        raise SystemExit("freetoken convert: --expert-format is for .ftw outputs; a GGUF output takes --experts")
    from freetoken.convert.gguf_export import export_gguf

    out = export_gguf(args.model, args.output, experts=args.experts, other=args.other, progress=sys.stderr.isatty(),
                      force=args.force)
    print(f"wrote {out} ({out.stat().st_size / 2**20:.1f} MiB)")
    return 0


def add_convert_parser(sub) -> None:
    from freetoken import formats
    from freetoken.convert.gguf_export import EXPERT_TYPES, OTHER_TYPES

    p = sub.add_parser("convert", help="convert an HF MoE checkpoint to GGUF, or a model to an FTW file",
                       description=CONVERT_DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", help="HF model directory (config.json, safetensors, tokenizer.json); for a .ftw "
                                 "output also a GGUF or FTW file")
    p.add_argument("output", help="the GGUF (.gguf) or FTW (.ftw) file to write")
    p.add_argument("--expert-format", default=None, choices=formats.NAMES,
                   help="FTW output: quantize the routed experts to this format (default: as the source stores them)")
    p.add_argument("--experts", default="q4_0", choices=EXPERT_TYPES, help="routed-expert type (default q4_0)")
    p.add_argument("--other", default="f16", choices=OTHER_TYPES,
                   help="type of the other matrices (default f16)")
    p.add_argument("--force", action="store_true", help="replace OUTPUT if it exists (never one of the inputs)")
    p.set_defaults(func=_cmd_convert)
