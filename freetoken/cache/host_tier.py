"""The host tier: the host pool as a cache over the weight file, for routed experts that do not fit in host memory.

When ``--host-memory`` is smaller than the routed experts, the host holds only as many records as the budget allows,
in rows of one array per bank per record layout (as :class:`freetoken.cache.HostPool` does, pinned and device-mapped
on gpu), and a record is read from the file when a consumer needs it and no row holds it: :meth:`HostTier.ensure`
maps (layer, local ids) to host rows, reading the missing records into free rows or into the least recently ensured
unpinned ones. Its recency is its own (the GPU cache's LRU knows nothing of it): a row is touched when a record is
*needed in host memory* (a GPU cache miss, the CPU share, the cpu device's expert call, a prefill layer), not when the
GPU cache hits.

Consumers address rows, not flat ids: the GPU cache rewrites each copy worklist item's source to its row (the copy
kernel's ``first`` is 0, so it reads row ``source``), the CPU kernels get the group's arrays and ids remapped to rows.
A row may be overwritten only when nothing still reads it: the rows a call ensures are spared by that call, a CPU job
pins its rows until it is merged (:meth:`HostTier.pin` / :meth:`HostTier.unpin`), and an asynchronous copy that read
rows is :meth:`HostTier.fence`-d: before the tier overwrites any row that held a record it waits for those copies.

The file side is a *reader* (``freetoken.loaders.ftw_records.FTWRecordReader``: one ``pread`` per run of adjacent
records, checksums verified as the load's ``verify`` says); this layer only needs ``reader.read(layer, experts,
sink)`` calling ``sink(expert, payload)`` with each record's payload (uint8, the record layout's bank bytes).
"""

from __future__ import annotations

import numpy as np

from freetoken.formats import RecordLayout
from freetoken.formats.base import ALIGNMENT
from freetoken.formats.parts import ExpertParts, as_parts


class HostTierError(ValueError):
    """A host budget the tier cannot work with, or a call that needs more rows than the tier can free."""


def _size(n: int) -> str:
    for unit, b in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= b:
            return f"{n / b:.2f} {unit}"
    return f"{n} B"


def records_per_group(parts: list[ExpertParts], groups: list[RecordLayout]) -> np.ndarray:
    """int64 [layers, groups]: how many of each layer's records are in each layout."""
    per = np.zeros((len(parts), len(groups)), np.int64)
    for layer, p in enumerate(parts):
        for lay, (lo, hi) in zip(p.layouts, p.bounds, strict=True):
            per[layer, groups.index(lay)] += hi - lo
    return per


def minimum_bytes(parts: list[ExpertParts]) -> int:
    """The smallest host budget a tier works with: in every layout, twice the records one layer keeps in it (a
    prefill streams whole layers; a split step pins one layer's CPU records while its GPU share is read in)."""
    groups = list(dict.fromkeys(lay for p in parts for lay in p.layouts))
    per = records_per_group(parts, groups)
    return int(sum(2 * int(per[:, g].max()) * lay.record_bytes for g, lay in enumerate(groups)))


def plan_rows(groups: list[RecordLayout], per: np.ndarray, budget: int) -> list[int] | None:
    """Rows per layout for a host budget of ``budget`` bytes, or None when every record fits (no tier needed).
    Each layout gets its minimum (twice its largest layer's records), the rest of the budget in proportion to the
    bytes still missing per layout."""
    rb = np.array([lay.record_bytes for lay in groups], np.int64)
    total = per.sum(axis=0)
    if budget >= int((total * rb).sum()):
        return None
    rows = np.minimum(2 * per.max(axis=0), total)
    need = int((rows * rb).sum())
    if budget < need:
        raise HostTierError(f"a host memory budget of {_size(budget)} cannot hold the routed experts of two MoE layers "
                            f"(prefill streams whole layers through host memory): use at least {_size(need)} "
                            f"({need} bytes)")
    left = budget - need
    room = (total - rows) * rb
    if room.sum() > 0:
        share = np.floor(left * (room / room.sum()) / rb).astype(np.int64)
        rows = np.minimum(rows + share, total)
    return [int(r) for r in rows]


