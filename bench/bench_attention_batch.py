#!/usr/bin/env python
"""One layer's decode-step attention for S sequences: S calls of the single-sequence ops against one call of the
batch ops (``ops.kv_store_batch`` + ``ops.paged_attention_batch``; with ``--shape qwen3.5-linear`` a Gated DeltaNet
layer's ``ops.short_conv_batch`` + ``ops.gated_delta_rule_batch`` on states in a pool), in the same run.

Each of S sequences appends one token and attends over its own context (lengths spread over ``--context`` / 2 ..
``--context``, block tables drawn from one shuffled pool, as a running server's are). Per S the table gives the time
of one layer's step both ways (median of ``--repeat``, after a warm-up; the batch's ``PagedBatch`` is made once, as
a forward pass makes it once for all its layers, and its cost is the last column), their ratio, the KV bytes read
per second by the batch call, and on gpu / emu the kernel launches per layer step each way.

    python bench/bench_attention_batch.py                                 # cpu, Qwen3-30B-A3B attention shape
    python bench/bench_attention_batch.py --device emu --shape bundled    # launches on the emulator
    python bench/bench_attention_batch.py --shape qwen3.5-linear          # Qwen3.5's linear-attention layer

For the linear layer the bytes are the states read and written (each sequence's 4 MiB state, twice).
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import numpy as np

SHAPES = {"qwen3-30b-a3b": (32, 4, 128), "bundled": (4, 1, 48),  # query heads, kv heads, head dim
          "qwen3.5-linear": (16, 32, 128)}  # key heads, value heads, head dim (Dk = Dv) of a Gated DeltaNet layer
LINEAR_TAPS = 4


def _setup_linear(dev, s: int, k_heads: int, v_heads: int, dim: int, rng):
    from freetoken import ops

    c = 2 * k_heads * dim + v_heads * dim
    conv = dev.asarray(rng.standard_normal((s + 3, LINEAR_TAPS - 1, c)).astype(np.float32))  # a pool with spare slots
    rec = dev.asarray((0.1 * rng.standard_normal((s + 3, v_heads, dim, dim))).astype(np.float32))
    slots = [int(x) for x in rng.permutation(s + 3)[:s]]
    w = dev.asarray((0.5 * rng.standard_normal((c, LINEAR_TAPS))).astype(np.float32))
    x = dev.asarray(rng.standard_normal((s, c)).astype(np.float32))
    g = dev.asarray(rng.uniform(-1, 0, (s, v_heads)).astype(np.float32))
    beta = dev.asarray(rng.uniform(0, 1, (s, v_heads)).astype(np.float32))
    y = dev.empty((s, c), np.float32)
    o = dev.empty((s, v_heads, dim), np.float32)

    def alone():
        for i, slot in enumerate(slots):
            ops.short_conv(x[i:i + 1], w, conv[slot], out=y[i:i + 1], device=dev, checked=True)
            ops.gated_delta_rule(y[i:i + 1], g[i:i + 1], beta[i:i + 1], rec[slot], k_heads, out=o[i:i + 1],
                                 device=dev, checked=True)

    batch = ops.StateBatch(slots, [1] * s, device=dev)

    def batched():
        ops.short_conv_batch(x, w, conv, batch, out=y, device=dev, checked=True)
        ops.gated_delta_rule_batch(y, g, beta, rec, k_heads, batch, out=o, device=dev, checked=True)

    def make():
        ops.StateBatch(slots, [1] * s, device=dev).desc(tuple(range(s)))

    return alone, batched, make, 2 * s * (v_heads * dim * dim + (LINEAR_TAPS - 1) * c) * 4


def _setup(dev, s: int, context: int, heads: int, kv_heads: int, dim: int, block_size: int, rng):
    from freetoken import ops
    from freetoken.ops.paged_attention import kv_encode

    starts = [int(x) for x in np.linspace(context // 2, context - 1, s)] if s > 1 else [context - 1]
    need = [-(-(st + 1) // block_size) for st in starts]
    order = rng.permutation(sum(need)).astype(np.int32)
    tables = np.zeros((s, max(need)), np.int32)
    at = 0
    for i, n in enumerate(need):
        tables[i, :n] = order[at:at + n]
        at += n
    shape = (sum(need), block_size, kv_heads, dim)
    k_pool = dev.asarray(kv_encode(rng.standard_normal(shape).astype(np.float32), "bf16")[0])
    v_pool = dev.asarray(kv_encode(rng.standard_normal(shape).astype(np.float32), "bf16")[0])
    q = dev.asarray(rng.standard_normal((s, heads, dim)).astype(np.float32))
    k = dev.asarray(rng.standard_normal((s, kv_heads, dim)).astype(np.float32))
    v = dev.asarray(rng.standard_normal((s, kv_heads, dim)).astype(np.float32))
    single = [dev.asarray(tables[i]) for i in range(s)]
    out = dev.empty((s, heads * dim), np.float32)
    keys = sum(st + 1 for st in starts)

    def alone():
        for i in range(s):
            ops.kv_store(k[i:i + 1], v[i:i + 1], k_pool, v_pool, None, None, single[i], starts[i], device=dev,
                         checked=True)
            ops.paged_attention(q[i:i + 1], k_pool, v_pool, None, None, single[i], starts[i], out=out[i:i + 1],
                                device=dev, checked=True)

    batch = ops.PagedBatch(tables, starts, [1] * s, device=dev)  # made once per pass, shared by its layers

    def batched():
        ops.kv_store_batch(k, v, k_pool, v_pool, None, None, batch, device=dev, checked=True)
        ops.paged_attention_batch(q, k_pool, v_pool, None, None, batch, out=out, device=dev, checked=True)

    def make():
        ops.PagedBatch(tables, starts, [1] * s, device=dev)

    return alone, batched, make, 2 * keys * kv_heads * dim * 2


def _time(dev, fn, repeat: int) -> float:
    fn()
    dev.synchronize()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        dev.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _launches(dev, fn):
    """Kernels of ``cuda/`` launched by one call of ``fn`` (gpu / emu; None on cpu): the launchers' kernel lookup
    wrapped for the call. Host-to-device copies (the batch's descriptors) are not launches and not counted."""
    if dev.kind == "cpu":
        return None
    import freetoken.ops.linear_attention as linear
    import freetoken.ops.linear_batch as linear_batch
    import freetoken.ops.paged_attention_cuda as paged

    count, modules = [0], (paged, linear, linear_batch)
    lookups = [m.cuda_kernel for m in modules]

    def counting(lookup):
        def find(*args, **kwargs):
            kernel = lookup(*args, **kwargs)

            def launch(*a, **k):
                count[0] += 1
                return kernel(*a, **k)
            return launch
        return find

    for m, lookup in zip(modules, lookups, strict=True):
        m.cuda_kernel = counting(lookup)
    try:
        fn()
        dev.synchronize()
    finally:
        for m, lookup in zip(modules, lookups, strict=True):
            m.cuda_kernel = lookup
    return count[0]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", choices=["cpu", "emu", "gpu"])
    parser.add_argument("--shape", default="qwen3-30b-a3b", choices=sorted(SHAPES))
    parser.add_argument("--sequences", default="1,4,8,16", help="comma-separated S values (default 1,4,8,16)")
    parser.add_argument("--context", type=int, default=2048, help="longest context (default 2048)")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--repeat", type=int, default=20)
    args = parser.parse_args(argv)

    from freetoken.device import get_device

    dev = get_device(args.device)
    heads, kv_heads, dim = SHAPES[args.shape]
    linear = args.shape.endswith("-linear")
    rng = np.random.default_rng(0)
    where = f"# {args.device} ({platform.processor() or platform.machine()}), {args.shape}: "
    if linear:
        print(where + f"{heads} key / {kv_heads} value heads of {dim}, {LINEAR_TAPS} taps, float32 states")
    else:
        print(where + f"{heads} query / {kv_heads} kv heads of {dim}, bf16 KV, contexts {args.context // 2}.."
              f"{args.context}, block {args.block_size}")
    print(f"{'S':>3} {'alone us':>10} {'batch us':>10} {'ratio':>6} {'batch GB/s':>11} {'launches alone/batch':>21} "
          f"{'StateBatch us' if linear else 'PagedBatch us':>13}")
    for s in (int(x) for x in args.sequences.split(",")):
        if linear:
            alone, batched, make, nbytes = _setup_linear(dev, s, heads, kv_heads, dim, rng)
        else:
            alone, batched, make, nbytes = _setup(dev, s, args.context, heads, kv_heads, dim, args.block_size, rng)
        ta, tb, tm = (_time(dev, fn, args.repeat) for fn in (alone, batched, make))
        la, lb = _launches(dev, alone), _launches(dev, batched)
        launches = "-" if la is None else f"{la}/{lb}"
        print(f"{s:>3} {ta * 1e6:>10.1f} {tb * 1e6:>10.1f} {ta / tb:>6.2f} {nbytes / tb / 1e9:>11.2f} {launches:>21}"
              f" {tm * 1e6:>13.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
