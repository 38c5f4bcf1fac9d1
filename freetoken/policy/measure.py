"""``freetoken bench bw``: measure PCIe copies and the CPU executor on this machine, once, for a format.

* PCIe: the expert cache's own copy kernel pulling ``records`` expert records from the pinned host pool into
  device slots (an admission of all of them, then ``copy_missing``), timed with events on the gpu device.
* CPU: the format's Numba kernel computing one token through top-k experts read from host memory, the experts
  drawn at random from a set larger than the CPU caches, timed per call (as the hybrid executor runs it).

Both are medians over repetitions after a warm-up. On emu the "PCIe" figure is the emulator copying host memory
and means nothing for a GPU; the profile is stored under the device kind ("emu"), so it never stands in for a
real GPU's.
"""

from __future__ import annotations

import statistics
import time

import numpy as np

from freetoken import formats
from freetoken.formats import RecordLayout

#: The record shape measured by default: Qwen3-30B-A3B's experts (hidden 2048, expert FFN 768).
DEFAULT_SHAPE = (2048, 768)


def _random_banks(layout: RecordLayout, n: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """``n`` records: one quantized Gaussian expert repeated (the bytes moved and decoded are what is measured,
    their values do not matter; quantizing n experts would take longer than the measurement)."""
    h, i = layout.hidden, layout.inter
    one = layout.quantize(*(rng.standard_normal((1, *layout.matrix_shape(m)), np.float32) / np.sqrt(k)
                            for m, k in (("gate", h), ("up", h), ("down", i))))
    return {name: np.ascontiguousarray(np.repeat(a, n, axis=0)) for name, a in one.items()}


def measure_pcie(device, layout: RecordLayout, records: int = 64, reps: int = 5) -> float:
    """Host-to-device GB/s of the cache's copy kernel moving ``records`` records (median of ``reps``)."""
    from freetoken.cache import ExpertCache, HostPool

    records = max(1, min(records, 1024))
    pool = HostPool(device, layout, 1, records)
    pool.write_layer(0, _random_banks(layout, records, np.random.default_rng(0)))
    cache = ExpertCache(pool, records, max_active=records, prefill_overlap=False)
    ids = np.arange(records, dtype=np.int32)[None]
    times = []
    for r in range(reps + 1):
        cache.reset()
        slots = device.asarray(ids)
        cache.admit(0, slots)
        device.synchronize()
        if device.kind == "gpu":
            start, stop = device.event(), device.event()
            start.record()
            cache.copy_missing()
            stop.record()
            stop.synchronize()
            dt = start.elapsed_ms(stop) / 1e3
        else:
            t0 = time.perf_counter()
            cache.copy_missing()
            device.synchronize()
            dt = time.perf_counter() - t0
        if r:  # the first one warms up (module load, TLB)
            times.append(dt)
    return records * layout.record_bytes / statistics.median(times) / 1e9


def measure_cpu(layout: RecordLayout, top_k: int = 8, experts: int = 32, calls: int = 24) -> float:
    """GB/s of expert records the CPU executor processes for one decode token routed to ``top_k`` experts."""
    from freetoken.cpu_kernels.moe_experts import forward

    rng = np.random.default_rng(1)
    banks = _random_banks(layout, experts, rng)
    x = rng.standard_normal((1, layout.hidden)).astype(np.float32)
    w = np.full((1, top_k), 1.0 / top_k, np.float32)
    out = np.empty((1, layout.hidden), np.float32)
    k = min(top_k, experts)
    times = []
    for c in range(calls + 2):
        ids = rng.choice(experts, k, replace=False).astype(np.int32)[None]
        t0 = time.perf_counter()
        forward(layout.fmt.name, x, ids, w[:, :k], banks, layout.hidden, layout.inter, 0, out,
                down_fmt_name=layout.format_of("down").name)
        if c >= 2:  # two warm-up calls (Numba compiles on the first)
            times.append(time.perf_counter() - t0)
    return k * layout.record_bytes / statistics.median(times) / 1e9


def layout_for(fmt: str, hidden: int, inter: int) -> RecordLayout:
    return RecordLayout(formats.get(fmt), hidden, inter)
