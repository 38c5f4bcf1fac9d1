"""One MoE layer's experts by record layout: most layers keep every expert in one layout; an FTW file may store a
layer's hot experts in one format and the rest in another (docs/ftw.md).

The runtime numbers a layer's experts part by part (its *local* ids): part 0's experts first, each part's in
increasing expert order. Each part is then one contiguous run of local ids ``[lo, hi)``, which is what the host pool's
rows, the cache's copy tables and the prefill buffers of a layout index; the router's expert ids are mapped to local
ids (:attr:`ExpertParts.local_of`) once per layer and step, and a layer runs its expert kernels once per part with the
other parts' pairs marked ``NO_ROUTE``. A uniform layer has one part and the identity numbering, so nothing changes
for it.
"""

from __future__ import annotations

import numpy as np

from freetoken.formats.base import RecordLayout


class ExpertParts:
    """``parts``: (record layout, expert ids) pairs; together the expert ids are each of ``0 .. E - 1`` once."""

    def __init__(self, parts: list[tuple[RecordLayout, np.ndarray]]):
        if not parts:
            raise ValueError("a layer's experts need at least one part")
        self.layouts = tuple(lay for lay, _ in parts)
        self.experts = tuple(np.sort(np.asarray(e, np.int64).reshape(-1)) for _, e in parts)
        if any(e.size == 0 for e in self.experts):
            raise ValueError("a part without experts")
        if len(set(self.layouts)) != len(self.layouts):
            raise ValueError("two parts of one layer share a record layout: they would be one part")
        order = np.concatenate(self.experts)
        e = order.size
        if not np.array_equal(np.sort(order), np.arange(e)):
            raise ValueError(f"the parts' experts are not each of 0 .. {e - 1} once")
        self.num_experts = e
        #: Expert -> local id (int32, for the device gather).
        self.local_of = np.empty(e, np.int32)
        self.local_of[order] = np.arange(e, dtype=np.int32)
        ends = np.cumsum([x.size for x in self.experts])
        #: [lo, hi) of each part's local ids.
        self.bounds = tuple((int(b - x.size), int(b)) for b, x in zip(ends, self.experts, strict=True))
        dims = {(lay.hidden, lay.inter, lay.bias, lay.act) for lay in self.layouts}
        if len(dims) != 1:
            raise ValueError(f"the parts' records differ in shape, biases or activation: {sorted(dims)}")

    @classmethod
    def uniform(cls, layout: RecordLayout, num_experts: int) -> ExpertParts:
        return cls([(layout, np.arange(num_experts))])

    @property
    def mixed(self) -> bool:
        return len(self.layouts) > 1

    @property
    def largest(self) -> RecordLayout:
        """The layout of the largest record (what a slot must hold)."""
        return max(self.layouts, key=lambda lay: lay.record_bytes)

    @property
    def host_bytes(self) -> int:
        """Bytes of all the layer's records."""
        return sum(lay.record_bytes * x.size for lay, x in zip(self.layouts, self.experts, strict=True))

    @property
    def name(self) -> str:
        """"q4_0", or for a mixed layer its parts: "fp8_block x2 + mxfp4 x14"."""
        if not self.mixed:
            return self.layouts[0].name
        return " + ".join(f"{lay.name} x{x.size}" for lay, x in zip(self.layouts, self.experts, strict=True))

    def part_of(self, local: int) -> int:
        """The part holding local id ``local``."""
        for g, (lo, hi) in enumerate(self.bounds):
            if lo <= local < hi:
                return g
        raise IndexError(f"local id {local} out of range ({self.num_experts} experts)")

    def __eq__(self, other) -> bool:
        return isinstance(other, ExpertParts) and self.layouts == other.layouts and \
            all(np.array_equal(a, b) for a, b in zip(self.experts, other.experts, strict=True))

    def __hash__(self) -> int:
        return hash((self.layouts, tuple(x.tobytes() for x in self.experts)))

    def __repr__(self) -> str:
        return f"ExpertParts({self.name})"


def as_parts(layout: RecordLayout | ExpertParts, num_experts: int) -> ExpertParts:
    """``layout`` as parts (a plain layout: every expert in it)."""
    return layout if isinstance(layout, ExpertParts) else ExpertParts.uniform(layout, num_experts)
