"""The host pool: every routed expert of every MoE layer in host memory the device can read.

One array per bank of the record layout, indexed by flat id ``f = layer * E + expert``; pinned and
device-mapped on gpu (the copy kernel pulls records over PCIe), plain NumPy on cpu/emu. It is the
authoritative copy: the device cache only ever holds copies of its rows. Loaders fill it layer by layer and
tensor by tensor (:meth:`HostPool.write`), so no second full copy of the experts is ever held in RAM.
"""

from __future__ import annotations

import numpy as np

from freetoken.formats import RecordLayout


class HostPool:
    def __init__(self, device, layout: RecordLayout, num_layers: int, num_experts: int):
        if num_layers < 1 or num_experts < 1:
            raise ValueError(f"a host pool needs layers and experts, got {num_layers} x {num_experts}")
        self.device = device
        self.layout = layout
        self.num_layers = num_layers
        self.num_experts = num_experts
        self.specs = layout.bank_specs()
        self.banks = {s.name: device.pinned_empty((num_layers * num_experts, *s.shape), s.dtype) for s in self.specs}
        for b in self.banks.values():
            b.host[...] = 0

    @property
    def num_records(self) -> int:
        return self.num_layers * self.num_experts

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.banks.values())

    def host(self, name: str) -> np.ndarray:
        """The NumPy view of bank ``name``: [L * E, ...]."""
        return self.banks[name].host

    def write(self, layer: int, name: str, values: np.ndarray) -> None:
        """Store bank ``name`` of every expert of ``layer`` (``values``: [E, ...] of the bank's dtype)."""
        if not 0 <= layer < self.num_layers:
            raise IndexError(f"layer {layer} out of range (the pool has {self.num_layers})")
        if name not in self.banks:
            raise KeyError(f"the record layout has no bank {name!r} (banks: {sorted(self.banks)})")
        dst = self.banks[name].host[layer * self.num_experts:(layer + 1) * self.num_experts]
        values = np.asarray(values)
        if values.shape != dst.shape or values.dtype != dst.dtype:
            raise ValueError(f"bank {name} of layer {layer}: expected {dst.dtype} {list(dst.shape)}, "
                             f"got {values.dtype} {list(values.shape)}")
        dst[...] = values

    def write_layer(self, layer: int, banks: dict[str, np.ndarray]) -> None:
        """Store every bank of one layer (a ``RecordLayout.quantize`` result for that layer's experts)."""
        missing = [s.name for s in self.specs if s.name not in banks]
        if missing:
            raise ValueError(f"layer {layer}: banks missing {missing}")
        for s in self.specs:
            self.write(layer, s.name, banks[s.name])

    def record(self, flat_id: int) -> dict[str, np.ndarray]:
        """The host rows of one record (views)."""
        return {name: b.host[flat_id] for name, b in self.banks.items()}
