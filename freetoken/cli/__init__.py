"""The ``freetoken`` command line."""

from __future__ import annotations

import argparse
import json
import sys

DESCRIPTION = """\
freetoken runs huge Mixture-of-Experts language models on one consumer NVIDIA GPU plus host memory:
the routed experts live in host memory, the GPU caches the hot ones.

Commands:
  run     generate text from a prompt or --prompt-file (the bundled model unless --model is given)
  chat    chat through the model's chat template, one message a line; the KV cache carries over between turns
  serve   an OpenAI-compatible HTTP server (chat and text completions, streaming, metrics) for coding agents
  info    what this machine offers: devices, GPU and PCIe link, CPU SIMD, library versions, cache dir
  bench   measure this machine: `bench bw` stores PCIe/CPU bandwidth for --moe-mode auto
  convert write an HF MoE checkpoint as a GGUF file (q4_0 experts), or any model as an FTW file (docs/ftw.md)
  perplexity  a model's perplexity on a text file, measured as llama.cpp's perplexity tool does
  trace   routing traces: synthesise, summarise, and replay them through expert-cache policies
"""


def _cmd_info(args: argparse.Namespace) -> int:
    from freetoken.info import collect, format_report

    info = collect()
    print(json.dumps(info, indent=2) if args.json else format_report(info))
    return 0


def _cmd_run(args: argparse.Namespace) -> int:
    from freetoken.cli.args import check_text, check_writable, context_kwargs, read_prompt_file
    from freetoken.cli.policy import apply_pinning, policy_kwargs
    from freetoken.engine.decoding.sampling import SamplingParams
    from freetoken.engine.loading.load import load
    from freetoken.engine.loading.memory_report import breakdown_line, memory_line, types_line

    if (args.prompt is None) == (args.prompt_file is None):
        raise ValueError("give the prompt as an argument or with --prompt-file PATH (one of the two)")
    if args.prompt_file is not None:
        prompt = read_prompt_file(args.prompt_file)
    else:
        prompt = check_text(args.prompt, "the prompt")
    if not prompt:
        raise ValueError("the prompt is empty" + (f" (--prompt-file {args.prompt_file})" if args.prompt_file else ""))
    if args.record_trace is not None:
        check_writable(args.record_trace, "--record-trace")  # before the work, not after it
    sampling = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                              repetition_penalty=args.repetition_penalty, seed=args.seed)
    model = load(args.model, device=args.device, progress=sys.stderr.isatty(), cache_slots=args.cache_slots,
                 **policy_kwargs(args), **context_kwargs(args))
    kind = model.decoder.dev.kind
    n = len(model.encode(prompt))
    if n >= model.decoder.ctx:
        raise ValueError(f"the prompt is {n} tokens; the context holds {model.decoder.ctx} (prompt and generated "
                         "tokens together; --ctx or --kv-memory for more)")
    print(f"[{kind}] {model.decoder.context_plan.why}", file=sys.stderr)
    for note in model.decoder.cfg.notes():
        print(f"[{kind}] {note}", file=sys.stderr)
    pin_note = apply_pinning(model, args, prompt)
    record = args.record_trace is not None
    sys.stdout.write(prompt)
    reply = model.generate_text(prompt, args.max_tokens, sampling, record_routing=record)
    for piece in reply:
        sys.stdout.write(piece)
        sys.stdout.flush()
    sys.stdout.write("\n")
    st = reply.stats
    print(f"[{kind}] prefill {st.prompt_tokens} tokens at {st.prefill_tps:.1f} tok/s, "
          f"generated {st.generated_tokens} tokens, decode at {st.decode_tps:.1f} tok/s; {model.experts.summary()}",
          file=sys.stderr)
    report = "; ".join(p for p in (model.experts.report(), pin_note) if p)
    if report:
        print(f"[{kind}] {report}", file=sys.stderr)
    if record:
        from freetoken.trace.format import TraceRecorder

        cfg = model.config
        moe_layers = sum(cfg.moe_layers)
        rec = TraceRecorder(moe_layers, cfg.num_experts, cfg.top_k, model.experts.layout.record_bytes,
                            model=cfg.family)
        rec.add_segment(st.prefill_routing, st.routing)
        rec.save(args.record_trace)
        print(f"routing trace: {rec.num_steps} decode steps -> {args.record_trace}", file=sys.stderr)
    print(f"[{kind}] {memory_line(model)}", file=sys.stderr)
    print(f"[{kind}] {types_line(model)}", file=sys.stderr)
    if model.experts.tier is not None:  # the host tier over the FTW file (--host-memory)
        print(f"[{kind}] {model.experts.tier_report()}", file=sys.stderr)
    if args.verbose:
        print(f"[{kind}] {breakdown_line(model)}", file=sys.stderr)
    return 0


