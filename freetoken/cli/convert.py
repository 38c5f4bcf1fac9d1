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

Per-expert formats (FTW only; one of these policies, or --expert-format, not both):
  --hot F --cold F --hot-fraction X --trace T.npz
      in each MoE layer the round(X * experts) most routed experts of the routing trace T (from
      `freetoken run --record-trace T.npz`, prefill and decode) are written in F (--hot), the rest in --cold
  --max-nmse E [--candidates a,b,c]
      each expert in the first candidate format (smallest first; default mxfp4,q4_0,fp8_block,bf16) whose
      quantization NMSE (worst of gate, up and down against the source's values) is at most E, else the last
The plan (experts per format, average bits per expert weight) is printed before the file is written.

Shards (FTW only): --shard-size 5GB writes OUTPUT.ftw as NAME-00001-of-0000N.ftw ... (NAME: OUTPUT without .ftw),
each holding whole tensors and expert records up to that size (KB/MB/GB/TB are powers of 1000, KiB/MiB/GiB/TiB of
1024); one file when the model fits in one shard. The set appears only when every shard is complete; any shard or
OUTPUT itself (the set's name) loads it.

Examples: freetoken convert path/to/Qwen3-30B-A3B qwen3-30b-a3b-q4_0.gguf
          freetoken convert path/to/Qwen3-30B-A3B qwen3-30b-a3b.ftw --expert-format mxfp4
          freetoken convert path/to/Qwen3-30B-A3B qwen3-30b-a3b.ftw --hot fp8_block --cold mxfp4 \\
              --hot-fraction 0.1 --trace qwen3-30b-a3b-trace.npz
          freetoken convert path/to/Qwen3-30B-A3B qwen3-30b-a3b.ftw --max-nmse 0.005
          freetoken convert qwen3-30b-a3b-q4_k_m.gguf qwen3-30b-a3b-q4_k_m.ftw
          freetoken convert path/to/DeepSeek-V3 deepseek-v3.ftw --shard-size 5GB
"""

#: The flags of each per-expert policy: hot/cold needs all four.
HOT_COLD_FLAGS = {"hot": "--hot", "cold": "--cold", "hot_fraction": "--hot-fraction", "trace": "--trace"}


def _policy(args: argparse.Namespace) -> str | None:
    """Which per-expert policy the flags ask for ("hot_cold", "error_budget" or None); ValueError for a partial
    or conflicting set, before any weight is read."""
    given = [flag for key, flag in HOT_COLD_FLAGS.items() if getattr(args, key) is not None]
    if given and len(given) < len(HOT_COLD_FLAGS):
        missing = [flag for key, flag in HOT_COLD_FLAGS.items() if getattr(args, key) is None]
        raise ValueError(f"{', '.join(given)} needs {', '.join(missing)} too (the hot/cold policy takes "
                         "--hot, --cold, --hot-fraction and --trace together)")
    if args.candidates is not None and args.max_nmse is None:
        raise ValueError("--candidates needs --max-nmse (the error budget it chooses by)")
    policies = [name for name, on in (("--hot/--cold", given), ("--max-nmse", args.max_nmse is not None),
                                      ("--expert-format", args.expert_format is not None)) if on]
    if len(policies) > 1:
        raise ValueError(f"{' and '.join(policies)} are exclusive: give one way to choose the expert formats")
    if policies and not args.output.endswith(".ftw"):
        raise ValueError(f"{policies[0]} is for .ftw outputs; a GGUF output takes --experts")
    if args.shard_size is not None and not args.output.endswith(".ftw"):
        raise ValueError("--shard-size is for .ftw outputs")
    return "hot_cold" if given else "error_budget" if args.max_nmse is not None else None


def _expert_plan(args: argparse.Namespace, policy: str, src) -> list[list[str]]:
    from freetoken.convert import expert_plan as xp

    cfg = src.cfg
    moe = xp.moe_layer_ids(cfg)
    if policy == "hot_cold":
        counts = xp.counts_from_trace(args.trace, len(moe), cfg.num_experts)
        xp.format_layouts(cfg, [args.hot, args.cold])  # refuse a format that does not fit before anything else
        return xp.hot_cold_plan(counts, args.hot, args.cold, args.hot_fraction)
    candidates = args.candidates or list(xp.DEFAULT_CANDIDATES)
    return xp.error_budget_plan(src.weights, xp.format_layouts(cfg, candidates), moe, args.max_nmse, candidates)


def _cmd_convert(args: argparse.Namespace) -> int:
    policy = _policy(args)
    if args.output.endswith(".ftw"):
        from pathlib import Path

        from freetoken.convert.ftw_export import existing_outputs, write_ftw
        from freetoken.engine.loading.sources import open_source

        replaced = existing_outputs(Path(args.output))
        if replaced and not args.force:  # before planning, which may read every expert
            raise ValueError(f"{replaced[0]}: exists; pass --force to replace it")
        src = open_source(args.model)
        plan = None
        if policy is not None:
            from freetoken.convert.expert_plan import format_layouts, plan_summary

            plan = _expert_plan(args, policy, src)
            print(plan_summary(plan, format_layouts(src.cfg, [f for row in plan for f in row])), flush=True)
        out = write_ftw(src, args.output, expert_format=args.expert_format, progress=sys.stderr.isatty(),
                        force=args.force, expert_plan=plan, shard_bytes=args.shard_size)
        _print_written(out)
        return 0
    from freetoken.convert.gguf_export import export_gguf

    out = export_gguf(args.model, args.output, experts=args.experts, other=args.other, progress=sys.stderr.isatty(),
                      force=args.force)
    print(f"wrote {out} ({out.stat().st_size / 2**20:.1f} MiB)")
    return 0


def _print_written(out) -> None:
    """The file written, or each shard of the set with its size and what it holds."""
    from freetoken.loaders.ftw_file import FTWFile

    ftw = FTWFile(out, verify="none")  # the index only: a look at what was written, not a reload
    try:
        total = sum(p.stat().st_size for p in ftw.shards)
        if len(ftw.shards) == 1:
            print(f"wrote {out} ({total / 2**20:.1f} MiB)")
            return
        print(f"wrote {len(ftw.shards)} shards, {total / 2**20:.1f} MiB in all:")
        for i, p in enumerate(ftw.shards):
            tensors = sum(t.shard == i for t in ftw.tensors.values())
            records = sum(r.shard == i for r in ftw.records.values())
            print(f"  {p} ({p.stat().st_size / 2**20:.1f} MiB: {tensors} tensors, {records} expert records)")
    finally:
        ftw.close()


def _format_list(text: str) -> list[str]:
    """An argparse type: comma-separated expert format names, at least one, each known."""
    from freetoken import formats

    names = [t.strip() for t in text.split(",") if t.strip()]
    bad = [n for n in names if n not in formats.NAMES]
    if not names or bad:
        raise argparse.ArgumentTypeError(f"expected format names separated by commas ({', '.join(formats.NAMES)}), "
                                         f"got {text!r}")
    return names


_format_list.__name__ = "format list"

#: Below this a --shard-size is a slip (``5`` for ``5GB``), not a plan: thousands of files.
MIN_SHARD_SIZE = 2**20


def _shard_size(text: str) -> int:
    """An argparse type: a shard size (a size as --kv-memory takes, at least MIN_SHARD_SIZE)."""
    from freetoken.cli.args import size

    n = size(text)
    if n < MIN_SHARD_SIZE:
        raise argparse.ArgumentTypeError(f"a shard of {n} bytes is too small (at least 1MiB; e.g. 5GB), got "
                                         f"{text!r}")
    return n


_shard_size.__name__ = "shard size"


def add_convert_parser(sub) -> None:
    from freetoken import formats
    from freetoken.cli.args import real
    from freetoken.convert.gguf_export import EXPERT_TYPES, OTHER_TYPES

    p = sub.add_parser("convert", help="convert an HF MoE checkpoint to GGUF, or a model to an FTW file",
                       description=CONVERT_DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", help="HF model directory (config.json, safetensors, tokenizer.json); for a .ftw "
                                 "output also a GGUF or FTW file")
    p.add_argument("output", help="the GGUF (.gguf) or FTW (.ftw) file to write")
    p.add_argument("--expert-format", default=None, choices=formats.NAMES,
                   help="FTW output: quantize the routed experts to this format (default: as the source stores them)")
    p.add_argument("--hot", default=None, choices=formats.NAMES, metavar="F",
                   help="FTW output: the format of each layer's most routed experts, a name as --expert-format takes "
                        "(with --cold, --hot-fraction, --trace)")
    p.add_argument("--cold", default=None, choices=formats.NAMES, metavar="F",
                   help="FTW output: the format of the other experts")
    p.add_argument("--hot-fraction", default=None, type=real(0.0, 1.0), metavar="X",
                   help="the fraction of each layer's experts that are hot (0 to 1)")
    p.add_argument("--trace", default=None, metavar="T.npz",
                   help="the routing trace (freetoken run --record-trace) the experts' use is counted from")
    p.add_argument("--max-nmse", default=None, type=real(), metavar="E",
                   help="FTW output: each expert in the first --candidates format whose quantization NMSE is <= E")
    p.add_argument("--candidates", default=None, type=_format_list, metavar="a,b,c",
                   help="the formats --max-nmse tries, smallest first (default mxfp4,q4_0,fp8_block,bf16)")
    p.add_argument("--experts", default="q4_0", choices=EXPERT_TYPES, help="routed-expert type (default q4_0)")
    p.add_argument("--other", default="f16", choices=OTHER_TYPES,
                   help="type of the other matrices (default f16)")
    p.add_argument("--shard-size", default=None, type=_shard_size, metavar="SIZE",
                   help="FTW output: write shards of at most SIZE bytes of weights each (5GB, 4GiB, 500MB; at least "
                        "1MiB), NAME-00001-of-0000N.ftw ... (default: one file)")
    p.add_argument("--force", action="store_true", help="replace OUTPUT if it exists (never one of the inputs)")
    p.set_defaults(func=_cmd_convert)
