"""Routed experts read in place from host memory: the cpu device (every layer's banks stay where they loaded), or,
with a host budget below the routed experts (``--host-memory``), from a host tier over the FTW file: each call's
records are brought into host rows (read from the file when not there) and the kernels read the tier's arrays with
the ids mapped to rows."""

from __future__ import annotations

import numpy as np

from freetoken import ops
from freetoken.cache import HostTier
from freetoken.device.constants import NO_ROUTE
from freetoken.engine.experts.base import RunnerBase


class HostExperts(RunnerBase):
    """The Numba expert kernels over each layer's host banks; nothing is copied or cached. A layer whose experts are
    in several formats runs the kernels once per part (its banks, its layout) over that part's pairs. ``reader``
    and ``host_memory``: the records live in a :class:`HostTier` of that many bytes over the file ``reader``
    reads."""

    def __init__(self, device, layouts, num_layers: int, num_experts: int, activations: str = "auto",
                 reader=None, host_memory: int | None = None):
        super().__init__(device, layouts, num_layers, num_experts)
        self.banks: list[list[dict] | None] = [None] * num_layers  # per layer, per part
        self.activations = activations  # reduced (8-bit blocks or bf16) or float32 token vectors
        if reader is not None:
            self.tier = HostTier(device, self.parts, num_layers, num_experts, reader, host_memory)
            self.reads_own_experts = True

    def load_layer(self, layer: int, banks: dict, part: int = 0) -> None:
        # streamed on every step: in huge pages (the cpu device copies a bank NumPy did not already place there)
        if self.banks[layer] is None:
            self.banks[layer] = [None] * len(self.parts[layer].layouts)
        self.banks[layer][part] = {name: self.dev.weights(b) for name, b in banks.items()}

    def memory(self) -> dict[str, int]:
        if self.tier is not None:
            return {"expert rows (host tier)": int(self.tier.nbytes)}
        return {"expert banks (host)": sum(int(b.nbytes) for parts in self.banks if parts for banks in parts
                                           for b in banks.values())}

    def counters(self) -> dict[str, int]:
        return self.tier_counters()

    def summary(self) -> str:
        if self.tier is None:
            return super().summary()
        return f"experts: read from a host tier over the FTW file ({self.formats_name()})"

    def reset(self) -> None:
        if self.tier is not None:
            self.tier.reset_stats()

    def run(self, layer: int, h, ids, weights):
        self.record(ids)
        if self.tier is not None:
            return self._run_tier(layer, h, ids, weights)
        # the ids come from the model's top-k (in range by construction) and the arrays from the decoder's blocks
        # (float32 h, int32 ids, float32 weights, contiguous): the op skips re-checking them
        parts = self.parts[layer]
        if not parts.mixed:
            return ops.moe_experts(h, ids, weights, self.banks[layer][0], parts.layouts[0], device=self.dev,
                                   validate=False, activations=self.activations, checked=True)
        return self.run_parts(layer, ids, lambda g, part_ids: ops.moe_experts(
            h, part_ids, weights, self.banks[layer][g], parts.layouts[g], device=self.dev, validate=False,
            activations=self.activations, checked=True), relative=True)

    def _run_tier(self, layer: int, h, ids, weights):
        """The call's records ensured in the host tier, the kernels over its arrays with ids as host rows (a mixed
        layer: each part over its layout's arrays, the other parts' pairs NO_ROUTE)."""
        tier, parts = self.tier, self.parts[layer]
        local = np.asarray(ids) if not parts.mixed else parts.local_of[np.asarray(ids)]
        rows = tier.ensure(layer, local)
        y = None
        for g, (lo, hi) in enumerate(parts.bounds):
            part_rows = rows if not parts.mixed else np.ascontiguousarray(
                np.where((local >= lo) & (local < hi), rows, np.int32(NO_ROUTE)).astype(np.int32))
            yg = ops.moe_experts(h, part_rows, weights, tier.group_host_banks(tier.group_of(layer, g)),
                                 parts.layouts[g], device=self.dev, validate=False, activations=self.activations,
                                 checked=True)
            y = yg if y is None else y + yg
        return y