def build_parser() -> argparse.ArgumentParser:
    from freetoken.cli.args import Parser, add_model_args
    from freetoken.version import __version__

    parser = Parser(prog="freetoken", description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"freetoken {__version__}")
    parser.add_argument("--debug", action="store_true", help="show the traceback of an error (for bug reports)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    run = sub.add_parser("run", help="generate text from a prompt",
                         description="Stream a continuation of PROMPT, then report prefill and decode speed.")
    run.add_argument("prompt", nargs="?", default=None, help="the text to continue (or --prompt-file)")
    run.add_argument("--prompt-file", metavar="PATH", default=None, help="read the prompt from a UTF-8 text file")
    add_model_args(run, 128, "to generate")
    run.add_argument("--record-trace", metavar="FILE", default=None,
                     help="write the routing trace (npz) for `freetoken trace simulate`")
    from freetoken.cli.policy import add_bench_parser, add_policy_args

    add_policy_args(run)
    run.set_defaults(func=_cmd_run)
    info = sub.add_parser("info", help="show devices, versions, GPU/CPU details and the cache directory",
                          description="Show what this machine offers freetoken.")
    info.add_argument("--json", action="store_true", help="print machine-readable JSON")
    info.set_defaults(func=_cmd_info)
    from freetoken.cli.trace import add_trace_parser

    add_trace_parser(sub)
    from freetoken.cli.convert import add_convert_parser
    from freetoken.cli.perplexity import add_perplexity_parser

    add_convert_parser(sub)
    add_perplexity_parser(sub)
    add_bench_parser(sub)
    from freetoken.cli.chat import add_chat_parser

    add_chat_parser(sub)
    from freetoken.cli.serve import add_serve_parser

    add_serve_parser(sub)
    return parser


#: What bad input raises (a file, a flag, a request the loaders or the model refuse): one line, exit code 2.
def _input_errors() -> tuple[type[BaseException], ...]:
    from freetoken.cache import CacheError
    from freetoken.device import DeviceUnavailable
    from freetoken.loaders import LoadError
    from freetoken.models import ConfigError
    from freetoken.trace.format import TraceError

    return LoadError, ConfigError, TraceError, ValueError, OSError, DeviceUnavailable, UnicodeError, CacheError


def main(argv: list[str] | None = None) -> int:
    """``freetoken ...``: the exit code (0 ok, 2 bad input, 130 interrupted)."""
    from freetoken.cli.args import UsageError

    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except UsageError as e:
        print(f"{e.prog}: error: {e}", file=sys.stderr)
        return 2
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    command = f"freetoken {args.command}" + (f" {args.bench_command}" if args.command == "bench" else "")
    try:
        return args.func(args)
    except KeyboardInterrupt:
        if args.debug:
            raise
        print(f"\n{command}: interrupted", file=sys.stderr)
        return 130
    except _input_errors() as e:
        if args.debug:
            raise
        print(f"{command}: error: {_one_line(e)}", file=sys.stderr)
        return 2


def _one_line(e: BaseException) -> str:
    """The message of ``e`` on one line (an OSError's strerror and file included)."""
    text = str(e) or type(e).__name__
    return " ".join(text.split("\n")) if "\n" in text else text


if __name__ == "__main__":
    sys.exit(main())
