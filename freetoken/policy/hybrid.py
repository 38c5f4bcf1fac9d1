"""The miss split of one decode admission: which routed experts are hits, and which misses are fetched over PCIe or
computed on the CPU (``--moe-mode cpu|hybrid``).

:meth:`MissSplitter.plan` takes a layer's routed expert ids (on the host) and returns the step's unique experts, the
resident ones, and the misses that go to the CPU: ``cpu`` sends every miss there, ``hybrid`` fetches the q* of
them that :func:`freetoken.policy.qstar.split` chooses on the oracle's current PCIe and CPU rates (the rest run on
the CPU). The split is a host decision on host data; executing it (the CPU share on a worker, the admission and the
merge) is the expert runner's job (:mod:`freetoken.engine.experts`), which feeds the timings back to the
:class:`BandwidthOracle` so the split follows the machine.
"""

from __future__ import annotations

import numpy as np

from freetoken.policy.oracle import BandwidthOracle
from freetoken.policy.qstar import StepCosts, split

MODES = ("gpu", "cpu", "hybrid", "auto")


class MissSplitter:
    """Per-call split of ``cache``'s misses for ``mode`` (``cpu`` or ``hybrid``), with counters of what it did."""

    def __init__(self, cache, layout, mode: str = "hybrid", oracle: BandwidthOracle | None = None,
                 future_value: float = 0.0, gpu_gbps: float = 900.0):
        if mode not in ("cpu", "hybrid"):
            raise ValueError(f"moe mode {mode!r}: the split runs for cpu or hybrid (gpu fetches every miss; auto "
                             "resolves to one of them)")
        self.cache, self.layout, self.mode = cache, layout, mode
        self.dev = cache.device
        self.oracle = oracle or BandwidthOracle()
        self.future_value = float(future_value)
        self.gpu_gbps = gpu_gbps
        self.fmt = layout.fmt.name
        self.stats = {"steps": 0, "hits": 0, "fetched": 0, "cpu": 0}

    def reset_stats(self) -> None:
        self.stats = dict.fromkeys(self.stats, 0)

    def costs(self) -> StepCosts:
        o = self.oracle
        return StepCosts.from_bandwidths(self.layout.record_bytes, o.pcie_gbps(), o.cpu_gbps(self.fmt),
                                         gpu_gbps=self.gpu_gbps, cpu_handoff_s=o.handoff_seconds())

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
