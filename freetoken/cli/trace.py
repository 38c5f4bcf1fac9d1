"""``freetoken trace``: simulate cache policies on a routing trace (:mod:`freetoken.sim`), write synthetic traces,
summarise a trace.

:func:`add_trace_parser` registers the command on the main ``freetoken`` parser (``freetoken trace ...``); a bad
trace or flag is one error line and exit code 2 (``freetoken.cli.main``).
"""

from __future__ import annotations

import argparse
import json

TRACE_DESCRIPTION = """\
Routing traces and the expert-cache simulator.

Subcommands:
  simulate  replay a trace through the cache policies at several slot counts; print the table (and a plot);
            with --pcie/--cpu, model decode-step time for fetch-all, cpu-all, q* and q* + prefetch instead,
            (with --policies also tokens/s per cache policy)
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


def _name_list(known, what: str):
    """An argparse type: a comma-separated list of names out of ``known``."""
    def parse(text: str) -> list[str]:
        names = [v for v in text.replace(" ", "").split(",") if v]
        bad = [n for n in names if n not in known]
        if bad or not names:
            raise argparse.ArgumentTypeError(f"unknown {what} {', '.join(bad) or repr(text)} "
                                             f"(known: {', '.join(known)})")
        return names
    return parse


def _cmd_timing(args: argparse.Namespace, trace) -> int:
    """``simulate --pcie --cpu``: the decode-step time model per mode, optionally swept over PCIe/CPU ratios."""
    from freetoken.sim.timing import (
        MODES,
        POLICY_MODES,
        format_policy_timing,
        format_sweep,
        format_timing,
        sweep,
        time_modes,
        time_policies,
    )

    if args.pcie is None or args.cpu is None:
        raise ValueError("the time model needs both --pcie and --cpu (GB/s)")
    do_sweep = args.sweep or bool(args.plot)
    modes = args.modes or list(MODES)
    if (args.host_memory is None) != (args.disk is None):
        raise ValueError("the disk tier needs both --host-memory (SIZE) and --disk (GB/s)")
    kw = dict(window=args.window, future_value=args.future_value, layer_s=args.layer_us * 1e-6,
              predictor=args.predictor, prefetch_n=args.prefetch_n, prefill_borrow=not args.no_prefill_borrow,
              host_memory=args.host_memory, disk_gbps=args.disk)
    policies = args.policies or []  # the per-policy table only when asked for: the default output stays as it was
    bad = [p for p in policies if p not in POLICY_MODES]
    if bad:
        raise ValueError(f"the time model replays only the demand policies ({', '.join(POLICY_MODES)}), not "
                         f"{', '.join(bad)}")
    pkw = dict(window=args.window, layer_s=args.layer_us * 1e-6, prefill_borrow=not args.no_prefill_borrow,
               host_memory=args.host_memory, disk_gbps=args.disk, bypassed=args.bypassed)
    results, rows, per_policy = [], [], []
    for slots in args.slots:
        results += time_modes(trace, slots, args.pcie, args.cpu, args.gpu, modes=modes, **kw)
        if policies:
            per_policy += time_policies(trace, slots, args.pcie, args.cpu, args.gpu, policies=policies, **pkw)
        if do_sweep:
            rows += sweep(trace, slots, args.cpu, modes=modes, gpu_gbps=args.gpu, **kw)
    if args.json:
        out = {"timing": [r.as_row() for r in results]}
        if policies:
            out["policies"] = [{**r.as_row(), "policy": r.mode,
                                "miss_rate": r.misses / r.accesses if r.accesses else 0.0} for r in per_policy]
        if do_sweep:
            out["sweep"] = rows
        print(json.dumps(out, indent=2))
    else:
        print(format_timing(results))
        if policies:
            print()
            print(format_policy_timing(per_policy, args.bypassed))
        if do_sweep:
            print()
            print(format_sweep(rows))
    if args.plot:
        from freetoken.sim.plot import plot_timing_sweep

        title = f"{trace.model or args.trace}: CPU {args.cpu:g} GB/s, {trace.record_bytes / 1e6:.3g} MB records"
        return _plot(args, plot_timing_sweep, rows, title)
    return 0


def _plot(args: argparse.Namespace, plot_fn, rows, title: str) -> int:
    """Draw ``rows`` with ``plot_fn`` into ``args.plot`` (a ValueError when it cannot)."""
    try:
        plot_fn(rows, args.plot, title=title)
    except RuntimeError as e:  # matplotlib missing, say
        raise ValueError(str(e)) from e
    if not args.json:
        print(f"plot written to {args.plot}")
    return 0


def _cmd_simulate(args: argparse.Namespace) -> int:
    from freetoken.sim.policies import DEFAULT_POLICIES
    from freetoken.sim.simulate import format_table, simulate
    from freetoken.trace.format import load_trace

    timing = args.pcie is not None or args.cpu is not None or args.sweep or args.host_memory is not None \
        or args.disk is not None
    trace = load_trace(args.trace)
    if timing:
        return _cmd_timing(args, trace)
    rows = simulate(trace, args.slots, window=args.window, policies=args.policies or list(DEFAULT_POLICIES),
                    prefill_borrow=not args.no_prefill_borrow)
    print(json.dumps(rows, indent=2) if args.json else format_table(rows))
    if args.plot:
        from freetoken.sim.plot import plot_miss_rates

        return _plot(args, plot_miss_rates, rows, f"{trace.model or args.trace}: {trace.steps:,} decode steps")
    return 0


def _cmd_synth(args: argparse.Namespace) -> int:
    from freetoken.trace.format import save_trace
    from freetoken.trace.synthetic import make_trace

    trace = make_trace(num_layers=args.layers, num_experts=args.experts, top_k=args.top_k, steps=args.steps,
                       segments=args.segments, locality=args.locality, seed=args.seed,
                       record_bytes=args.record_bytes, tokens=args.tokens, prefill_tokens=args.prefill_tokens)
    save_trace(args.out, trace)
    print(f"wrote {args.out}: {trace.steps:,} decode steps x {trace.num_layers} layers x {trace.tokens} token(s) x "
          f"top-{trace.top_k} of {trace.num_experts} experts, {trace.num_segments} segments, locality {args.locality}")
    return 0


def _cmd_info(args: argparse.Namespace) -> int:
    from freetoken.sim.simulate import format_summary, summarize
    from freetoken.trace.format import load_trace

    summary = summarize(load_trace(args.trace))
    if args.json:
        summary["hot_set"] = {str(k): v for k, v in summary["hot_set"].items()}
        summary["working_set"] = {str(k): v for k, v in summary["working_set"].items()}
        print(json.dumps(summary, indent=2))
    else:
        print(format_summary(summary, args.trace))
    return 0


def add_trace_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``trace`` (with ``simulate``, ``synth``, ``info``) on ``subparsers``; returns its parser."""
    from freetoken.cli.args import count, future_value, real, size
    from freetoken.sim.policies import DEFAULT_POLICIES, POLICIES
    from freetoken.sim.timing import ALL_MODES, POLICY_MODES

    gbps = real(0.0, above=True)

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
                                     "bytes; one-time placements included). belady is the lower bound. "
                                     "lfu_decay (LFU with exponential decay) and next_use (expected time to next "
                                     "use) are online like lru; +bypass: a miss expected back later than its "
                                     "victim is served without loading; default: the policy recommended for the "
                                     "runtime (next_use+bypass with the prefill prior).")
    sim.add_argument("trace", help="trace file (.npz)")
    sim.add_argument("--slots", type=_slots, required=True, metavar="N[,N...]", help="cache slot counts")
    sim.add_argument("--window", choices=("all", "second_half"), default="second_half",
                     help="decode steps to score (default second_half; static_frequency always scores the "
                          "second half, having trained on the first)")
    sim.add_argument("--no-prefill-borrow", action="store_true",
                     help="lru, lfu_decay, next_use, default: do not empty the first 2*experts slots at each "
                          "segment start")
    sim.add_argument("--policies", type=_name_list(POLICIES, "policy"), default=None, metavar="P[,P...]",
                     help=f"policies to run (default {','.join(DEFAULT_POLICIES)}; known: {', '.join(POLICIES)}); "
                          "with --pcie/--cpu: also time these cache policies (the demand policies "
                          f"{', '.join(POLICY_MODES)})")
    sim.add_argument("--plot", metavar="FILE.png", help="also draw miss rate against slots (needs matplotlib); with "
                                                        "--pcie/--cpu: tokens/s against the PCIe/CPU ratio per mode "
                                                        "(implies --sweep)")
    sim.add_argument("--json", action="store_true", help="print the rows as JSON")
    tm = sim.add_argument_group("decode time model (freetoken/sim/timing.py)",
                                "With --pcie and --cpu, model each decode step's time for fetch-all, cpu-all, q* and "
                                "q* with prefetch instead of the policy table: estimated tokens/s and where the "
                                "time goes, per slot count; with --policies also tokens/s per cache policy: the "
                                "policy's admitted misses fetched, its bypassed ones computed on the CPU (lru = "
                                "fetch_all).")
    tm.add_argument("--bypassed", choices=["cpu", "stream"], default="cpu",
                    help="with --policies: a bypassed miss is computed on the CPU (cpu, the default: the q* "
                         "executor) or copied over PCIe through a scratch slot and not kept (stream: what the "
                         "runtime's --moe-mode gpu does)")
    tm.add_argument("--pcie", type=gbps, metavar="GBPS", help="host-to-GPU copy bandwidth, GB/s")
    tm.add_argument("--cpu", type=gbps, metavar="GBPS", help="CPU expert bandwidth (weights streamed), GB/s")
    tm.add_argument("--gpu", type=gbps, metavar="GBPS", default=900.0, help="GPU memory bandwidth, GB/s (default 900)")
    tm.add_argument("--future-value", type=future_value, default="auto", metavar="S|auto|global",
                    help="q*: seconds saved later per fetched expert; auto (default): per expert, the hits a "
                         "residency is expected to earn (from its re-use gaps vs the cache's residency time) x the "
                         "time a hit saves; global: hits per record lifetime so far x the time a hit saves")
    tm.add_argument("--layer-us", type=real(), default=0.0, metavar="US",
                    help="non-expert GPU time per MoE layer, microseconds (default 0)")
    tm.add_argument("--predictor", choices=("coact", "prev", "oracle"), default="coact",
                    help="prefetch predictor: coact (cross-layer co-activation learned on the first half), prev "
                         "(the previous step's experts), oracle (perfect); default coact")
    tm.add_argument("--prefetch-n", type=count(1), default=None, metavar="N",
                    help="experts predicted per call (default top_k x tokens)")
    tm.add_argument("--modes", type=_name_list(ALL_MODES, "mode"), default=None, metavar="M[,M...]",
                    help="modes (default fetch_all,cpu_all,qstar,qstar_prefetch; also fetch_all_prefetch)")
    tm.add_argument("--host-memory", type=size, default=None, metavar="SIZE",
                    help="host memory for the expert records (e.g. 8GB); below the model's records, a disk tier: "
                         "records a call misses are read from disk when host memory does not hold them (with --disk)")
    tm.add_argument("--disk", type=gbps, default=None, metavar="GBPS",
                    help="disk read bandwidth, GB/s (the disk tier of --host-memory)")
    tm.add_argument("--sweep", action="store_true",
                    help="also sweep PCIe = 0.25x .. 4x the CPU bandwidth (9 geometric steps) and print tokens/s")
    sim.set_defaults(func=_cmd_simulate)

    syn = sub.add_parser("synth", help="write a synthetic trace",
                         description="Write a synthetic trace: Zipf-like per-layer popularity (exponent 1.5 x "
                                     "locality), per-segment drift that the prefill counts reflect, and each "
                                     "token's top-k positions keeping the previous step's expert with probability "
                                     "locality. See freetoken/trace/synthetic.py.")
    syn.add_argument("out", help="output trace file (.npz)")
    syn.add_argument("--layers", type=count(1), default=8, help="MoE layers (default 8)")
    syn.add_argument("--experts", type=count(1), default=64, help="routed experts per layer (default 64)")
    syn.add_argument("--top-k", type=count(1), default=4, help="experts per token (default 4)")
    syn.add_argument("--steps", type=count(1), default=1000, help="decode steps (default 1000)")
    syn.add_argument("--segments", type=count(1), default=4, help="segments (prompts / turns), default 4")
    syn.add_argument("--locality", type=real(0.0, 1.0), default=0.5,
                     help="0 (uniform, independent) .. 1 (default 0.5)")
    syn.add_argument("--seed", type=count(0), default=0, help="random seed (default 0)")
    syn.add_argument("--record-bytes", type=count(1), default=1 << 20, help="bytes per expert record (default 1 MiB)")
    syn.add_argument("--tokens", type=count(1), default=1, help="decode batch size (default 1)")
    syn.add_argument("--prefill-tokens", type=count(0), default=256, help="prefill tokens per segment (default 256)")
    syn.set_defaults(func=_cmd_synth)

    info = sub.add_parser("info", help="summarise a trace", description="Summarise a trace: shape, segments, "
                          "per-layer expert-usage entropy, working set.")
    info.add_argument("trace", help="trace file (.npz)")
    info.add_argument("--json", action="store_true", help="print machine-readable JSON")
    info.set_defaults(func=_cmd_info)
    return trace
