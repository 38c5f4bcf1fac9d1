"""What every expert runner shares: the routing record of the last forward pass and the counters/report API."""

from __future__ import annotations

import numpy as np

from freetoken.device.constants import NO_ROUTE
from freetoken.formats import RecordLayout
from freetoken.formats.parts import ExpertParts, as_parts
from freetoken.models.experts import ExpertRunner


class RunnerBase(ExpertRunner):
    """``last_routing``: the expert ids of every MoE layer of the last forward pass (device arrays ``[T, k]``, in
    layer order; a prompt run in chunks: all of its chunks, concatenated per layer), for routing traces and
    hot-expert counts."""

    def __init__(self, device, layouts: RecordLayout | list[RecordLayout | ExpertParts], num_layers: int,
                 num_experts: int):
        single = layouts if isinstance(layouts, RecordLayout) else None
        layouts = [single] * num_layers if single else list(layouts)
        if len(layouts) != num_layers:
            raise ValueError(f"{len(layouts)} record layouts for {num_layers} MoE layers")
        self.dev, self.num_layers = device, num_layers
        #: Each layer's experts by record layout (one part unless the layer mixes formats).
        self.parts = [as_parts(lay, num_experts) for lay in layouts]
        #: Each layer's largest record layout (its only one unless the layer mixes formats).
        self.layouts = [p.largest for p in self.parts]
        self.mixed = any(p.mixed for p in self.parts)
        # a mixed layer's expert -> local id table on the device (ExpertParts: each part one range of local ids)
        self._local = [device.asarray(p.local_of) if p.mixed else None for p in self.parts]
        # the largest record: what slot sizes and per-record cost estimates go by (None without MoE layers)
        self.layout = single or max(self.layouts, key=lambda lay: lay.record_bytes, default=None)
        self._routing: list[list] = [[]]  # per chunk of the last pass: the ids of every MoE layer

    def run_parts(self, layer: int, ids, run, offset: int = 0, relative: bool = False):
        """The sum over the parts g of a mixed layer of ``run(g, part_ids)``: ``part_ids`` (int32, like ``ids``) holds
        part g's pairs as local id + ``offset`` (minus the part's first local id when ``relative``: rows of the
        part's own banks) and every other pair ``NO_ROUTE``. The local ids are gathered once per call."""
        xp = self.dev.xp
        local = xp.take(self._local[layer], ids)
        y = None
        for g, (lo, hi) in enumerate(self.parts[layer].bounds):
            shift = np.int32(offset - (lo if relative else 0))
            part_ids = xp.ascontiguousarray(xp.where((local >= lo) & (local < hi), local + shift,
                                                     np.int32(NO_ROUTE)).astype(np.int32))
            yg = run(g, part_ids)
            y = yg if y is None else y + yg
        return y

    def begin(self, tokens: int, first: bool = True) -> None:
        if first:
            self._routing = []
        self._routing.append([])

    def record(self, ids) -> None:
        self._routing[-1].append(ids)

    @property
    def last_routing(self) -> list:
        if len(self._routing) == 1:
            return self._routing[0]
        xp = self.dev.xp
        return [xp.concatenate(per_layer) for per_layer in zip(*self._routing, strict=True)]

    # ---- what a run reports -------------------------------------------------------------------------------------
    mode = "cpu"
    #: The host tier (``--host-memory`` below the routed experts: :class:`freetoken.cache.HostTier`), else None.
    tier = None

    def tier_report(self) -> str:
        """The host tier's line (rows, budget, hit rate, bytes read from disk), '' without a tier."""
        return self.tier.report() if self.tier is not None else ""

    def tier_counters(self) -> dict[str, int]:
        if self.tier is None:
            return {}
        st = self.tier.stats()
        return {"host_tier_hits": st["hits"], "host_tier_reads": st["misses"], "host_tier_evictions": st["evictions"],
                "host_tier_bytes_read": st["bytes_read"]}

    def counters(self) -> dict[str, int]:
        """Counters since load (or the last :meth:`reset`), as numbers; none for a runner that keeps none."""
        return {}

    def summary(self) -> str:
        """One line on where the experts ran (the ``run`` command's stats line)."""
        return f"experts: read in place from host memory ({self.formats_name()})"

    def formats_name(self) -> str:
        """The record formats, "q4_0" or, when layers differ, "q4_k+q6_k / q4_k" (each distinct layout once; a mixed
        layer as its parts, "fp8_block x2 + mxfp4 x14")."""
        return " / ".join(dict.fromkeys(p.name for p in self.parts)) or "none"

    def memory(self) -> dict[str, int]:
        """Bytes the runner holds, by what they are (the memory report of ``run`` and ``chat``)."""
        return {}

    def report(self) -> str:
        """The miss policy's line ('' when there is no policy)."""
        return ""

    def pin_hot(self, counts, n: int) -> str:
        """Keep the ``n`` most used experts of ``counts`` [layers, experts] resident; returns a note for the report."""
        return "--pin-hot ignored: the cpu device reads every expert from host memory"

    def reset(self) -> None:  # noqa: B027 - a runner without state has nothing to forget
        """Forget residency and counters (after the load-time warm-up pass): as freshly loaded."""

    def close(self) -> None:  # noqa: B027
        """Stop worker threads (the runner is unusable afterwards)."""
