"""The host pool: every routed expert of every MoE layer in host memory the device can read.

One array per bank of a record layout, indexed by flat id ``f = layer * E + expert``; pinned and device-mapped on
gpu (the copy kernel pulls records over PCIe), plain NumPy on cpu/emu. It is the authoritative copy: the device cache
only ever holds copies of its rows. Loaders fill it layer by layer and tensor by tensor (:meth:`HostPool.write`), so
no second full copy of the experts is ever held in RAM.

Layers may differ in layout (a GGUF Q4_K_M file keeps some layers' down matrices in Q6_K, others in Q4_K): then each
distinct layout has its own arrays, holding the rows of its layers in layer order, and exactly sized (no host byte is
spent on padding a smaller record to a larger one). :meth:`layer_rows` says where a layer's records are.
"""

from __future__ import annotations

import numpy as np

from freetoken.formats import RecordLayout


class HostPool:
    """``layouts``: one :class:`RecordLayout` for every layer, or a list of one per layer."""

    def __init__(self, device, layouts: RecordLayout | list[RecordLayout], num_layers: int, num_experts: int):
        if num_layers < 1 or num_experts < 1:
            raise ValueError(f"a host pool needs layers and experts, got {num_layers} x {num_experts}")
        layouts = [layouts] * num_layers if isinstance(layouts, RecordLayout) else list(layouts)
        if len(layouts) != num_layers:
            raise ValueError(f"{len(layouts)} record layouts for {num_layers} layers")
        self.device = device
        self.layouts = layouts
        self.num_layers = num_layers
        self.num_experts = num_experts
        #: The distinct layouts, in order of first use; layer l's records are rows ``_row0[l] ..`` of group
        #: ``_group[l]``'s arrays.
        self.groups: list[RecordLayout] = list(dict.fromkeys(layouts))
        self._group = [self.groups.index(lay) for lay in layouts]
        seen = [0] * len(self.groups)
        self._row0 = []
        for g in self._group:
            self._row0.append(seen[g] * num_experts)
            seen[g] += 1
        self.group_banks = [{s.name: device.pinned_empty((n * num_experts, *s.shape), s.dtype)
                             for s in lay.bank_specs()} for lay, n in zip(self.groups, seen, strict=True)]
        for banks in self.group_banks:
            for b in banks.values():
                b.host[...] = 0

    @property
    def uniform(self) -> bool:
        """Every layer in one layout (then :attr:`layout`, :attr:`specs`, :attr:`banks` and :meth:`host` cover all
        layers, indexed by flat id)."""
        return len(self.groups) == 1

    def _single(self, what: str):
        if not self.uniform:
            raise ValueError(f"{what}: the layers of this pool differ in layout; use layer_rows / layer_banks")
        return self.groups[0]

    @property
    def layout(self) -> RecordLayout:
        return self._single("layout")

    @property
    def specs(self):
        return self._single("specs").bank_specs()

    @property
    def banks(self) -> dict:
        """The bank arrays [L * E, ...] by name (a pool whose layers share one layout)."""
        self._single("banks")
        return self.group_banks[0]

    @property
    def num_records(self) -> int:
        return self.num_layers * self.num_experts

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for banks in self.group_banks for b in banks.values())

    def host(self, name: str) -> np.ndarray:
        """The NumPy view of bank ``name``: [L * E, ...] (a pool whose layers share one layout)."""
        return self.banks[name].host

    def group_of(self, layer: int) -> int:
        """The index in :attr:`groups` of ``layer``'s layout."""
        self._check_layer(layer)
        return self._group[layer]

    def layer_rows(self, layer: int) -> tuple[dict, int]:
        """(the bank arrays holding ``layer``'s records, by name; the flat id of their row 0): record ``f`` of the
        layer is row ``f - first`` of each array."""
        self._check_layer(layer)
        return self.group_banks[self._group[layer]], layer * self.num_experts - self._row0[layer]

    def layer_banks(self, layer: int) -> dict[str, np.ndarray]:
        """NumPy views of ``layer``'s records, [E, ...] by bank name."""
        self._check_layer(layer)
        r0, e = self._row0[layer], self.num_experts
        return {name: b.host[r0:r0 + e] for name, b in self.group_banks[self._group[layer]].items()}

    def _check_layer(self, layer: int) -> None:
        if not 0 <= layer < self.num_layers:
            raise IndexError(f"layer {layer} out of range (the pool has {self.num_layers})")

    def write(self, layer: int, name: str, values: np.ndarray) -> None:
        """Store bank ``name`` of every expert of ``layer`` (``values``: [E, ...] of the bank's dtype)."""
        self._check_layer(layer)
        banks = self.layer_banks(layer)
        if name not in banks:
            raise KeyError(f"layer {layer}'s record layout has no bank {name!r} (banks: {sorted(banks)})")
        dst = banks[name]
        values = np.asarray(values)
        if values.shape != dst.shape or values.dtype != dst.dtype:
            raise ValueError(f"bank {name} of layer {layer}: expected {dst.dtype} {list(dst.shape)}, "
                             f"got {values.dtype} {list(values.shape)}")
        dst[...] = values

    def write_layer(self, layer: int, banks: dict[str, np.ndarray]) -> None:
        """Store every bank of one layer (a ``RecordLayout.quantize`` result for that layer's experts)."""
        self._check_layer(layer)
        specs = self.layouts[layer].bank_specs()
        missing = [s.name for s in specs if s.name not in banks]
        if missing:
            raise ValueError(f"layer {layer}: banks missing {missing}")
        for s in specs:
            self.write(layer, s.name, banks[s.name])

    def record(self, flat_id: int) -> dict[str, np.ndarray]:
        """The host rows of one record (views)."""
        layer, e = divmod(int(flat_id), self.num_experts)
        return {name: b[e] for name, b in self.layer_banks(layer).items()}
