#!/usr/bin/env python
"""Bandwidth benchmark of the CPU expert kernels (``cpu_kernels/moe_experts.py``), one table.

    python bench/bench_experts.py            # Qwen3-30B-A3B and DeepSeek-V3 expert shapes, T = 1 and 16 (~3 min)
    python bench/bench_experts.py --quick    # small E: a smoke run (the weights fit in the caches)

For each format, expert shape and token count: the routed-expert forward (k = 8, random routing) over E experts
whose weights exceed the CPU caches. Columns:

* ``uniq``: unique experts per call (median); ``MB``: their record bytes, i.e. the weight bytes one call must read;
* ``ms``: median time per call after warm-up; ``GB/s``: record bytes / median time;
* ``read``, ``%bw``: this machine's memory read bandwidth (a parallel Numba read kernel over a 512 MiB array using
  all threads, measured right before and after the row's timed calls, mean of both) and GB/s as a fraction of it;
* ``GFLOP/s``: 2 x 3 x H x I x k x T flops (every routed pair's gate, up and down products) per second: what a
  prompt's compute-bound calls (T = 16, 128) reach, to set against the machine's int8 (or fp32) peak;
* ``cpu``: this process's CPU time over wall time x threads during the timed calls: well below 100% means other
  processes took cores and the row is not a clean measurement;
* ``numpy ms`` / ``x``: NumPy (BLAS, all threads) doing the same forward on pre-dequantized float32 weights of the
  same values, and its time divided by the kernel's (>1: the kernel is faster); ``err``: max |kernel - NumPy|
  relative to max |NumPy| (a sanity check: both read the same weight values).

Records are built from two experts quantized by the format's codec, tiled to E (values do not change the speed).
At T = 1 each call draws its 8 experts from those the previous call did not use, so consecutive calls do not hit
in the last-level cache. Keep the machine otherwise idle: the kernels use every thread, and a busy core stalls the
other thread at the end of each parallel region.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numba as nb
import numpy as np
from freetoken.cpu_kernels.moe_experts import ACT_SWIGLU, forward, prepare, uses_q8

from freetoken import formats
from freetoken.device.simd import simd_level
from freetoken.formats import RecordLayout

SHAPES = {  # name: (hidden, inter, experts, experts with --quick)
    "qwen3-30b-a3b": (2048, 768, 64, 16),
    "half-width": (1024, 384, 64, 16),  # bench_decode's 16-layer synthetic model: 0.66 MB per expert
    "deepseek-v3": (7168, 2048, 16, 8),
}
TOP_K = 8


@nb.njit(parallel=True, fastmath=True, cache=True)
def _read_kernel(a, chunks, out):
    per = a.shape[0] // chunks
    for c in nb.prange(chunks):
        part = a[c * per:(c + 1) * per]  # a slice keeps the loop vectorised
        acc = np.float32(0.0)
        for i in range(part.shape[0]):
            acc += part[i]
        out[c] = acc


class ReadBandwidth:
    """Memory read bandwidth in GB/s: a vectorised parallel sum over a float32 array far larger than the caches, on
    every thread. The host's bandwidth drifts (a VM shares it with its neighbours: we saw 41 to 80 GB/s within
    minutes), so the benchmark measures it right before and after every case and compares with their mean."""

    def __init__(self, nbytes: int = 512 << 20):
        self.a = np.ones(nbytes // 4, np.float32)
        self.chunks = 8 * nb.get_num_threads()
        self.out = np.zeros(self.chunks, np.float32)
        for _ in range(3):
            _read_kernel(self.a, self.chunks, self.out)

    def __call__(self, reps: int = 7) -> float:
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            _read_kernel(self.a, self.chunks, self.out)
            times.append(time.perf_counter() - t0)
        return self.a.nbytes / statistics.median(times) / 1e9


def numpy_forward(x, ids, weights, gate, up, down):
    """The same forward with NumPy on float32 weights [E, I, H], [E, I, H], [E, H, I] (swiglu, no biases)."""
    out = np.zeros_like(x)
    for e in np.unique(ids):
        t, j = np.nonzero(ids == e)
        xe = x[t]
        g = xe @ gate[e].T
        u = xe @ up[e].T
        h = g / (np.float32(1.0) + np.exp(-g)) * u
        o = h @ down[e].T
        np.add.at(out, t, weights[t, j, None] * o)
    return out


def make_routes(rng, experts: int, tokens: int, count: int) -> list[tuple[np.ndarray, np.ndarray]]:
    routes = []
    prev = np.zeros(0, np.int64)
    for _ in range(count):
        if tokens == 1 and experts >= 2 * TOP_K:  # disjoint from the previous call: no last-level-cache reuse
            ids = rng.choice(np.setdiff1d(np.arange(experts), prev), TOP_K, replace=False)[None]
        else:
            ids = np.stack([rng.choice(experts, TOP_K, replace=False) for _ in range(tokens)])
        prev = ids.ravel()
        w = rng.random((tokens, TOP_K)).astype(np.float32)
        routes.append((ids.astype(np.int32), w / w.sum(axis=1, keepdims=True)))
    return routes


def timed(fn, routes, warmup: int) -> tuple[float, float]:
    """(median seconds per call, CPU time of this process / (wall time * threads)): the second is ~1 when the
    threads ran undisturbed (OpenMP threads spin at the barriers) and drops when other processes took the cores."""
    for ids, w in routes[:warmup]:
        fn(ids, w)
    times = []
    c0, w0 = time.process_time(), time.perf_counter()
    for ids, w in routes[warmup:]:
        t0 = time.perf_counter()
        fn(ids, w)
        times.append(time.perf_counter() - t0)
    share = (time.process_time() - c0) / ((time.perf_counter() - w0) * nb.get_num_threads())
    return statistics.median(times), share


def busy_fraction(seconds: float = 0.5) -> float | None:
    """Fraction of all CPUs busy (any process) over ``seconds``, from /proc/stat; None where unavailable."""
    def sample():
        with open("/proc/stat") as f:
            v = [int(t) for t in f.readline().split()[1:]]
        return sum(v), v[3] + v[4]  # total, idle + iowait
    try:
        t0, i0 = sample()
        time.sleep(seconds)
        t1, i1 = sample()
    except OSError:
        return None
    return 1.0 - (i1 - i0) / max(1, t1 - t0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small E (fits in the caches): a smoke run")
    parser.add_argument("--formats", default=",".join(formats.NAMES),
                        help="comma-separated formats; a mixed record as gate/up+down, e.g. q4_k+q6_k (Q4_K_M)")
    parser.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated: " + ", ".join(SHAPES))
    parser.add_argument("--tokens", default="1,16", help="comma-separated token counts T")
    parser.add_argument("--reps", type=int, default=0, help="timed calls per case (default: ~1 s of calls, 5-60)")
    parser.add_argument("--no-numpy", action="store_true", help="skip the NumPy float32 comparison")
    parser.add_argument("--activations", default="q8,f32",
                        help="comma-separated token-vector kinds: q8 (the reduced path: int8 dots for the 4-bit, "
                             "q8_0 and k-quant formats, bf16 dots for bf16 and fp8_block), f32 (float path)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    unknown = [s for s in args.shapes.split(",") if s not in SHAPES]
    if unknown:
        parser.error(f"--shapes: unknown {', '.join(unknown)} (known: {', '.join(SHAPES)})")

    threads = nb.get_num_threads()
    busy = busy_fraction()
    print(f"# {os.cpu_count()} CPUs, {threads} Numba threads, SIMD level of the kernels: {simd_level()}, CPUs busy "
          f"before the run: "
          f"{'?' if busy is None else f'{100 * busy:.0f}%'}", flush=True)
    if busy is not None and busy > 0.1:
        print("# warning: other processes are using the CPUs; numbers will be low and noisy", flush=True)
    read_bw = ReadBandwidth()
    bw_all = [read_bw()]
    print(f"# memory read bandwidth (parallel read kernel, {threads} threads): {bw_all[0]:.1f} GB/s", flush=True)

    rng = np.random.default_rng(args.seed)
    rows = []
    for shape in args.shapes.split(","):
        hidden, inter, experts, quick_experts = SHAPES[shape]
        experts = quick_experts if args.quick else experts
        # two template experts: realistic weight magnitudes, the values do not change the speed
        tmpl = [rng.standard_normal((2, n, k)).astype(np.float32) * 0.02
                for n, k in ((inter, hidden), (inter, hidden), (hidden, inter))]
        x_all = rng.standard_normal((max(int(t) for t in args.tokens.split(",")), hidden)).astype(np.float32)
        for fmt in args.formats.split(","):
            gate_up, _, down = fmt.partition("+")
            try:
                layout = RecordLayout(formats.get(gate_up), hidden, inter,
                                      down_fmt=formats.get(down) if down else None)
            except ValueError as err:  # e.g. a k-quant's 256-value blocks do not tile an FFN of 384
                print(f"# {shape} {fmt}: skipped ({err})", flush=True)
                continue
            small = layout.quantize(*tmpl)
            banks = {name: np.ascontiguousarray(np.tile(a, (experts // 2,) + (1,) * (a.ndim - 1)))
                     for name, a in small.items()}
            record_bytes = sum(a.nbytes for a in banks.values()) / experts
            deq = None
            if not args.no_numpy:
                d = layout.dequantize(small)
                deq = [np.ascontiguousarray(np.tile(d[m], (experts // 2, 1, 1))) for m in ("gate", "up", "down")]
                del d
            kinds = [a for a in args.activations.split(",")
                     if a == "f32" or any(uses_q8(f, a) for f in (gate_up, down) if f)] or ["f32"]
            for tokens, act in ((int(t), a) for t in args.tokens.split(",") for a in kinds):
                x = np.ascontiguousarray(x_all[:tokens])
                out = np.empty_like(x)

                # banks validated once, as the engine's runners do (re-validating costs ~45 us a call)
                prepared = prepare(gate_up, banks, hidden, inter, down or None)

                def kernel(ids, w, x=x, out=out, banks=banks, fmt=gate_up, down=down or None, hidden=hidden,
                           inter=inter, act=act, prepared=prepared):
                    forward(fmt, x, ids, w, banks, hidden, inter, ACT_SWIGLU, out, prepared=prepared,
                            activations=act, down_fmt_name=down)

                kernel(*make_routes(rng, experts, tokens, 1)[0])  # compile / load from cache
                t0 = time.perf_counter()
                kernel(*make_routes(rng, experts, tokens, 1)[0])
                one = time.perf_counter() - t0
                reps = args.reps or int(min(60, max(5, 1.0 / max(one, 1e-6))))
                routes = make_routes(rng, experts, tokens, reps + 3)
                bw_before = read_bw()
                t_kernel, share = timed(kernel, routes, 3)
                bw = (bw_before + read_bw()) / 2
                bw_all.append(bw)
                uniq = statistics.median(len(np.unique(ids)) for ids, _ in routes)
                nbytes = uniq * record_bytes
                flops = 6.0 * tokens * TOP_K * hidden * inter  # gate, up and down: H x I multiply-adds each per pair
                row = [shape, fmt, act, tokens, experts, uniq, nbytes / 1e6, t_kernel * 1e3, nbytes / t_kernel / 1e9,
                       bw, 100 * nbytes / t_kernel / 1e9 / bw, flops / t_kernel / 1e9, 100 * share]
                if deq is not None:
                    ids, w = routes[-1]
                    kernel(ids, w)
                    ref = numpy_forward(x, ids, w, *deq)
                    err = float(np.abs(out - ref).max() / np.abs(ref).max())
                    np_routes = routes[:min(len(routes), 3 + max(3, reps // 4))]
                    t_np, _ = timed(lambda ids, w, x=x, deq=deq: numpy_forward(x, ids, w, *deq), np_routes, 1)
                    row += [t_np * 1e3, t_np / t_kernel, err]
                rows.append(row)
                print("  " + " ".join(str(round(v, 3)) if isinstance(v, float) else str(v) for v in row),
                      file=sys.stderr, flush=True)
            del banks, deq

    header = ["shape", "format", "act", "T", "E", "uniq", "MB", "ms", "GB/s", "read", "%bw", "GFLOP/s", "cpu"]
    header += [] if args.no_numpy else ["numpy ms", "x", "err"]
    fmts = ["{}", "{}", "{}", "{}", "{}", "{:g}", "{:.1f}", "{:.3f}", "{:.1f}", "{:.1f}", "{:.0f}%", "{:.0f}",
            "{:.0f}%", "{:.2f}", "{:.1f}", "{:.1e}"]
    table = [header] + [[f.format(v) for f, v in zip(fmts, r, strict=False)] for r in rows]
    widths = [max(len(r[i]) for r in table) for i in range(len(header))]
    print(f"\nmemory read bandwidth {min(bw_all):.1f} to {max(bw_all):.1f} GB/s (median "
          f"{statistics.median(bw_all):.1f}), {threads} threads, k = {TOP_K}; 'read': measured around each row")
    for r in table:
        print("  ".join(c.rjust(wd) if i > 2 else c.ljust(wd) for i, (c, wd) in enumerate(zip(r, widths, strict=True))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
