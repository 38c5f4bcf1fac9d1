"""``freetoken perplexity``: a model's perplexity on a text file (llama.cpp's perplexity tool's measure)."""

from __future__ import annotations

import argparse
import sys

DESCRIPTION = """\
The perplexity of a model on a text file, measured as llama.cpp's perplexity tool does: the file's tokens cut into
chunks of --ctx tokens, each run as a fresh sequence, scoring the second half of each chunk (the first half is
context). Compare files and formats on the same text and --ctx: an FTW file with its experts in mxfp4 against the
same model in fp8_block, a GGUF Q4_K_M against its f16 source.

Example: freetoken perplexity --model model.ftw --ctx 512 held_out.txt
"""


def _cmd_perplexity(args: argparse.Namespace) -> int:
    from freetoken.cli.args import context_kwargs, read_prompt_file
    from freetoken.cli.policy import policy_kwargs
    from freetoken.engine.generation.perplexity import perplexity
    from freetoken.engine.loading.load import load

    text = read_prompt_file(args.file)
    if not text:
        raise ValueError(f"{args.file}: the file is empty")
    kw = context_kwargs(args)
    kw["ctx"] = max(kw["ctx"] or 0, args.chunk)
    model = load(args.model, device=args.device, progress=sys.stderr.isatty(), cache_slots=args.cache_slots,
                 expert_format=args.expert_format, **policy_kwargs(args), **kw)
    ids = model.encode(text)
    tty = sys.stderr.isatty()

    def progress(done, total, ppl):
        if tty or done == total or done % 10 == 0:
            print(f"\r[{done}/{total}] perplexity {ppl:.4f}", end="" if tty and done < total else "\n",
                  file=sys.stderr, flush=True)

    result = perplexity(model, ids, ctx=args.chunk, max_chunks=args.max_chunks, progress=progress)
    print(f"{args.file}: {len(ids)} tokens; {result.line()}")
    return 0


def add_perplexity_parser(sub) -> None:
    from freetoken import formats
    from freetoken.cli.args import add_context_args, count
    from freetoken.cli.policy import add_policy_args
    from freetoken.device.simd import ACTIVATIONS

    p = sub.add_parser("perplexity", help="a model's perplexity on a text file (as llama.cpp measures it)",
                       description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("file", help="the text file (UTF-8)")
    p.add_argument("--model", default=None, help="HF directory, GGUF or FTW file (default: the bundled model)")
    p.add_argument("--device", default="auto", choices=["auto", "gpu", "cpu", "emu"], help="where to run")
    p.add_argument("--chunk", type=count(2), default=512, metavar="N",
                   help="tokens per chunk (default 512, llama.cpp's default context); the second half is scored")
    p.add_argument("--max-chunks", type=count(1), default=None, metavar="N", help="score at most N chunks")
    p.add_argument("--expert-format", default=None, choices=formats.NAMES,
                   help="run the routed experts in this format, quantized on load (default: as stored)")
    p.add_argument("--cache-slots", type=count(1), default=None, metavar="N",
                   help="expert cache slots on gpu/emu (default: room for all)")
    p.add_argument("--verify", default="full", choices=["full", "sample", "none"],
                   help="an FTW file's checksums (default full)")
    p.add_argument("--cpu-activations", default="auto", choices=list(ACTIVATIONS),
                   help="experts on the CPU: reduced activations (q8: 8-bit blocks with int8 dots, llama.cpp's "
                        "rounding, or bf16 with bf16 dots for bf16/fp8_block experts) or float32 (f32); auto: q8 "
                        "where it is the fast path (AVX2 or AVX-512; AVX512-BF16 for fp8_block)")
    add_policy_args(p)
    add_context_args(p)
    p.set_defaults(func=_cmd_perplexity)
