"""Routed experts read in place from host memory: the cpu device (every layer's banks stay where they loaded)."""

from __future__ import annotations

from freetoken import ops
from freetoken.engine.experts.base import RunnerBase


class HostExperts(RunnerBase):
    """The Numba expert kernels over each layer's host banks; nothing is copied or cached."""

    def __init__(self, device, layouts, num_layers: int, activations: str = "auto"):
        super().__init__(device, layouts, num_layers)
        self.banks: list[dict | None] = [None] * num_layers
        self.activations = activations  # 8-bit (int8 dots) or float32 token vectors

    def load_layer(self, layer: int, banks: dict) -> None:
        # streamed on every step: in huge pages (the cpu device copies a bank NumPy did not already place there)
        self.banks[layer] = {name: self.dev.weights(b) for name, b in banks.items()}

    def memory(self) -> dict[str, int]:
        return {"expert banks (host)": sum(int(b.nbytes) for banks in self.banks if banks for b in banks.values())}

    def run(self, layer: int, h, ids, weights):
        self.record(ids)
        # the ids come from the model's top-k (in range by construction) and the arrays from the decoder's blocks
        # (float32 h, int32 ids, float32 weights, contiguous): the op skips re-checking them
        return ops.moe_experts(h, ids, weights, self.banks[layer], self.layouts[layer], device=self.dev, validate=False,
                               activations=self.activations, checked=True)
