"""The ``freetoken`` command line."""

from __future__ import annotations

import argparse
import json
import sys

DESCRIPTION = """\
freetoken runs huge Mixture-of-Experts language models on one consumer NVIDIA GPU plus host memory:
the routed experts live in host memory, the GPU caches the hot ones.

Commands:
  run     generate text from a prompt (the bundled model unless --model is given)
  chat    chat through the model's chat template, one message a line; the KV cache carries over between turns
  info    what this machine offers: devices, GPU and PCIe link, CPU SIMD, library versions, cache dir
  bench   measure this machine: `bench bw` stores PCIe/CPU bandwidth for --moe-mode auto
  convert write an HF MoE checkpoint as a GGUF file (q4_0 experts) for llama.cpp and freetoken
  trace   routing traces: synthesise, summarise, and replay them through expert-cache policies
"""


def _cmd_info(args: argparse.Namespace) -> int:
    from freetoken.info import collect, format_report

    info = collect()
    print(json.dumps(info, indent=2) if args.json else format_report(info))
    return 0


def _cmd_run(args: argparse.Namespace) -> int:
    from freetoken.engine.load import load
    from freetoken.engine.sampling import SamplingParams
    from freetoken.loaders import LoadError
    from freetoken.models import ConfigError
    from freetoken.policy.cli import apply_pinning, policy_kwargs

    try:
        sampling = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                                  repetition_penalty=args.repetition_penalty, seed=args.seed)
        model = load(args.model, device=args.device, progress=sys.stderr.isatty(), cache_slots=args.cache_slots,
                     **policy_kwargs(args))
        pin_note = apply_pinning(model, args, args.prompt)
    except (LoadError, ConfigError, ValueError, OSError) as e:
        print(f"freetoken run: error: {e}", file=sys.stderr)
        return 1
    record = args.record_trace is not None
    sys.stdout.write(args.prompt)
    for piece in model.generate_text(args.prompt, args.max_tokens, sampling, record_routing=record):
        sys.stdout.write(piece)
        sys.stdout.flush()
    sys.stdout.write("\n")
    st = model.stats
    cache = model.decoder.cache
    if cache is None:
        experts = f"experts: read in place from host memory ({model.decoder.layout.fmt.name})"
    else:
        from freetoken.policy.runtime import hit_stats

        rate, hits, misses = hit_stats(model.decoder)
        experts = (f"expert cache: {cache.slots} slots, hit rate {rate:.1%} ({hits} hits, {misses} misses, "
                   f"{model.decoder.layout.fmt.name})")
    print(f"[{model.decoder.dev.kind}] prefill {st.prompt_tokens} tokens at {st.prefill_tps:.1f} tok/s, "
          f"generated {st.generated_tokens} tokens, decode at {st.decode_tps:.1f} tok/s; {experts}", file=sys.stderr)
    if cache is not None:
        from freetoken.policy.runtime import report

        print(f"[{model.decoder.dev.kind}] {report(model.decoder)}" + (f"; {pin_note}" if pin_note else ""),
              file=sys.stderr)
    elif pin_note:
        print(f"[{model.decoder.dev.kind}] {pin_note}", file=sys.stderr)
    if record:
        from freetoken.trace.format import TraceRecorder

        cfg = model.config
        moe_layers = sum(cfg.moe_layers)
        rec = TraceRecorder(moe_layers, cfg.num_experts, cfg.top_k, model.decoder.layout.record_bytes,
                            model=cfg.family)
        rec.begin_segment()
        for layer, ids in enumerate(st.prefill_routing):
            rec.add_prefill(layer, ids)
        for step in st.routing:
            rec.add_decode_step(step)
        rec.save(args.record_trace)
        print(f"routing trace: {rec.num_steps} decode steps -> {args.record_trace}", file=sys.stderr)
    return 0


def build_parser() -> argparse.ArgumentParser:
    from freetoken import __version__
    from freetoken.cli_args import add_model_args

    parser = argparse.ArgumentParser(prog="freetoken", description=DESCRIPTION,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"freetoken {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    run = sub.add_parser("run", help="generate text from a prompt",
                         description="Stream a continuation of PROMPT, then report prefill and decode speed.")
    run.add_argument("prompt", help="the text to continue")
    add_model_args(run, 128, "to generate")
    run.add_argument("--record-trace", metavar="FILE", default=None,
                     help="write the routing trace (npz) for `freetoken trace simulate`")
    from freetoken.policy.cli import add_bench_parser, add_policy_args

    add_policy_args(run)
    run.set_defaults(func=_cmd_run)
    info = sub.add_parser("info", help="show devices, versions, GPU/CPU details and the cache directory",
                          description="Show what this machine offers freetoken.")
    info.add_argument("--json", action="store_true", help="print machine-readable JSON")
    info.set_defaults(func=_cmd_info)
    from freetoken.sim.cli import add_trace_parser

    add_trace_parser(sub)
    from freetoken.convert.cli import add_convert_parser

    add_convert_parser(sub)
    add_bench_parser(sub)
    from freetoken.engine.chat_cli import add_chat_parser

    add_chat_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
