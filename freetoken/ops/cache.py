"""The expert cache's device-side state machine (``cuda/cache.cu``, ``cpu_kernels/cache.py``): admission of one
layer's routed ids, the copy of missed records into their slots, and the prefill borrow of a double buffer.

:class:`freetoken.cache.ExpertCache` owns the arrays and calls these launchers; they take the arrays as they are
(int32 maps and worklists, int64 recency / clock / statistics, uint8 pins, int32 error code) and check only what a
kernel cannot survive. Semantics: docs/design.md, "The expert cache contract", and ``cache_admit`` in ``cuda/cache.cu``.
"""

from __future__ import annotations

import numpy as np

from freetoken.device.constants import BANK_TABLE, CACHE_MAX_BANKS, CACHE_MAX_PAIRS, SCORED_CONSTS
from freetoken.ops._common import check_int32, cpu_module, cuda_kernel, resolve


class CopyTable:
    """Source and destination of every bank of a record: ``pairs`` of (host bank [records, ...], slot bank
    [slots, ...]); a host bank may be a :class:`~freetoken.device.base.PinnedArray`. Host row 0 is the record of
    flat id ``first`` (a layer's own rows when layers differ in layout). A slot bank may be a strided view (slots
    sized for the largest of several layouts): its rows hold the record's bank bytes, ``strides[0]`` apart.
    Built once per cache (per layer layout)."""

    def __init__(self, dev, pairs, first: int = 0):
        if len(pairs) > CACHE_MAX_BANKS:
            raise ValueError(f"record layouts of more than {CACHE_MAX_BANKS} banks are not supported")
        self.dev, self.first = dev, int(first)
        self.pairs = list(pairs)
        table = np.zeros((), BANK_TABLE)
        self.row_bytes = []
        for i, (src, dst) in enumerate(self.pairs):
            row = int(src.nbytes // src.shape[0])
            if int(dst.nbytes // dst.shape[0]) != row or int(dst.strides[0]) < row:
                raise ValueError(f"bank {i}: host rows of {row} bytes, slot rows of {dst.nbytes // dst.shape[0]} "
                                 f"({dst.strides[0]} apart)")
            self.row_bytes.append(row)
            if dev.kind != "cpu":
                table["src"][i] = src.device_ptr if hasattr(src, "device_ptr") else dev.pointer_of(src)
                table["dst"][i] = dev.pointer_of(dst, strided_rows=True)
                table["bytes"][i] = row
                table["dst_stride"][i] = int(dst.strides[0])
        table["first"] = self.first
        table["n"] = len(self.pairs)
        self.table = table[()]

    def byte_views(self):
        """(src, dst) uint8 [rows, bytes] views of every bank (host devices; dst rows may be strided)."""
        for src, dst in self.pairs:
            host = src.host if hasattr(src, "host") else src
            yield _row_bytes_view(host), _row_bytes_view(dst)


def _row_bytes_view(a: np.ndarray) -> np.ndarray:
    """uint8 [rows, row bytes] over the same memory as ``a`` [rows, ...] (each row contiguous; rows may be strided)."""
    rows = a.reshape(a.shape[0], -1)
    if a.size and not np.shares_memory(rows, a):
        raise ValueError("a bank's rows must each be contiguous")  # reshape copied: writes would be lost
    return rows.view(np.uint8)


def cache_admit(ids, layer: int, experts: int, slot_for_id, id_of_slot, recency, pinned, clock, worklist, n_work,
                hits, misses, err, *, count: bool = True, stream=None, device=None) -> None:
    """Admit ``layer``'s routed expert ids: ``ids`` (int32, C-contiguous, at most 1024 pairs) rewritten in place to
    slot ids; the missed records listed in ``worklist`` (int32 [2 * pairs]: slot, flat id) with their count in
    ``n_work`` (int32 [1]); maps, recency, clock and (when ``count``) ``hits`` / ``misses`` [layers] updated;
    ``err`` (int32 [1]) raised to 1 for an id outside [0, experts), 2 when no slot is left to evict."""
    dev = resolve(device)
    if ids.dtype != np.int32 or not ids.flags.c_contiguous:
        raise TypeError("ids must be a C-contiguous int32 array")
    pairs = int(ids.size)
    if pairs > CACHE_MAX_PAIRS:
        raise ValueError(f"{pairs} routed pairs exceed the admission's {CACHE_MAX_PAIRS}")
    slots = int(id_of_slot.shape[0])
    if dev.kind == "cpu":
        admit_cpu = cpu_module("cache").cache_admit

        admit_cpu(ids, int(layer), int(experts), slot_for_id, id_of_slot, recency, pinned, clock, worklist, n_work,
                  hits, misses, err, 1 if count else 0)
        return
    threads = min(CACHE_MAX_PAIRS, 32 * -(-max(pairs, slots, 32) // 32))
    i32 = np.int32
    cuda_kernel(dev, "cache.cu", "cache_admit")(
        (1,), (threads,), (ids, i32(pairs), check_int32("layer", layer), check_int32("experts", experts), slot_for_id,
                           id_of_slot, recency, pinned, check_int32("slots", slots), clock, worklist, n_work, hits,
                           misses, err, i32(1 if count else 0)), stream=stream)


def cache_scored_prefill(layer: int, experts: int, counts, k_eff: float, lclock, last, c1, c4, dp, dp2, consts, *,
                         stream=None, device=None) -> None:
    """next_use's prefill prior for ``layer`` at a segment start (``cache_scored_prefill`` in ``cuda/cache.cu``;
    :func:`freetoken.policy.scored.scored_prefill`'s rule): ``counts`` float64 [experts] prefill tokens routed to
    each expert, ``k_eff`` tokens per step x top-k; seeds the layer's return counts ``c1``, ``c4`` and sets ``last``
    to its clock. A layer whose counts sum to 0 is left alone."""
    dev = resolve(device)
    if consts.dtype != SCORED_CONSTS:
        raise TypeError("consts must be a SCORED_CONSTS scalar")
    if counts.dtype != np.float64 or int(counts.size) != int(experts):
        raise TypeError(f"counts must be float64 [{experts}]")
    if dev.kind == "cpu":
        c = consts
        cpu_module("cache").cache_scored_prefill(
            int(layer), int(experts), counts, float(k_eff), lclock, last, c1, c4, dp, dp2, float(c["q"]),
            float(c["q2"]), float(c["prior_weight"]), float(c["prior_keep"]), float(c["long_prior_keep"]))
        return
    cuda_kernel(dev, "cache.cu", "cache_scored_prefill")(
        (1,), (min(1024, 32 * -(-int(experts) // 32)),),
        (check_int32("layer", layer), check_int32("experts", experts), counts, np.float64(k_eff), lclock, last, c1,
         c4, dp, dp2, consts), stream=stream)


def cache_admit_scored(ids, layer: int, experts: int, slot_for_id, id_of_slot, stamp, pinned, clock, lclock, last, c1,
                       c2, c3, c4, dp, dp2, glob, consts, worklist, n_work, bypass, n_bypass, hits, misses, bypassed,
                       err, *,
                       count: bool = True, max_bypass: int = CACHE_MAX_PAIRS, stream=None, device=None) -> None:
    """Admit ``layer``'s routed expert ids with the scored (next_use) policy, the simulator's ``default``
    (:mod:`freetoken.policy.next_use`; ``cache_admit_scored`` in ``cuda/cache.cu``): as :func:`cache_admit`, with
    ``stamp`` (int64 [slots], the call clock of each slot's last hit or admission) in place of recency and the
    policy's state on the device: ``lclock`` int64 [layers], ``last`` int64 [N], ``c1`` .. ``c4`` float64 [N], the
    decay tables ``dp``, ``dp2`` (float64), ``glob`` float64 [3] and ``consts`` (a ``SCORED_CONSTS`` scalar: fixed per
    cache). A bypassed miss is not loaded: its pairs get slot ``CACHE_BYPASSED`` and its flat id goes to ``bypass``
    (int32 [pairs]) with the count in ``n_bypass`` (int32 [1]); ``bypassed`` (int64 [layers]) counts them per layer
    beside ``hits`` / ``misses`` (when ``count``). At most ``max_bypass`` misses of the call are bypassed (the
    caller's scratch slots, :func:`cache_stream_bypassed`); later ones are admitted as if bypass were off."""
    dev = resolve(device)
    if ids.dtype != np.int32 or not ids.flags.c_contiguous:
        raise TypeError("ids must be a C-contiguous int32 array")
    pairs = int(ids.size)
    if pairs > CACHE_MAX_PAIRS:
        raise ValueError(f"{pairs} routed pairs exceed the admission's {CACHE_MAX_PAIRS}")
    if consts.dtype != SCORED_CONSTS:
        raise TypeError("consts must be a SCORED_CONSTS scalar")
    slots = int(id_of_slot.shape[0])
    if dev.kind == "cpu":
        admit_cpu = cpu_module("cache").cache_admit_scored

        c = consts
        admit_cpu(ids, int(layer), int(experts), slot_for_id, id_of_slot, stamp, pinned, clock, lclock, last, c1, c2,
                  c3, c4, dp, dp2, glob, float(c["q"]), float(c["q2"]), float(c["rho"]), float(c["kappa"]),
                  float(c["id_decay"]), float(c["global_decay"]), float(c["load_weight"]), float(c["long_weight"]),
                  int(c["layers"]), int(c["bypass"]), int(c["cycle"]), worklist, n_work, bypass, n_bypass, hits,
                  misses, bypassed, err, 1 if count else 0, int(max_bypass))
        return
    threads = min(CACHE_MAX_PAIRS, 32 * -(-max(pairs, slots, 32) // 32))
    i32 = np.int32
    cuda_kernel(dev, "cache.cu", "cache_admit_scored")(
        (1,), (threads,), (ids, i32(pairs), check_int32("layer", layer), check_int32("experts", experts), slot_for_id,
                           id_of_slot, stamp, pinned, check_int32("slots", slots), clock, lclock, last, c1, c2, c3,
                           c4, dp, dp2, glob, consts, worklist, n_work, bypass, n_bypass, hits, misses, bypassed,
                           err, i32(1 if count else 0), check_int32("max_bypass", max_bypass)), stream=stream)


def cache_stream_bypassed(ids, slots, layer: int, experts: int, bypass, n_bypass, scratch: int, worklist, n_work,
                          err, *, limit: int = -1, stream=None, device=None) -> None:
    """Stream the misses the last :func:`cache_admit_scored` bypassed through scratch slots (``cache_stream_bypassed``
    in ``cuda/cache.cu``): ``bypass[i]`` (i < ``n_bypass[0]``) is appended to the worklist (``n_work`` grows by the
    count) for slot ``scratch + i``, a slot past the cache's own that no id owns, and every pair of ``slots`` (the
    admission's rewritten copy of ``ids``) marked ``CACHE_BYPASSED`` is pointed there. Nothing is evicted, nothing
    stays resident: the next call that routes the id misses it again. The worklist must have room for the admitted
    and the bypassed misses (2 x distinct ids of the call). ``limit`` >= 0: only ``bypass[:limit]`` are streamed,
    the pairs of the others get ``NO_ROUTE`` (the hybrid split computes them on the CPU); -1: all."""
    dev = resolve(device)
    for name, a in (("ids", ids), ("slots", slots)):
        if a.dtype != np.int32 or not a.flags.c_contiguous:
            raise TypeError(f"{name} must be a C-contiguous int32 array")
    pairs = int(ids.size)
    if int(slots.size) != pairs:
        raise ValueError(f"slots has {slots.size} pairs, ids {pairs}")
    if pairs > CACHE_MAX_PAIRS:
        raise ValueError(f"{pairs} routed pairs exceed the admission's {CACHE_MAX_PAIRS}")
    if scratch < 0:
        raise ValueError(f"scratch slot {scratch} must be >= 0")
    if not -1 <= limit <= CACHE_MAX_PAIRS:
        raise ValueError(f"limit={limit} must be -1 (all) or in [0, {CACHE_MAX_PAIRS}]")
    if dev.kind == "cpu":
        cpu_module("cache").cache_stream_bypassed(ids, slots, int(layer), int(experts), bypass, n_bypass,
                                                  int(scratch), int(limit), worklist, n_work, err)
        return
    cuda_kernel(dev, "cache.cu", "cache_stream_bypassed")(
        (1,), (min(CACHE_MAX_PAIRS, 32 * -(-max(pairs, 1) // 32)),),
        (ids, slots, np.int32(pairs), check_int32("layer", layer), check_int32("experts", experts), bypass, n_bypass,
         check_int32("scratch", scratch), np.int32(limit), worklist, n_work, err), stream=stream)


def cache_copy(worklist, n_work, table: CopyTable, max_items: int, *, stream=None, device=None) -> None:
    """Copy every bank row of the first ``n_work[0]`` (at most ``max_items``) worklist records from the host banks
    into their slots (``table``: :class:`CopyTable`)."""
    dev = resolve(device)
    if dev.kind == "cpu":
        cache_copy_bank = cpu_module("cache").cache_copy_bank

        for src, dst in table.byte_views():
            cache_copy_bank(worklist, n_work, src, dst, table.first)
        return
    if max_items <= 0 or not table.pairs:
        return
    cuda_kernel(dev, "cache.cu", "cache_copy")(
        (check_int32("max_items", max_items), len(table.pairs)), (256,), (worklist, n_work, table.table),
        stream=stream)


def cache_borrow_layer(layer: int, first: int, experts: int, slot_for_id, id_of_slot, recency, worklist, n_work, *,
                       stream=None, device=None) -> None:
    """Prefill borrows slots [first, first + experts) for ``layer``: their previous owners lose mapping and recency,
    the slots stay unregistered, and ``worklist`` / ``n_work`` list the layer's records for :func:`cache_copy`."""
    dev = resolve(device)
    if first < 0 or first + experts > id_of_slot.shape[0]:
        raise ValueError(f"slots [{first}, {first + experts}) exceed the {id_of_slot.shape[0]} slots")
    if dev.kind == "cpu":
        borrow_cpu = cpu_module("cache").cache_borrow_layer

        borrow_cpu(int(layer), int(first), int(experts), slot_for_id, id_of_slot, recency, worklist, n_work)
        return
    i32 = np.int32
    cuda_kernel(dev, "cache.cu", "cache_borrow_layer")(
        (-(-experts // 128),), (128,), (check_int32("layer", layer), i32(first), check_int32("experts", experts),
                                        slot_for_id, id_of_slot, recency, worklist, n_work), stream=stream)
