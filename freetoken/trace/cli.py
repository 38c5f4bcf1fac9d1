"""``freetoken trace``: simulate cache policies on a routing trace, write synthetic traces, summarise a trace.

:func:`add_trace_parser` registers the command on the main ``freetoken`` parser; :func:`main` runs a parser
with just this command (``python -m freetoken.trace.cli trace ...``).
"""

from __future__ import annotations

import argparse
import json
import sys

TRACE_DESCRIPTION = """\
Routing traces and the expert-cache simulator.

Subcommands:
  simulate  replay a trace through the cache policies at several slot counts; print the table (and a plot)
  synth     write a synthetic trace with tunable locality
  info      summarise a trace: shape, segments, per-layer expert-usage entropy, working set
"""


def _slots(text: str) -> list[int]:
    try:
        vals = [int(v) for v in text.replace(" ", "").split(",") if v]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected N[,N...] (integers), got {text!r}") from None
    if not vals or min(vals) < 0:
        raise argparse.ArgumentTypeError(f"expected non-negative slot counts N[,N...], got {text!r}")
    return vals


def _names(text: str) -> list[str]:
    from freetoken.trace.policies import POLICIES

    names = [v for v in text.replace(" ", "").split(",") if v]
    bad = [n for n in names if n not in POLICIES]
    if bad or not names:
        known = ", ".join(POLICIES)
        raise argparse.ArgumentTypeError(f"unknown policy {', '.join(bad) or repr(text)} (known: {known})")
    return names


def _error(e: Exception) -> int:
    print(f"freetoken trace: error: {e}", file=sys.stderr)
    return 1


def _cmd_simulate(args: argparse.Namespace) -> int:
    from freetoken.trace.format import TraceError, load_trace
    from freetoken.trace.simulate import format_table, simulate

    try:
        trace = load_trace(args.trace)
        rows = simulate(trace, args.slots, window=args.window, policies=args.policies,
                        prefill_borrow=not args.no_prefill_borrow)
    except (TraceError, ValueError, OSError) as e:
        return _error(e)
    print(json.dumps(rows, indent=2) if args.json else format_table(rows))
    if args.plot:
        from freetoken.trace.plot import plot_miss_rates

        try:
            title = f"{trace.model or args.trace}: {trace.steps:,} decode steps"
            plot_miss_rates(rows, args.plot, title=title)
        except (RuntimeError, OSError, ValueError) as e:
            return _error(e)
        if not args.json:
            print(f"plot written to {args.plot}")
    return 0


def _cmd_synth(args: argparse.Namespace) -> int:
    from freetoken.trace.format import save_trace
    from freetoken.trace.synthetic import make_trace

    try:
        trace = make_trace(num_layers=args.layers, num_experts=args.experts, top_k=args.top_k, steps=args.steps,
                           segments=args.segments, locality=args.locality, seed=args.seed,
                           record_bytes=args.record_bytes, tokens=args.tokens, prefill_tokens=args.prefill_tokens)
        save_trace(args.out, trace)
    except (ValueError, OSError) as e:
        return _error(e)
    print(f"wrote {args.out}: {trace.steps:,} decode steps x {trace.num_layers} layers x {trace.tokens} token(s) x "
          f"top-{trace.top_k} of {trace.num_experts} experts, {trace.num_segments} segments, locality {args.locality}")
    return 0


def _cmd_info(args: argparse.Namespace) -> int:
    from freetoken.trace.format import TraceError, load_trace
    from freetoken.trace.simulate import format_summary, summarize

    try:
        summary = summarize(load_trace(args.trace))
    except (TraceError, ValueError, OSError) as e:
        return _error(e)
    if args.json:
        summary["hot_set"] = {str(k): v for k, v in summary["hot_set"].items()}
        summary["working_set"] = {str(k): v for k, v in summary["working_set"].items()}
        print(json.dumps(summary, indent=2))
    else:
        print(format_summary(summary, args.trace))
    return 0


def add_trace_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``trace`` (with ``simulate``, ``synth``, ``info``) on ``subparsers``; returns its parser."""
    from freetoken.trace.policies import DEFAULT_POLICIES, POLICIES

    trace = subparsers.add_parser("trace", help="routing traces and the expert-cache policy simulator",
                                  description=TRACE_DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = trace.add_subparsers(dest="trace_command", metavar="SUBCOMMAND")

    def _help(_args, parser=trace) -> int:
        parser.print_help()
        return 2

    trace.set_defaults(func=_help)

    sim = sub.add_parser("simulate", help="replay a trace through cache policies; print miss rates",
                         description="Replay a trace through cache policies at several slot counts. An access is "
                                     "one (decode step, layer, unique expert); a miss is an access not served "
                                     "from the GPU cache; loads are records copied in (bytes = loads x record "
                                     "bytes; one-time placements included). belady is the lower bound.")
    sim.add_argument("trace", help="trace file (.npz)")
    sim.add_argument("--slots", type=_slots, required=True, metavar="N[,N...]", help="cache slot counts")
    sim.add_argument("--window", choices=("all", "second_half"), default="second_half",
                     help="decode steps to score (default second_half; static_frequency always scores the "
                          "second half, having trained on the first)")
    sim.add_argument("--no-prefill-borrow", action="store_true",
                     help="lru: do not empty the first 2*experts slots at each segment start")
    sim.add_argument("--policies", type=_names, default=list(DEFAULT_POLICIES), metavar="P[,P...]",
                     help=f"policies to run (default {','.join(DEFAULT_POLICIES)}; known: {', '.join(POLICIES)})")
    sim.add_argument("--plot", metavar="FILE.png", help="also draw miss rate against slots (needs matplotlib)")
    sim.add_argument("--json", action="store_true", help="print the rows as JSON")
    sim.set_defaults(func=_cmd_simulate)

    syn = sub.add_parser("synth", help="write a synthetic trace",
                         description="Write a synthetic trace: Zipf-like per-layer popularity (exponent 1.5 x "
                                     "locality), per-segment drift that the prefill counts reflect, and each "
                                     "token's top-k positions keeping the previous step's expert with probability "
                                     "locality. See freetoken/trace/synthetic.py.")
    syn.add_argument("out", help="output trace file (.npz)")
    syn.add_argument("--layers", type=int, default=8, help="MoE layers (default 8)")
    syn.add_argument("--experts", type=int, default=64, help="routed experts per layer (default 64)")
    syn.add_argument("--top-k", type=int, default=4, help="experts per token (default 4)")
    syn.add_argument("--steps", type=int, default=1000, help="decode steps (default 1000)")
    syn.add_argument("--segments", type=int, default=4, help="segments (prompts / turns), default 4")
    syn.add_argument("--locality", type=float, default=0.5, help="0 (uniform, independent) .. 1 (default 0.5)")
    syn.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    syn.add_argument("--record-bytes", type=int, default=1 << 20, help="bytes per expert record (default 1 MiB)")
    syn.add_argument("--tokens", type=int, default=1, help="decode batch size (default 1)")
    syn.add_argument("--prefill-tokens", type=int, default=256, help="prefill tokens per segment (default 256)")
    syn.set_defaults(func=_cmd_synth)

    info = sub.add_parser("info", help="summarise a trace", description="Summarise a trace: shape, segments, "
                          "per-layer expert-usage entropy, working set.")
    info.add_argument("trace", help="trace file (.npz)")
    info.add_argument("--json", action="store_true", help="print machine-readable JSON")
    info.set_defaults(func=_cmd_info)
    return trace
