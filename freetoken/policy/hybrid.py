"""The miss split of one decode admission: which routed experts are hits, and which misses are fetched over PCIe or
computed on the CPU (``--moe-mode cpu|hybrid``).

:meth:`MissSplitter.plan` takes a layer's routed expert ids (on the host) and returns the step's unique experts, the
resident ones, and the misses that go to the CPU: ``cpu`` sends every miss there, ``hybrid`` fetches the q* of
them that :class:`freetoken.policy.split_policy.MissPolicy` chooses on the oracle's current PCIe and CPU rates and
its future-value estimate (the rest run on the CPU). Residency comes from MissPolicy's host shadow of the device
cache (no device read per layer), which the caller keeps in step with the device: :meth:`admitted` after every
admission (and prefetch), :meth:`prefill_layer`, :meth:`pin`, :meth:`end_step`. Executing the split (the CPU share
on a worker, the admission and the merge) is the expert runner's job (:mod:`freetoken.engine.experts`), which feeds
the timings back to the :class:`BandwidthOracle` so the split follows the machine.

Under the ``next_use`` cache policy (``scored=True``) there is no shadow: the device admission itself decides which
misses are cached (fetched) and which it bypasses, the runner reads the bypassed ids back, and :meth:`place` puts
each of those on the PCIe side (streamed through a scratch slot) or on the CPU by q*
(:func:`freetoken.policy.qstar.place_bypassed`): the policy decides what is kept, q* where the rest runs.
"""

from __future__ import annotations

import numpy as np

from freetoken.policy.oracle import BandwidthOracle
from freetoken.policy.qstar import StepCosts, place_bypassed
from freetoken.policy.split_policy import MissPolicy


class MissSplitter:
    """Per-call split of ``cache``'s misses for ``mode`` (``cpu`` or ``hybrid``), with counters of what it did.
    ``layouts``: the record layout of every layer (a list), or one for all: a layer's record size and format price
    its fetch and its CPU share. ``scored``: the cache runs the ``next_use`` policy (hybrid only): :meth:`place`
    instead of :meth:`plan`, no shadow."""

    def __init__(self, cache, layouts, mode: str = "hybrid", oracle: BandwidthOracle | None = None,
                 future_value: float | str | None = None, gpu_gbps: float = 900.0, scored: bool = False):
        if mode not in ("cpu", "hybrid"):
            raise ValueError(f"moe mode {mode!r}: the split runs for cpu or hybrid (gpu fetches every miss; auto "
                             "resolves to one of them)")
        if scored and mode != "hybrid":
            raise ValueError("the next_use cache policy fetches the misses it caches: it splits only in hybrid mode")
        self.layouts = layouts if isinstance(layouts, list) else [layouts] * cache.num_layers
        self.mode = mode
        self.oracle = oracle or BandwidthOracle()
        self.shadow = None if scored else MissPolicy.for_cache(cache, future_value=future_value)
        self.gpu_gbps = gpu_gbps
        self.stats = {"steps": 0, "hits": 0, "fetched": 0, "cpu": 0}

    def costs(self, layer: int = 0) -> StepCosts:
        o, layout = self.oracle, self.layouts[layer]
        return StepCosts.from_bandwidths(layout.record_bytes, o.pcie_gbps(), o.cpu_gbps(layout.fmt.name),
                                         gpu_gbps=self.gpu_gbps, cpu_handoff_s=o.handoff_seconds())

    def plan(self, layer: int, ids_host: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(unique experts of the step, resident mask, computed-on-the-CPU mask) for ``layer``'s routed ids."""
        uniq, counts = np.unique(ids_host, return_counts=True)
        resident = self.shadow.resident(layer, uniq)
        if self.mode == "cpu":
            on_cpu = ~resident
        else:
            on_cpu = ~self.shadow.split(layer, uniq, counts, self.costs(layer))
        st = self.stats
        st["steps"] += 1
        st["hits"] += int(resident.sum())
        st["cpu"] += int(on_cpu.sum())
        st["fetched"] += int((~resident).sum() - on_cpu.sum())
        return uniq, resident, on_cpu

    def place(self, layer: int, hits: int, admitted: int, bypass_tokens) -> np.ndarray:
        """Under ``next_use``: of a call's misses the policy bypassed (``bypass_tokens``: tokens routed to each),
        the mask of those streamed over PCIe; the rest run on the CPU (``hits`` distinct resident experts and
        ``admitted`` cached misses, which are fetched in any case)."""
        streamed = place_bypassed(self.costs(layer), admitted, hits, bypass_tokens)
        st = self.stats
        st["steps"] += 1
        st["hits"] += int(hits)
        st["fetched"] += int(admitted) + int(streamed.sum())
        st["cpu"] += int((~streamed).sum())
        return streamed

    # ---- keeping the shadow in step with the device cache (none under next_use) ---------------------------------
    def admitted(self, layer: int, experts, count: bool = True, end_call: bool = True) -> None:
        """The device admitted ``experts`` of ``layer`` (the GPU share of a call; ``count=False``: a prefetch;
        ``end_call=False``: one part of a layer admitted per format, more parts to come). Called after every
        :meth:`plan`, also when every expert went to the CPU."""
        if self.shadow is not None:
            self.shadow.admitted(layer, experts, count, end_call)

    def prefill_layer(self, layer: int) -> None:
        if self.shadow is not None:
            self.shadow.prefill_layer(layer)

    def pin(self, layer: int, experts) -> None:
        if self.shadow is not None:
            self.shadow.pin(layer, experts)

    def end_step(self) -> None:
        if self.shadow is not None:
            self.shadow.end_step()