class HostTier:
    """``layouts`` (one per layer, or one for all; each a layout or :class:`ExpertParts`), ``num_layers`` x
    ``num_experts`` records, read through ``reader`` into at most ``budget`` bytes of rows. Raises
    :class:`HostTierError` for a budget under :func:`minimum_bytes`, or one that holds everything (then the plain
    :class:`HostPool` is the right thing)."""

    def __init__(self, device, layouts: RecordLayout | list[RecordLayout | ExpertParts], num_layers: int,
                 num_experts: int, reader, budget: int):
        if num_layers < 1 or num_experts < 1:
            raise ValueError(f"a host tier needs layers and experts, got {num_layers} x {num_experts}")
        layouts = [layouts] * num_layers if isinstance(layouts, RecordLayout) else list(layouts)
        if len(layouts) != num_layers:
            raise ValueError(f"{len(layouts)} record layouts for {num_layers} layers")
        self.device, self.reader, self.budget = device, reader, int(budget)
        self.parts = [as_parts(lay, num_experts) for lay in layouts]
        if any(p.num_experts != num_experts for p in self.parts):
            raise ValueError(f"every layer needs {num_experts} experts")
        self.layouts = [p.largest for p in self.parts]
        self.num_layers, self.num_experts = num_layers, num_experts
        self.groups: list[RecordLayout] = list(dict.fromkeys(lay for p in self.parts for lay in p.layouts))
        self._group = [[self.groups.index(lay) for lay in p.layouts] for p in self.parts]
        per = records_per_group(self.parts, self.groups)
        rows = plan_rows(self.groups, per, self.budget)
        if rows is None:
            raise HostTierError(f"a host budget of {_size(self.budget)} holds every routed expert: no tier needed")
        #: Rows per layout group.
        self.rows = rows
        self.group_banks = [{s.name: device.pinned_empty((n, *s.shape), s.dtype) for s in lay.bank_specs()}
                            for lay, n in zip(self.groups, rows, strict=True)]
        for banks in self.group_banks:
            for b in banks.values():
                b.host[...] = 0
        # each group's banks as NumPy arrays (one dict per group, kept: the cpu kernels cache their checks by it)
        self._host_banks = [{name: b.host for name, b in banks.items()} for banks in self.group_banks]
        # where each bank's bytes sit in a record's payload (bank_specs order, each padded to ALIGNMENT), and the
        # rows of each bank as uint8 [rows, bank bytes]
        self._spans = []
        for lay, banks in zip(self.groups, self.group_banks, strict=True):
            spans, at = [], 0
            for s in lay.bank_specs():
                n = int(s.nbytes)
                spans.append((banks[s.name].host.reshape(banks[s.name].host.shape[0], -1).view(np.uint8), at, n))
                at += -(-n // ALIGNMENT) * ALIGNMENT
            self._spans.append(spans)
        flat = num_layers * num_experts
        #: Flat id (layer * E + local id) -> its row in its group's arrays, -1 when not in host memory.
        self.row_of = np.full(flat, -1, np.int64)
        self._group_of_flat = np.empty(flat, np.int64)
        self._expert_of = []  # per layer: local id -> expert id (the file's numbering)
        for layer, p in enumerate(self.parts):
            for g, (lo, hi) in zip(self._group[layer], p.bounds, strict=True):
                self._group_of_flat[layer * num_experts + lo:layer * num_experts + hi] = g
            self._expert_of.append(np.concatenate(p.experts).astype(np.int64))
        self._owner = [np.full(n, -1, np.int64) for n in rows]
        self._stamp = [np.full(n, -1, np.int64) for n in rows]  # -1: a free row
        self._pins = [np.zeros(n, np.int32) for n in rows]
        self._clock = 0
        self._fences: list = []
        self.reset_stats()

    # ---- what the GPU cache and the CPU kernels read ------------------------------------------------------------
    @property
    def num_records(self) -> int:
        return self.num_layers * self.num_experts

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for banks in self.group_banks for b in banks.values())

    @property
    def model_bytes(self) -> int:
        """Bytes of every routed expert record (what a resident pool would hold)."""
        return sum(p.host_bytes for p in self.parts)

    def group_of(self, layer: int, part: int = 0) -> int:
        self._check_layer(layer)
        return self._group[layer][part]

    def layer_rows(self, layer: int, part: int = 0) -> tuple[dict, int]:
        """(the bank arrays of the group holding part ``part`` of ``layer``'s records, 0): the cache's copy table
        reads row ``source - 0``, and every worklist source is rewritten to a row (:meth:`ensure`)."""
        return self.group_banks[self.group_of(layer, part)], 0

    def group_host_banks(self, group: int) -> dict[str, np.ndarray]:
        """Group ``group``'s banks as NumPy arrays [rows, ...] (the same dict on every call)."""
        return self._host_banks[group]

    def _check_layer(self, layer: int) -> None:
        if not 0 <= layer < self.num_layers:
            raise IndexError(f"layer {layer} out of range (the tier has {self.num_layers})")

    # ---- residency -------------------------------------------------------------------------------------------
    def ensure(self, layer: int, local_ids, pin: bool = False) -> np.ndarray:
        """Host rows (int32, the shape of ``local_ids``) of ``layer``'s records ``local_ids`` (local ids, repeats
        allowed), reading those not in host memory from the file into free or least recently ensured unpinned rows
        (none of this call's). Each id's row is in the arrays of its part's layout group. ``pin``: keep the rows
        until :meth:`unpin`."""
        self._check_layer(layer)
        ids = np.asarray(local_ids, np.int64)
        uniq = np.unique(ids)
        if uniq.size and (uniq[0] < 0 or uniq[-1] >= self.num_experts):
            raise IndexError(f"local ids of layer {layer} out of range [0, {self.num_experts})")
        flat = layer * self.num_experts + uniq
        self._clock += 1
        rows = self.row_of[flat]
        hit = rows >= 0
        grp = self._group_of_flat[flat]
        for g in np.unique(grp[hit]):
            sel = hit & (grp == g)
            self._stamp[g][rows[sel]] = self._clock
        self.hits += int(hit.sum())
        if not hit.all():
            self._fill(layer, uniq[~hit], flat[~hit], grp[~hit])
            rows = self.row_of[flat]
        if pin:
            for g in np.unique(grp):
                np.add.at(self._pins[g], rows[grp == g], 1)
        return rows[np.searchsorted(uniq, ids)].astype(np.int32)

    def unpin(self, layer: int, local_ids) -> None:
        """Release rows pinned by ``ensure(layer, local_ids, pin=True)``."""
        uniq = np.unique(np.asarray(local_ids, np.int64))
        flat = layer * self.num_experts + uniq
        rows, grp = self.row_of[flat], self._group_of_flat[flat]
        for g in np.unique(grp):
            np.subtract.at(self._pins[g], rows[grp == g], 1)

    def fence(self, event) -> None:
        """An asynchronous copy that reads host rows was issued, ``event`` recorded after it: rows are overwritten
        only once it has completed."""
        self._fences.append(event)
        if len(self._fences) > 64:
            self._fences = [e for e in self._fences if not e.query()]

    def _wait_fences(self) -> None:
        for e in self._fences:
            e.synchronize()
        self._fences.clear()

    def _fill(self, layer: int, local: np.ndarray, flat: np.ndarray, grp: np.ndarray) -> None:
        """Read the records ``local`` of ``layer`` (not in host memory) into rows."""
        targets = np.empty(local.size, np.int64)
        for g in np.unique(grp):
            sel = grp == g
            k = int(sel.sum())
            stamp, pins = self._stamp[g], self._pins[g]
            cand = np.flatnonzero((pins == 0) & (stamp != self._clock))
            if cand.size < k:
                raise HostTierError(f"the host tier's {self.rows[g]} rows of {self.groups[g].name} records cannot take "
                                    f"{k} more of layer {layer} ({int((pins > 0).sum())} pinned, "
                                    f"{int((stamp == self._clock).sum())} in use by this call): raise --host-memory")
            pick = cand[np.argsort(stamp[cand], kind="stable")[:k]]  # free rows (-1) first, then least recent
            old = self._owner[g][pick]
            evict = old >= 0
            if evict.any():
                self._wait_fences()  # a copy issued earlier may still read these rows
                self.row_of[old[evict]] = -1
                self.evictions += int(evict.sum())
            self._owner[g][pick] = flat[sel]
            self.row_of[flat[sel]] = pick
            stamp[pick] = self._clock
            targets[sel] = pick
        experts = self._expert_of[layer][local]
        dest = {int(e): (int(g), int(r)) for e, g, r in zip(experts, grp, targets, strict=True)}
        done: set[int] = set()

        def sink(expert: int, payload: np.ndarray) -> None:
            g, row = dest[int(expert)]
            self._write(g, row, payload)
            done.add(int(expert))

        try:
            self.reader.read(layer, np.sort(experts), sink)
            if len(done) != len(dest):
                raise RuntimeError(f"the reader returned {len(done)} of {len(dest)} records of layer {layer}")
        except BaseException:  # the rows taken for records that did not arrive are free again
            for e, (g, row) in dest.items():
                if e not in done:
                    self.row_of[self._owner[g][row]] = -1
                    self._owner[g][row] = -1
                    self._stamp[g][row] = -1
            raise
        self.misses += len(dest)

    def _write(self, g: int, row: int, payload: np.ndarray) -> None:
        want = self.groups[g].record_bytes
        if payload.nbytes != want:
            raise ValueError(f"a record payload of {payload.nbytes} bytes, the {self.groups[g].name} layout takes "
                             f"{want}")
        for rows, at, n in self._spans[g]:
            rows[row] = payload[at:at + n]

    def record(self, flat_id: int) -> dict[str, np.ndarray]:
        """The bank rows of one record (``flat_id = layer * E + local id``): views of its host row when it has one,
        else read from the file into a fresh buffer (nothing becomes resident)."""
        layer, local = divmod(int(flat_id), self.num_experts)
        g = int(self._group_of_flat[flat_id])
        row = int(self.row_of[flat_id])
        if row >= 0:
            return {name: b[row] for name, b in self._host_banks[g].items()}
        out = {}

        def sink(expert: int, payload: np.ndarray) -> None:
            at = 0
            for s in self.groups[g].bank_specs():
                n = int(s.nbytes)
                out[s.name] = np.array(payload[at:at + n]).view(s.dtype).reshape(s.shape)
                at += -(-n // ALIGNMENT) * ALIGNMENT

        self.reader.read(layer, self._expert_of[layer][[local]], sink)
        return out

    def resident(self) -> np.ndarray:
        """The flat ids in host memory now, ascending."""
        return np.flatnonzero(self.row_of >= 0)

    # ---- counters --------------------------------------------------------------------------------------------
    def reset_stats(self) -> None:
        self.hits = self.misses = self.evictions = 0
        self._read0 = (getattr(self.reader, "bytes_read", 0), getattr(self.reader, "seconds", 0.0))

    def stats(self) -> dict:
        """Rows, budget, records ensured that were in host memory (hits) or read from the file (misses), rows
        evicted, bytes and seconds read since the last :meth:`reset_stats`."""
        total = self.hits + self.misses
        return {"rows": int(sum(self.rows)), "records": self.num_records, "budget": self.budget,
                "bytes": int(self.nbytes), "model_bytes": int(self.model_bytes), "hits": self.hits,
                "misses": self.misses, "hit_rate": self.hits / total if total else 0.0, "evictions": self.evictions,
                "bytes_read": int(getattr(self.reader, "bytes_read", 0) - self._read0[0]),
                "read_seconds": float(getattr(self.reader, "seconds", 0.0) - self._read0[1])}

    def report(self) -> str:
        """One line: rows, budget, hit rate, what was read from disk."""
        st = self.stats()
        gbps = st["bytes_read"] / st["read_seconds"] / 1e9 if st["read_seconds"] > 0 else 0.0
        return (f"host tier: {st['rows']} of {st['records']} expert records in host memory ({_size(st['bytes'])} of "
                f"{_size(st['model_bytes'])}, budget {_size(st['budget'])}), hit rate {st['hit_rate']:.1%} "
                f"({st['hits']} hits, {st['misses']} read from disk, {st['evictions']} evicted), "
                f"{_size(st['bytes_read'])} read in {st['read_seconds']:.2f} s ({gbps:.2f} GB/s)")
