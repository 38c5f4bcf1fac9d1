"""Decode through the expert cache with misses split between PCIe copies and the CPU (``--moe-mode``).

Per MoE layer and decode step (:meth:`MoeExecutor.run`):

1. The routed experts' residency is read from the cache map (one small device-to-host read: the split is a host
   decision; the gpu mode below keeps the all-device, sync-free path).
2. Hits stay on the GPU. The misses are split by mode: ``gpu`` fetches all, ``cpu`` computes all on the CPU,
   ``hybrid`` fetches q* of them (:func:`freetoken.policy.qstar.split` on the oracle's current PCIe and CPU
   rates), ``auto`` is whichever of those the stored bandwidth profile recommends.
3. The CPU share starts first on the executor's worker thread: the activations of the tokens routed to a CPU
   expert are copied to a pinned host buffer, the format's Numba kernel reads the records straight from the host
   pool (the authoritative copy; nothing becomes resident), and writes the partial outputs to a pinned buffer.
4. Meanwhile the GPU share is admitted (LRU, copies of the fetched misses) and computed over the slots. A pair
   whose expert went to the CPU is handed to the GPU kernel as a copy of one of its token's GPU pairs with
   weight 0 (exactly +0.0 in the combine), so the kernel's shapes never change.
5. The partial outputs are added on the device, GPU share first, then CPU share: a fixed order, so the result
   does not depend on which side finished first.

Both sides are timed and fed to the :class:`BandwidthOracle` (copies: bytes of fetched records over the copy's
wall time; CPU: bytes of records processed over the kernel's time), so the split follows the machine.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from freetoken.ops.moe_experts import moe_experts
from freetoken.policy.oracle import BandwidthOracle
from freetoken.policy.qstar import StepCosts, split

MODES = ("gpu", "cpu", "hybrid", "auto")


class MoeExecutor:
    """Routed experts of decode steps through ``cache`` with the misses split per ``mode``."""

    def __init__(self, cache, layout, mode: str = "hybrid", oracle: BandwidthOracle | None = None,
                 future_value: float = 0.0, gpu_gbps: float = 900.0, workspace=None):
        if mode not in ("gpu", "cpu", "hybrid"):
            raise ValueError(f"moe mode {mode!r}: choose gpu, cpu or hybrid (auto resolves to one of them)")
        self.cache, self.layout, self.mode = cache, layout, mode
        self.dev = cache.device
        self.oracle = oracle or BandwidthOracle()
        self.future_value = float(future_value)
        self.gpu_gbps = gpu_gbps
        self.fmt = layout.fmt.name
        self.workspace = workspace  # the decoder's MoeWorkspace over the slot banks (None: per-call buffers)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="freetoken-cpu-experts")
        self.host_banks = {name: cache.pool.host(name) for name in cache.pool.banks}  # [L * E, ...] views
        # hand-off buffers in page-locked memory: activations out, partial outputs back (DMA, no staging copy)
        rows = cache.max_active
        self._x_pinned = self.dev.pinned_empty((rows, layout.hidden), np.float32)
        self._y_pinned = self.dev.pinned_empty((rows, layout.hidden), np.float32)
        self.stats = {"steps": 0, "hits": 0, "fetched": 0, "cpu": 0}
        self._pending_handoff = None  # (activation seconds, merge start event, merge end event) of the last call

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    def costs(self) -> StepCosts:
        o = self.oracle
        return StepCosts.from_bandwidths(self.layout.record_bytes, o.pcie_gbps(), o.cpu_gbps(self.fmt),
                                         gpu_gbps=self.gpu_gbps, cpu_handoff_s=o.handoff_seconds())

    # ---- the split -------------------------------------------------------------------------------------------
    def plan(self, layer: int, ids_host: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(unique experts of the step, resident mask, computed-on-the-CPU mask) for ``layer``'s routed ids."""
        cache = self.cache
        uniq, counts = np.unique(ids_host, return_counts=True)
        flat = layer * cache.num_experts + uniq
        resident = self.dev.to_host(cache.slot_for_id[self.dev.asarray(flat.astype(np.int64))]) >= 0
        on_cpu = np.zeros(uniq.shape[0], bool)
        miss = np.flatnonzero(~resident)
        if miss.size and self.mode == "cpu":
            on_cpu[miss] = True
        elif miss.size and self.mode == "hybrid":
            fetch = split(self.costs(), uniq[miss], int(resident.sum()), self.future_value, counts[miss])
            on_cpu[miss[~fetch]] = True
        st = self.stats
        st["steps"] += 1
        st["hits"] += int(resident.sum())
        st["cpu"] += int(on_cpu.sum())
        st["fetched"] += int(miss.size - on_cpu.sum())
        return uniq, resident, on_cpu

    # ---- one layer -------------------------------------------------------------------------------------------
    def run(self, layer: int, h, ids, w, before_admit=None, after_admit=None):
        """y [T, H] (device) = the weighted routed experts of ``layer`` for hidden states ``h`` [T, H].

        ``before_admit()`` / ``after_admit(layer, h)``: hooks around the GPU share's admission (the decoder's
        prefetch waits for its copies before, and issues the next layer's after)."""
        dev, xp = self.dev, self.dev.xp
        self._harvest_handoff()
        ids_host = np.asarray(dev.to_host(ids), np.int32)
        w_host = np.asarray(dev.to_host(w), np.float32)
        uniq, resident, on_cpu = self.plan(layer, ids_host)
        cpu_experts = set(uniq[on_cpu].tolist())
        cpu_pair = np.isin(ids_host, uniq[on_cpu]) if cpu_experts else np.zeros(ids_host.shape, bool)
        job = self._submit_cpu(layer, h, ids_host, w_host, cpu_pair) if cpu_pair.any() else None

        y, timing = None, None
        gpu_pair = ~cpu_pair
        if gpu_pair.any():
            slots, wg = _substitute(ids_host, w_host, gpu_pair)
            slots_dev = dev.asarray(slots)
            if before_admit is not None:
                before_admit()
            self.cache.admit(layer, slots_dev)
            fetched = int((~resident & ~on_cpu).sum())
            start = dev.event().record()
            self.cache.copy_missing()
            timing = (start, dev.event().record(), fetched * self.layout.record_bytes) if fetched else None
            if after_admit is not None:
                after_admit(layer, h)
            y = moe_experts(h, slots_dev, dev.asarray(wg), self.cache.slot_banks, self.layout, device=dev,
                            validate=False, workspace=self.workspace)
        if timing is not None:  # the copy's event-timed duration is the oracle's PCIe sample (read once done)
            start, stop, nbytes = timing
            stop.synchronize()
            self.oracle.add_copy(nbytes, start.elapsed_ms(stop) / 1e3)
        if job is not None:
            tokens, part = job.result()
            start = dev.event().record()
            part_dev = dev.asarray(part)
            if y is None:
                y = xp.zeros(h.shape, np.float32)
            y[dev.asarray(tokens)] += part_dev  # GPU share first, then the CPU share: a fixed merge order
            # the hand-off sample: activations out (timed at submit) + partial outputs back and merged, read at
            # the next call (by then the merge is done: no synchronisation on the hot path)
            self._pending_handoff = (self._x_seconds, start, dev.event().record())
        if y is None:
            y = xp.zeros(h.shape, np.float32)
        return y

    def _harvest_handoff(self) -> None:
        if self._pending_handoff is not None:
            x_seconds, start, stop = self._pending_handoff
            self._pending_handoff = None
            stop.synchronize()
            self.oracle.add_handoff(x_seconds + start.elapsed_ms(stop) / 1e3)

    def _submit_cpu(self, layer, h, ids_host, w_host, cpu_pair):
        """Start the CPU share on the worker: the tokens with a CPU pair, their CPU pairs (others weight 0)."""
        tokens = np.flatnonzero(cpu_pair.any(axis=1)).astype(np.int64)
        t0 = time.perf_counter()
        x = self.dev.to_host(h[self.dev.asarray(tokens)], out=self._x_pinned.host[: tokens.size])
        self._x_seconds = time.perf_counter() - t0
        ids_c, w_c = _substitute(ids_host[tokens], w_host[tokens], cpu_pair[tokens])
        flat = (ids_c + layer * self.cache.num_experts).astype(np.int32)
        n_experts = len(np.unique(ids_host[cpu_pair]))
        nbytes = n_experts * self.layout.record_bytes

        def work():
            from freetoken.cpu_kernels.moe_experts import forward

            out = self._y_pinned.host[: tokens.size]
            t0 = time.perf_counter()
            forward(self.fmt, x, flat, w_c, self.host_banks, self.layout.hidden, self.layout.inter, 0, out)
            self.oracle.add_cpu(self.fmt, nbytes, time.perf_counter() - t0)
            return tokens, out

        return self._pool.submit(work)


def _substitute(ids: np.ndarray, w: np.ndarray, keep: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """ids/weights where every pair outside ``keep`` is replaced by a kept pair of the same token (or, for a token
    with none, by any kept pair) with weight 0: the same experts are computed, the dropped pairs add +0.0."""
    ids, w = ids.copy(), w.copy()
    any_kept = ids[keep][0] if keep.any() else ids.reshape(-1)[0]
    for t in range(ids.shape[0]):
        drop = ~keep[t]
        if drop.any():
            row_kept = ids[t][keep[t]]
            ids[t][drop] = row_kept[0] if row_kept.size else any_kept
            w[t][drop] = 0.0
    return np.ascontiguousarray(ids, np.int32), np.ascontiguousarray(w, np.float32)
