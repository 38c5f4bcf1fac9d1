"""q* against fetch-all and cpu-all on REAL routing traces of the bundled model, across PCIe/CPU bandwidth ratios.

Records a trace: the bundled model (cpu device) continues ``--prompts`` openings of standard-library modules,
``--tokens`` sampled tokens each, every prompt a segment (its prefill routing counted, as a new turn of an agent
loop would be); then runs the trace time model (freetoken.sim.timing) at each slot count over PCIe = 0.25x ..
4x the CPU bandwidth and prints the table and, per slot count, the worst qstar / best-extreme ratio.

Then it compares the future-value estimators (``--compare``, default ``auto,global,0``): qstar's tokens/s with each
at every (slot count, ratio) point, relative to the best extreme, and per estimator the geometric mean and the worst
of that ratio over all points; the one with the higher geometric mean is the runtime's default
(``freetoken.policy.split_policy.DEFAULT_FUTURE_VALUE``).

    python bench/qstar_sweep.py --trace /tmp/default-trace.npz [--plot /tmp/qstar.png]
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path


def record(path: Path, prompts: int, tokens: int, seed: int) -> None:
    from freetoken.engine.decoding.sampling import SamplingParams
    from freetoken.engine.loading.load import load
    from freetoken.trace.format import TraceRecorder

    model = load(None, device="cpu", ctx=1024)
    cfg = model.config
    rec = TraceRecorder(sum(cfg.moe_layers), cfg.num_experts, cfg.top_k, model.experts.layout.record_bytes,
                        model="bundled qwen3_moe")
    root = Path(os.__file__).parent
    files = sorted(p for p in root.glob("*.py") if p.stat().st_size > 4000)[:prompts]
    for i, f in enumerate(files):
        prompt = f.read_text(errors="replace")[:600]
        sampling = SamplingParams(temperature=0.8, top_p=0.95, seed=seed + i)
        list(gen := model.generate(prompt, tokens, sampling, record_routing=True))
        rec.add_segment(gen.stats.prefill_routing, gen.stats.routing)
    rec.save(path)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", type=Path, default=Path("/tmp/freetoken-default-trace.npz"))
    ap.add_argument("--prompts", type=int, default=12)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--slots", default="24,40,56,72", help="slot counts (the model has 96 expert records)")
    ap.add_argument("--cpu", type=float, default=50.0, help="CPU GB/s (PCIe = ratio x this)")
    ap.add_argument("--future-value", default="global", help="auto, global or seconds (default global)")
    ap.add_argument("--plot", type=Path, default=None)
    ap.add_argument("--compare", default="auto,global,0",
                    help="future values to compare (auto, global or seconds; empty: no comparison)")
    args = ap.parse_args(argv)

    from freetoken.sim.timing import format_sweep, sweep
    from freetoken.trace.format import load_trace

    if not args.trace.exists():
        record(args.trace, args.prompts, args.tokens, args.seed)
    trace = load_trace(args.trace)
    fv = args.future_value if args.future_value in ("auto", "global") else float(args.future_value)
    steps = trace.decode_ids.shape[0]
    print(f"# trace {args.trace}: {steps} decode steps, {trace.num_layers} MoE layers x {trace.num_experts} "
          f"experts, top-{trace.top_k}, {trace.record_bytes:,}-byte records; CPU {args.cpu} GB/s")
    worst = {}
    all_rows = []
    for slots in (int(s) for s in args.slots.split(",")):
        rows = sweep(trace, slots, args.cpu, future_value=fv, window="all")
        all_rows += [{"slots": slots, **r} for r in rows]
        by_ratio: dict[float, dict] = {}
        for r in rows:
            by_ratio.setdefault(r["ratio"], {})[r["mode"]] = r["tokens_per_s"]
        worst[slots] = min(v["qstar"] / max(v["fetch_all"], v["cpu_all"]) for v in by_ratio.values())
    print(format_sweep(all_rows))
    for slots, w in worst.items():
        print(f"slots {slots}: worst qstar / best(fetch_all, cpu_all) over the sweep = {w:.4f}")
    if args.plot:
        from freetoken.sim.plot import plot_timing_sweep

        plot_timing_sweep(all_rows, args.plot, title="bundled model: tokens/s vs PCIe/CPU bandwidth")
        print(f"plot written to {args.plot}")
    if args.compare:
        print()
        print(compare_future_values(trace, [int(s) for s in args.slots.split(",")], args.cpu,
                                    [_future_value(v) for v in args.compare.split(",") if v]))
    return 0 if min(worst.values()) >= 1 - 1e-9 else 1


def _future_value(text: str) -> float | str:
    return text if text in ("auto", "global") else float(text)


def compare_future_values(trace, slots_list, cpu_gbps: float, values) -> str:
    """qstar / best(fetch_all, cpu_all) per (slots, ratio) for each future value, and per value the geometric mean
    and the worst over every point; names the value with the higher geometric mean."""
    import math

    from freetoken.sim.table import text_table
    from freetoken.sim.timing import sweep

    labels = [v if isinstance(v, str) else f"{v:g}" for v in values]
    cells: dict[tuple[int, float], dict[str, float]] = {}
    for slots in slots_list:
        for v, label in zip(values, labels, strict=True):
            for r in sweep(trace, slots, cpu_gbps, modes=("fetch_all", "cpu_all", "qstar"), future_value=v,
                           window="all"):
                d = cells.setdefault((slots, r["ratio"]), {})
                d[r["mode"]] = r["tokens_per_s"]
                if r["mode"] == "qstar":
                    d[label] = r["tokens_per_s"]
    body, groups = [], []
    rel: dict[str, list[float]] = {label: [] for label in labels}
    for (slots, ratio), d in cells.items():
        best = max(d["fetch_all"], d["cpu_all"])
        for label in labels:
            rel[label].append(d[label] / best)
        body.append([str(slots), f"{ratio:.3g}x", f"{best:,.2f}", *(f"{d[label] / best:.4f}" for label in labels)])
        groups.append(slots)
    gmean = {label: math.exp(sum(math.log(x) for x in xs) / len(xs)) for label, xs in rel.items()}
    body.append(["all", "", "geo mean", *(f"{gmean[label]:.4f}" for label in labels)])
    body.append(["all", "", "worst", *(f"{min(rel[label]):.4f}" for label in labels)])
    groups += ["summary", "summary"]
    lines = text_table(["slots", "PCIe/CPU", "best tok/s", *(f"fv {label}" for label in labels)], body, groups=groups)
    winner = max(labels, key=lambda label: (gmean[label], min(rel[label])))
    lines.append(f"qstar tokens/s / best(fetch_all, cpu_all) per future value; better: {winner}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
