"""The CPU share of a split decode admission: the misses the split sent to the CPU, computed on a worker thread
from the host pool (the authoritative records; nothing becomes resident) while the GPU share runs.

Hand-off: the activations of the tokens with a CPU pair go to a page-locked buffer, the format's Numba kernel
(``nogil``: the worker really overlaps the GPU side) writes the partial outputs to another page-locked buffer, and
:meth:`CpuShare.merge` adds them on the device AFTER the GPU share's output: a fixed order, so the result does not
depend on which side finished first. The oracle gets the kernel's bandwidth and the hand-off's duration (read at
the next call, when the merge is long done: no synchronisation on the hot path).

Over a host tier (``--host-memory``) the job's records are ensured in host memory and pinned before it starts (the
GPU share's reads cannot evict them) and unpinned at the merge; the kernels read the tier's arrays by host row.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from freetoken.cache import HostTier
from freetoken.device.constants import NO_ROUTE, activation_code


def substitute(ids: np.ndarray, w: np.ndarray, keep: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """ids/weights where every pair outside ``keep`` is replaced by a kept pair of the same token (or, for a token
    with none, by any kept pair) with weight 0: the same experts are computed, the dropped pairs add +0.0, and the
    kernels' shapes never change."""
    ids, w = ids.copy(), w.copy()
    any_kept = ids[keep][0] if keep.any() else ids.reshape(-1)[0]
    for t in range(ids.shape[0]):
        drop = ~keep[t]
        if drop.any():
            row_kept = ids[t][keep[t]]
            ids[t][drop] = row_kept[0] if row_kept.size else any_kept
            w[t][drop] = 0.0
    return np.ascontiguousarray(ids, np.int32), np.ascontiguousarray(w, np.float32)


class CpuShare:
    """Computes (token, expert) pairs on the CPU from ``pool`` (a :class:`freetoken.cache.HostPool`: each layer's
    records in its layer's layout) for up to ``max_rows`` tokens per call, reporting to ``oracle``."""

    def __init__(self, device, pool, max_rows: int, oracle, activations: str = "auto"):
        self.dev, self.pool, self.oracle = device, pool, oracle
        self.activations = activations
        self.tier = pool if isinstance(pool, HostTier) else None
        # per layer, per part: [experts of the part, ...] views in local-id order (one part: all E, by expert id);
        # over a tier: the arrays of the part's layout group, read by host row
        self.host_banks = [[pool.layer_banks(layer, g) if self.tier is None else
                            self.tier.group_host_banks(self.tier.group_of(layer, g))
                            for g in range(len(pool.parts[layer].layouts))] for layer in range(pool.num_layers)]
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="freetoken-cpu-experts")
        hidden = pool.layouts[0].hidden
        self._x_pinned = device.pinned_empty((max_rows, hidden), np.float32)
        self._y_pinned = device.pinned_empty((max_rows, hidden), np.float32)
        self._pending_handoff = None  # (activation seconds, merge start event, merge end event) of the last merge
        self._x_seconds = 0.0

    def close(self) -> None:
        self._worker.shutdown(wait=True)

    def submit(self, layer: int, h, ids_host: np.ndarray, w_host: np.ndarray, cpu_pair: np.ndarray) -> Future:
        """Start the pairs ``cpu_pair`` (bool ``[T, k]``) of MoE layer ``layer`` on the worker: the tokens that have
        one, with their other pairs at weight 0 (a layer of several formats: ``ids_host`` are local ids, as the
        cache numbers them, and each part runs its layout's kernel over its pairs, the others skipped). The
        future's result is (token indices, partial outputs)."""
        tokens = np.flatnonzero(cpu_pair.any(axis=1)).astype(np.int64)
        t0 = time.perf_counter()
        x = self.dev.to_host(h[self.dev.asarray(tokens)], out=self._x_pinned.host[: tokens.size])
        self._x_seconds = time.perf_counter() - t0
        parts = self.pool.parts[layer]
        pins = []  # over a tier: the local ids whose rows stay pinned until the merge
        if not parts.mixed:
            ids_c, w_c = substitute(ids_host[tokens], w_host[tokens], cpu_pair[tokens])
            if self.tier is not None:
                pins.append(ids_c.copy())
                ids_c = self.tier.ensure(layer, ids_c, pin=True)
            jobs = [(0, ids_c, w_c, len(np.unique(ids_host[cpu_pair])))]
        else:
            ids_t, w_c, keep = ids_host[tokens], np.ascontiguousarray(w_host[tokens], np.float32), cpu_pair[tokens]
            jobs = []
            for g, (lo, hi) in enumerate(parts.bounds):
                mine = keep & (ids_t >= lo) & (ids_t < hi)
                if mine.any():  # rows of the part's own banks; the other pairs are skipped by the kernel
                    if self.tier is None:
                        ids_g = np.where(mine, ids_t - lo, NO_ROUTE).astype(np.int32)
                    else:
                        pins.append(ids_t[mine].copy())
                        ids_g = np.full(ids_t.shape, NO_ROUTE, np.int32)
                        ids_g[mine] = self.tier.ensure(layer, ids_t[mine], pin=True)
                    jobs.append((g, ids_g, w_c, len(np.unique(ids_t[mine]))))

        def work():
            from freetoken.cpu_kernels.moe_experts import forward

            out = self._y_pinned.host[: tokens.size]
            part_out = np.empty_like(out) if len(jobs) > 1 else None
            for i, (g, ids_g, w_g, n_experts) in enumerate(jobs):
                layout = parts.layouts[g]
                dst = out if i == 0 else part_out
                t0 = time.perf_counter()
                forward(layout.fmt.name, x, ids_g, w_g, self.host_banks[layer][g], layout.hidden, layout.inter,
                        activation_code(layout.act), dst, activations=self.activations,
                        down_fmt_name=layout.format_of("down").name)
                if i:
                    out += part_out
                self.oracle.add_cpu(layout.fmt.name, n_experts * layout.record_bytes, time.perf_counter() - t0)
            return tokens, out

        future = self._worker.submit(work)
        future.tier_pins = (layer, pins)
        return future

    def merge(self, job: Future, y, h):
        """``y`` (the GPU share's output, or None when every pair ran on the CPU) plus the CPU share's partials."""
        dev, xp = self.dev, self.dev.xp
        try:
            tokens, part = job.result()
        finally:
            layer, pins = getattr(job, "tier_pins", (0, []))
            for ids in pins:
                self.tier.unpin(layer, ids)
        start = dev.event().record()
        part_dev = dev.asarray(part)
        if y is None:
            y = xp.zeros(h.shape, np.float32)
        y[dev.asarray(tokens)] += part_dev  # GPU share first, then the CPU share: a fixed merge order
        self._pending_handoff = (self._x_seconds, start, dev.event().record())
        return y

    def harvest(self) -> None:
        """The previous hand-off's duration (activations out + partial outputs back and merged) to the oracle."""
        if self._pending_handoff is not None:
            x_seconds, start, stop = self._pending_handoff
            self._pending_handoff = None
            stop.synchronize()
            self.oracle.add_handoff(x_seconds + start.elapsed_ms(stop) / 1e3)
