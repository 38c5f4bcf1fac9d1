#!/usr/bin/env python
"""Expert-cache simulator throughput: accesses replayed per second, per policy, on a synthetic trace.

    python bench/bench_cache.py [--steps 100000 --layers 48 --experts 128 --top-k 8 --slots 1024,2048,4096]

An access is one (decode step, layer, unique expert id): a 100k-step trace of a 48-layer, top-8 model with one
token per step has 38.4M. Every policy runs on the whole trace (window "all") so each one processes every access;
LRU additionally always replays from the first step. The Numba kernels are compiled (or loaded from the cache)
on a tiny trace first, so the times are steady-state. Generating the trace and deriving the shared arrays
(``prepare``) are timed separately.
"""

from __future__ import annotations

import argparse
import time

from freetoken.sim import policies as P
from freetoken.trace import make_trace, prepare


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=100_000)
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=1)
    ap.add_argument("--segments", type=int, default=100)
    ap.add_argument("--locality", type=float, default=0.5)
    ap.add_argument("--slots", default="1024,2048,4096")
    ap.add_argument("--policies", default=",".join(P.DEFAULT_POLICIES))
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    slots = [int(s) for s in args.slots.split(",")]
    names = args.policies.split(",")

    warm = make_trace(num_layers=2, num_experts=8, top_k=2, steps=20, segments=2, seed=0)
    for name in names:
        P.POLICIES[name](warm, 8, window="all")

    t = time.perf_counter()
    trace = make_trace(num_layers=args.layers, num_experts=args.experts, top_k=args.top_k, steps=args.steps,
                       segments=args.segments, locality=args.locality, seed=args.seed, tokens=args.tokens)
    gen = time.perf_counter() - t
    t = time.perf_counter()
    prep = prepare(trace)
    prep_s = time.perf_counter() - t
    n = int(prep.seq.size)
    print(f"trace: {args.steps:,} steps x {args.layers} layers x {args.tokens} token(s) x top-{args.top_k} of "
          f"{args.experts} experts, {args.segments} segments, locality {args.locality}: {n:,} accesses")
    print(f"generate {gen:.1f} s, prepare {prep_s:.2f} s\n")

    header = f"{'policy':<18} {'slots':>6} {'seconds':>8} {'M accesses/s':>13} {'miss rate':>10}"
    print(header)
    print("-" * len(header))
    total = 0.0
    for s in slots:
        for name in names:
            t = time.perf_counter()
            r = P.POLICIES[name](trace, s, window="all")
            dt = time.perf_counter() - t
            total += dt
            print(f"{name:<18} {s:>6} {dt:>8.2f} {n / dt / 1e6:>13.1f} {100 * r.miss_rate:>9.2f}%")
        print()
    print(f"all policies x slot counts: {total:.1f} s")


if __name__ == "__main__":
    main()
