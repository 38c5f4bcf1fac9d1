"""The host pool: every routed expert of every MoE layer in host memory the device can read.

One array per bank of a record layout, indexed by flat id ``f = layer * E + expert``; pinned and device-mapped on
gpu (the copy kernel pulls records over PCIe), plain NumPy on cpu/emu. It is the authoritative copy: the device cache
only ever holds copies of its rows. Loaders fill it layer by layer and tensor by tensor (:meth:`HostPool.write`), so
no second full copy of the experts is ever held in RAM.

Layers may differ in layout (a GGUF Q4_K_M file keeps some layers' down matrices in Q6_K, others in Q4_K): then each
distinct layout has its own arrays, holding the rows of its layers in layer order, and exactly sized (no host byte is
spent on padding a smaller record to a larger one). :meth:`layer_rows` says where a layer's records are. A layer may
also keep its experts in several layouts (an FTW file's hot experts in fp8, the rest in 4 bits:
:class:`freetoken.formats.parts.ExpertParts`): each part's records are rows of its layout's arrays, exactly sized too.
"""

from __future__ import annotations

import numpy as np

from freetoken.formats import RecordLayout
from freetoken.formats.parts import ExpertParts, as_parts


class HostPool:
    """``layouts``: one :class:`RecordLayout` for every layer, or a list of one per layer, each a layout or an
    :class:`ExpertParts` (a layer whose experts are in several layouts: each part's records are rows of its layout's
    arrays, in the part's local-id order)."""

    def __init__(self, device, layouts: RecordLayout | list[RecordLayout | ExpertParts], num_layers: int,
                 num_experts: int):
        if num_layers < 1 or num_experts < 1:
            raise ValueError(f"a host pool needs layers and experts, got {num_layers} x {num_experts}")
        layouts = [layouts] * num_layers if isinstance(layouts, RecordLayout) else list(layouts)
        if len(layouts) != num_layers:
            raise ValueError(f"{len(layouts)} record layouts for {num_layers} layers")
        self.device = device
        #: Each layer's experts by layout (one part unless the layer mixes formats).
        self.parts = [as_parts(lay, num_experts) for lay in layouts]
        if any(p.num_experts != num_experts for p in self.parts):
            raise ValueError(f"every layer needs {num_experts} experts")
        #: Each layer's largest record layout (its only one unless it mixes formats).
        self.layouts = [p.largest for p in self.parts]
        self.num_layers = num_layers
        self.num_experts = num_experts
        #: The distinct layouts, in order of first use; part g of layer l's records are rows ``_row0[l][g] ..`` of
        #: group ``_group[l][g]``'s arrays.
        self.groups: list[RecordLayout] = list(dict.fromkeys(lay for p in self.parts for lay in p.layouts))
        self._group = [[self.groups.index(lay) for lay in p.layouts] for p in self.parts]
        seen = [0] * len(self.groups)
        self._row0 = []
        for p, groups in zip(self.parts, self._group, strict=True):
            rows = []
            for g, (lo, hi) in zip(groups, p.bounds, strict=True):
                rows.append(seen[g])
                seen[g] += hi - lo
            self._row0.append(rows)
        self.group_banks = [{s.name: device.pinned_empty((n, *s.shape), s.dtype) for s in lay.bank_specs()}
                            for lay, n in zip(self.groups, seen, strict=True)]
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

    def group_of(self, layer: int, part: int = 0) -> int:
        """The index in :attr:`groups` of the layout of ``layer``'s part ``part``."""
        self._check_layer(layer)
        return self._group[layer][part]

    def layer_rows(self, layer: int, part: int = 0) -> tuple[dict, int]:
        """(the bank arrays holding part ``part`` of ``layer``'s records, by name; the flat id of their row 0): the
        record of flat id ``f = layer * E + local`` (``local`` in the part's range) is row ``f - first`` of each
        array."""
        self._check_layer(layer)
        lo = self.parts[layer].bounds[part][0]
        return self.group_banks[self._group[layer][part]], layer * self.num_experts + lo - self._row0[layer][part]

    def layer_banks(self, layer: int, part: int = 0) -> dict[str, np.ndarray]:
        """NumPy views of part ``part`` of ``layer``'s records, [experts of the part, ...] by bank name, in local-id
        order (all E experts, in expert order, for a layer of one layout)."""
        self._check_layer(layer)
        lo, hi = self.parts[layer].bounds[part]
        r0 = self._row0[layer][part]
        return {name: b.host[r0:r0 + hi - lo] for name, b in self.group_banks[self._group[layer][part]].items()}

    def _check_layer(self, layer: int) -> None:
        if not 0 <= layer < self.num_layers:
            raise IndexError(f"layer {layer} out of range (the pool has {self.num_layers})")

    def write(self, layer: int, name: str, values: np.ndarray, part: int = 0) -> None:
        """Store bank ``name`` of every expert of ``layer``'s part ``part`` (``values``: [experts of the part, ...] of
        the bank's dtype, in local-id order)."""
        self._check_layer(layer)
        banks = self.layer_banks(layer, part)
        if name not in banks:
            raise KeyError(f"layer {layer}'s record layout has no bank {name!r} (banks: {sorted(banks)})")
        dst = banks[name]
        values = np.asarray(values)
        if values.shape != dst.shape or values.dtype != dst.dtype:
            raise ValueError(f"bank {name} of layer {layer}: expected {dst.dtype} {list(dst.shape)}, "
                             f"got {values.dtype} {list(values.shape)}")
        dst[...] = values

    def write_layer(self, layer: int, banks: dict[str, np.ndarray], part: int = 0) -> None:
        """Store every bank of one layer's part (a ``RecordLayout.quantize`` result for those experts)."""
        self._check_layer(layer)
        specs = self.parts[layer].layouts[part].bank_specs()
        missing = [s.name for s in specs if s.name not in banks]
        if missing:
            raise ValueError(f"layer {layer}: banks missing {missing}")
        for s in specs:
            self.write(layer, s.name, banks[s.name], part)

    def record(self, flat_id: int) -> dict[str, np.ndarray]:
        """The host rows of one record (views; ``flat_id = layer * E + local id``)."""
        layer, local = divmod(int(flat_id), self.num_experts)
        part = self.parts[layer].part_of(local)
        lo = self.parts[layer].bounds[part][0]
        return {name: b[local - lo] for name, b in self.layer_banks(layer, part).items()}
