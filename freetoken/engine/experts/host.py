"""Routed experts read in place from host memory: the cpu device (every layer's banks stay where they loaded)."""

from __future__ import annotations

from freetoken import ops
from freetoken.engine.experts.base import RunnerBase


class HostExperts(RunnerBase):
    """The Numba expert kernels over each layer's host banks; nothing is copied or cached. A layer whose experts are
    in several formats runs the kernels once per part (its banks, its layout) over that part's pairs."""

    def __init__(self, device, layouts, num_layers: int, num_experts: int, activations: str = "auto"):
        super().__init__(device, layouts, num_layers, num_experts)
        self.banks: list[list[dict] | None] = [None] * num_layers  # per layer, per part
        self.activations = activations  # 8-bit (int8 dots) or float32 token vectors

    def load_layer(self, layer: int, banks: dict, part: int = 0) -> None:
        # streamed on every step: in huge pages (the cpu device copies a bank NumPy did not already place there)
        if self.banks[layer] is None:
            self.banks[layer] = [None] * len(self.parts[layer].layouts)
        self.banks[layer][part] = {name: self.dev.weights(b) for name, b in banks.items()}

    def memory(self) -> dict[str, int]:
        return {"expert banks (host)": sum(int(b.nbytes) for parts in self.banks if parts for banks in parts
                                           for b in banks.values())}

    def run(self, layer: int, h, ids, weights):
        self.record(ids)
        # the ids come from the model's top-k (in range by construction) and the arrays from the decoder's blocks
        # (float32 h, int32 ids, float32 weights, contiguous): the op skips re-checking them
        parts = self.parts[layer]
        if not parts.mixed:
            return ops.moe_experts(h, ids, weights, self.banks[layer][0], parts.layouts[0], device=self.dev,
                                   validate=False, activations=self.activations, checked=True)
        return self.run_parts(layer, ids, lambda g, part_ids: ops.moe_experts(
            h, part_ids, weights, self.banks[layer][g], parts.layouts[g], device=self.dev, validate=False,
            activations=self.activations, checked=True), relative=True)
