"""The global expert cache: S slots shared by every MoE layer, admitted on the device (the cache ops of
:mod:`freetoken.ops.cache`: ``cuda/cache.cu``).

Decode, per MoE layer::

    cache.admit(layer, ids)   # ids [T, k] expert indices -> slot ids, in place, on the device
    cache.copy_missing()      # pull the missed records from the host pool into their slots
    ... routed expert kernels over cache.slot_banks ...

Prefill streams whole layers through two buffers borrowed from the first 2E slots::

    cache.begin_prefill()
    cache.prefetch_layer(0)
    for l in range(L):
        if l + 1 < L: cache.prefetch_layer(l + 1)   # copies on the transfer stream, overlapping layer l
        first = cache.wait_layer(l)                 # the compute stream waits for layer l's records
        ... expert kernels with slot ids = expert ids + first ...
        cache.release_layer(l)                      # the buffer may be refilled once these kernels finish

Statistics count unique active records per admit call (a record used by several tokens is one hit or miss).

Over a :class:`~freetoken.cache.host_tier.HostTier` (``--host-memory`` below the routed experts) a record the cache
misses may not be in host memory either: :meth:`ExpertCache.copy_missing` reads the worklist back (a synchronisation
per admission), has the tier bring its records into host rows and rewrites each item's source to its row before the
copy (the copy tables' ``first`` is 0); :meth:`ExpertCache.prefetch_layer` brings the whole layer in first. The copy
kernels are unchanged.
"""

from __future__ import annotations

import numpy as np

from freetoken.cache.host_pool import HostPool
from freetoken.cache.host_tier import HostTier
from freetoken.device.constants import BANK_TABLE, CACHE_ERR_ID_RANGE
from freetoken.device.constants import CACHE_MAX_BANKS as MAX_BANKS
from freetoken.device.constants import CACHE_MAX_PAIRS as MAX_ACTIVE
from freetoken.ops.cache import (
    CopyTable,
    cache_admit,
    cache_admit_scored,
    cache_borrow_layer,
    cache_copy,
    cache_scored_prefill,
    cache_stream_bypassed,
)

__all__ = ["BANK_TABLE", "MAX_ACTIVE", "MAX_BANKS", "CacheError", "ExpertCache"]


class CacheError(RuntimeError):
    """The device reported an admission error (an id out of range, or no slot left to evict)."""


class ExpertCache:
    """S slots of expert records on ``pool.device``, with LRU admission, pinning and prefill double buffers.

    Parameters
    ----------
    pool : the host pool (authoritative records), or a :class:`HostTier` over the weight file
    slots : number of device slots
    max_active : the most routed pairs one admit call may carry (tokens x top-k), at most 1024
    prefill_overlap : reserve the first 2E slots as prefill's double buffers
    policy : ``"lru"`` (the default: ``cache_admit``) or ``"default"``, the simulator's ``default`` policy
        (:mod:`freetoken.policy.next_use`, ``RECOMMENDED``: next_use with bypass, the prefill prior and the long
        memory) admitted on the device by ``cache_admit_scored``; ``recency`` then holds each slot's stamp (the
        call clock of its last hit or admission); its prefill prior is :meth:`prefill_prior`. With bypass, a
        missed record may be left out of the cache: its flat id is in ``bypass[:n_bypass[0]]`` and (see below)
        it is streamed through a scratch slot.
    policy_state : for ``"default"``: :func:`freetoken.policy.next_use.next_use_device`'s answer (its constants,
        decay tables and starting estimates; made above this package, which does not import the policy core)
    scratch : for ``"default"``: after each admission the bypassed misses are copied by :meth:`copy_missing` into
        scratch slots past the ``slots`` the policy manages (the slot banks have ``scratch`` rows more; no id owns
        them, nothing is evicted) and their pairs read them there (``cache_stream_bypassed``); a call bypasses at
        most ``scratch`` misses (later ones are admitted). None: ``max_distinct`` (every bypass of a call fits).
        0: no streaming, bypassed pairs keep slot ``CACHE_BYPASSED``, which no expert kernel reads (the
        admission's own tests).
    """

    def __init__(self, pool: HostPool | HostTier, slots: int, *, max_active: int, prefill_overlap: bool = True,
                 policy: str = "lru", policy_state: dict | None = None, scratch: int | None = None):
        if policy not in ("lru", "default"):
            raise ValueError(f"unknown cache policy {policy!r}; choose lru or default")
        dev = pool.device
        if dev.kind == "cpu":
            raise ValueError("the expert cache runs on the gpu or emu device; the cpu device reads the host pool")
        e = pool.num_experts
        if not 1 <= max_active <= MAX_ACTIVE:
            raise ValueError(f"max_active={max_active} must be in [1, {MAX_ACTIVE}]")
        # One admission touches one layer: at most min(pairs, E) distinct records are active at once.
        self.max_distinct = min(max_active, e)
        need = max(self.max_distinct, 2 * e if prefill_overlap else 0)
        if slots < need:
            why = (f"prefill overlap needs 2 x {e} experts = {2 * e} slots"
                   if prefill_overlap and 2 * e >= self.max_distinct
                   else f"one step can route {self.max_distinct} distinct experts")
            raise ValueError(f"{slots} slots cannot work: {why}; use at least {need}")
        if max(len(lay.bank_specs()) for lay in pool.groups) > MAX_BANKS:
            raise ValueError(f"record layouts of more than {MAX_BANKS} banks are not supported")
        self.device, self.pool, self.slots = dev, pool, slots
        #: Slots past ``slots`` that bypassed misses stream through (the ``default`` policy; 0 otherwise).
        if scratch is not None and not 0 <= scratch <= self.max_distinct:
            raise ValueError(f"scratch={scratch} must be in [0, {self.max_distinct}] (the distinct ids of one call)")
        self.scratch = 0 if policy != "default" else self.max_distinct if scratch is None else scratch
        #: The host tier the records come from when host memory holds only some of them (else None).
        self.tier = pool if isinstance(pool, HostTier) else None
        self._tier_worklists = [None, None]  # prefill's worklists with host rows as sources (kept until copied)
        self._staged = None  # stage_missing's answer for the last admission (None: not staged)
        self.num_layers, self.num_experts = pool.num_layers, e
        self.max_active, self.prefill_overlap = max_active, prefill_overlap
        xp = dev.xp
        #: The slot banks as each of ``pool.groups``' layouts reads them ([slots, ...] by bank name).
        self.group_slot_banks, self.slot_nbytes = _slot_banks(dev, pool.groups, slots + self.scratch)
        #: The slot banks of layer 0's layout ([slots + scratch, ...] by bank name); :meth:`layer_slot_banks` gives
        #: any layer's.
        self.slot_banks = self.group_slot_banks[pool.group_of(0)]
        #: Bytes of the largest record (of one record when the layers share a layout).
        self.record_bytes = max(lay.record_bytes for lay in pool.groups)
        self.slot_for_id = xp.empty(pool.num_records, np.int32)
        self.id_of_slot = xp.empty(slots, np.int32)
        self.recency = xp.empty(slots, np.int64)
        self.pinned = xp.empty(slots, np.uint8)
        self.clock = xp.empty(1, np.int64)
        self.hits = xp.empty(self.num_layers, np.int64)
        self.misses = xp.empty(self.num_layers, np.int64)
        self.err = xp.empty(1, np.int32)
        self.worklist = xp.empty(2 * max_active, np.int32)
        self.n_work = xp.empty(1, np.int32)
        self.prefill_worklists = [xp.empty(2 * e, np.int32) for _ in range(2)]
        self.prefill_n_work = [xp.empty(1, np.int32) for _ in range(2)]
        self.transfer = dev.stream()
        # per layer, one copy table per part (a layer whose experts are in several layouts has several)
        self._copy_tables = [[self._layer_copy_table(layer, g) for g in range(len(pool.parts[layer].layouts))]
                             for layer in range(self.num_layers)]
        # a mixed layer's prefill copies: each part's slice of the borrowed worklist, with its own count
        self._part_counts = {(layer, g): xp.asarray(np.array([hi - lo], np.int32))
                             for layer, parts in enumerate(pool.parts) if parts.mixed
                             for g, (lo, hi) in enumerate(parts.bounds)}
        self._worklist_layer = (0, 0)  # the (layer, part) of the last admission: its worklist's records
        self.policy = policy
        if policy == "default":
            self._scored_init(policy_state)
        self.reset()

    def _scored_init(self, ps: dict | None) -> None:
        """The scored policy's device state (freetoken/policy/scored.py's arrays) from ``ps``
        (:func:`freetoken.policy.next_use.next_use_device`'s answer)."""
        if ps is None:
            raise ValueError('policy="default" needs policy_state=freetoken.policy.next_use.next_use_device(layers, '
                             'experts, slots)')
        if (ps["layers"], ps["experts"], ps["slots"]) != (self.num_layers, self.num_experts, self.slots):
            raise ValueError(f"policy_state is for {ps['layers']} x {ps['experts']} ids and {ps['slots']} slots, the "
                             f"cache has {self.num_layers} x {self.num_experts} and {self.slots}")
        self._scored_glob0 = np.array(ps["glob"], np.float64)
        dev, xp, n = self.device, self.device.xp, self.pool.num_records
        self.dp, self.dp2 = dev.asarray(ps["dp"]), dev.asarray(ps["dp2"])
        self.lclock = xp.empty(self.num_layers, np.int64)
        self.last = xp.empty(n, np.int64)
        self.c1, self.c2, self.c3, self.c4 = (xp.empty(n, np.float64) for _ in range(4))
        self.glob = xp.empty(3, np.float64)
        self.bypass = xp.empty(self.max_active, np.int32)
        self.n_bypass = xp.empty(1, np.int32)
        self.bypassed = xp.empty(self.num_layers, np.int64)
        self.scored_consts = ps["consts"]

    def prefill_prior(self, layer: int, counts, k_eff: float, stream=None) -> None:
        """The ``default`` policy's prefill prior for ``layer`` at a prompt's start, after its borrow (``counts``:
        float64 [E] on the device, the prompt's tokens routed to each expert; ``k_eff``: tokens per decode step x
        top-k). Nothing under ``lru``. The runtime does not call it yet."""
        if self.policy != "default":
            return
        cache_scored_prefill(layer, self.num_experts, counts, k_eff, self.lclock, self.last, self.c1, self.c4,
                             self.dp, self.dp2, self.scored_consts, stream=stream, device=self.device)

    # ---- state ---------------------------------------------------------------------------------------------
    def reset(self) -> None:
        """Forget everything: empty slots, no pins, zero statistics (slot bytes are left as they are)."""
        for a in (self.slot_for_id, self.id_of_slot, self.recency):
            a[...] = -1
        for a in (self.pinned, self.clock, self.hits, self.misses, self.err, self.n_work):
            a[...] = 0
        if self.policy == "default":
            for a in (self.lclock, self.last, self.c1, self.c2, self.c3, self.c4, self.n_bypass, self.bypassed):
                a[...] = 0
            self.glob[...] = self.device.asarray(self._scored_glob0)
        self.prefill_bytes = 0
        #: per layer, bypassed misses :meth:`place_bypassed` left to the caller (not copied)
        self.served_elsewhere = np.zeros(self.num_layers, np.int64)
        self._unplaced = None  # (layer, expert ids, slots) of an admission whose bypassed misses wait for placing
        self._pinned_slots: list[int] = []
        self._ready = [None, None]
        self._release = [None, None]

    def stats(self) -> dict:
        """Hits, misses and bytes copied, in total and per layer (synchronises). Under the ``default`` policy also
        ``bypassed``: misses left out of the cache (streamed through scratch slots, so still copied, unless the
        cache was made with ``scratch=0`` or :meth:`place_bypassed` left them to the CPU)."""
        hits = self.device.to_host(self.hits).astype(int)
        misses = self.device.to_host(self.misses).astype(int)
        loads = misses
        extra = {}
        if self.policy == "default":
            bypassed = self.device.to_host(self.bypassed).astype(int)
            loads = misses - self.served_elsewhere if self.scratch else misses - bypassed
            extra = {"bypassed": int(bypassed.sum())}
        total = int(hits.sum() + misses.sum())
        return {"hits": int(hits.sum()), "misses": int(misses.sum()), **extra,
                "hit_rate": float(hits.sum() / total) if total else 0.0,
                "bytes_copied": sum(int(m) * self.layer_record_bytes(i) for i, m in enumerate(loads)),
                "prefill_bytes": self.prefill_bytes,
                "per_layer": [{"layer": i, "hits": int(h), "misses": int(m)} for i, (h, m) in
                              enumerate(zip(hits, misses, strict=True))]}

    def check_errors(self) -> None:
        """Raise if an admission since the last check failed (synchronises)."""
        code = int(self.device.to_host(self.err)[0])
        if code:
            self.err[...] = 0
            raise CacheError("an expert id was out of range" if code == CACHE_ERR_ID_RANGE else
                             f"no slot left to evict: {self.slots} slots, {len(self._pinned_slots)} pinned")

    # ---- decode ----------------------------------------------------------------------------------------------
    def admit(self, layer: int, ids, stream=None, count: bool = True, part: int = 0,
              stream_bypassed: bool = True) -> None:
        """Rewrite ``ids`` (int32 [T, k] on the device, local expert ids of ``layer``, or ``NO_ROUTE``) in place to
        slot ids (``NO_ROUTE`` pairs stay so).

        ``count=False`` (a prefetch) leaves the per-layer hit/miss statistics unchanged. ``part``: the part of a
        mixed layer every id belongs to (its records are the ones :meth:`copy_missing` then copies). Under the
        ``default`` policy with scratch slots the bypassed misses are streamed through them; ``stream_bypassed=False``
        leaves their pairs ``CACHE_BYPASSED`` until :meth:`place_bypassed` says which are streamed."""
        if not 0 <= layer < self.num_layers:
            raise IndexError(f"layer {layer} out of range ({self.num_layers} MoE layers)")
        if ids.dtype != np.int32 or not ids.flags.c_contiguous:
            raise TypeError("ids must be a C-contiguous int32 array")
        pairs = int(ids.size)
        if pairs > self.max_active:
            raise ValueError(f"{pairs} routed pairs exceed max_active={self.max_active}")
        if self.policy == "default":
            expert_ids = ids.copy() if self.scratch else None  # the admission rewrites ids; streaming needs them
            cache_admit_scored(ids, layer, self.num_experts, self.slot_for_id, self.id_of_slot, self.recency,
                               self.pinned, self.clock, self.lclock, self.last, self.c1, self.c2, self.c3, self.c4,
                               self.dp, self.dp2, self.glob, self.scored_consts, self.worklist, self.n_work,
                               self.bypass, self.n_bypass, self.hits, self.misses, self.bypassed, self.err, count=count,
                               max_bypass=self.scratch or MAX_ACTIVE, stream=stream, device=self.device)
            self._unplaced = None
            if self.scratch and stream_bypassed:
                cache_stream_bypassed(expert_ids, ids, layer, self.num_experts, self.bypass, self.n_bypass, self.slots,
                                      self.worklist, self.n_work, self.err, stream=stream, device=self.device)
            elif self.scratch:
                self._unplaced = (layer, expert_ids, ids)
        else:
            cache_admit(ids, layer, self.num_experts, self.slot_for_id, self.id_of_slot, self.recency, self.pinned,
                        self.clock, self.worklist, self.n_work, self.hits, self.misses, self.err, count=count,
                        stream=stream, device=self.device)
        self._worklist_layer = (layer, part)
        self._staged = None

    def bypassed_ids(self) -> np.ndarray:
        """The flat ids the last :meth:`admit` bypassed, in the admission's order (int32, on the host; synchronises)."""
        n = int(self.device.to_host(self.n_bypass)[0])
        return np.asarray(self.device.to_host(self.bypass[:n]), np.int32).copy() if n else np.zeros(0, np.int32)

    def place_bypassed(self, streamed, elsewhere, stream=None) -> None:
        """After ``admit(..., stream_bypassed=False)``: stream the bypassed flat ids ``streamed`` through scratch slots
        (as :meth:`admit` streams all of them) and leave those in ``elsewhere`` to the caller (their pairs become
        ``NO_ROUTE``: the hybrid split computes them on the CPU). Together they are :meth:`bypassed_ids`, in any
        order; they are not copied, so :meth:`stats` does not count their bytes."""
        if self._unplaced is None:
            raise RuntimeError("place_bypassed follows admit(..., stream_bypassed=False) under the default policy")
        layer, expert_ids, slots = self._unplaced
        streamed, elsewhere = (np.asarray(a, np.int32).reshape(-1) for a in (streamed, elsewhere))
        order = np.concatenate([streamed, elsewhere])
        if not np.array_equal(np.sort(order), np.sort(self.bypassed_ids())):
            raise ValueError("streamed and elsewhere must split the bypassed ids of the last admission")
        if len(streamed) > self.scratch:
            raise ValueError(f"{len(streamed)} streamed misses exceed the {self.scratch} scratch slots")
        if order.size:
            self.bypass[:order.size] = self.device.asarray(order)
        cache_stream_bypassed(expert_ids, slots, layer, self.num_experts, self.bypass, self.n_bypass, self.slots,
                              self.worklist, self.n_work, self.err, limit=len(streamed), stream=stream,
                              device=self.device)
        self.served_elsewhere[layer] += len(elsewhere)
        self._unplaced = None

    def stage_missing(self, stream=None) -> bool:
        """Over a host tier: bring the records the last :meth:`admit` missed into host memory and point the worklist
        at their rows (``stream``: the one :meth:`copy_missing` will run on), so that a timed copy times the copy
        alone. Returns whether there is anything to copy (always True without a tier). :meth:`copy_missing` does
        it when it was not done."""
        if self.tier is None:
            return True
        if self._staged is None:
            self._staged = self._tier_sources(stream, *self._worklist_layer)
        return self._staged

    def copy_missing(self, stream=None) -> None:
        """Copy the records the last :meth:`admit` missed from the host pool into their slots (over a host tier:
        :meth:`stage_missing` first)."""
        staged = self.stage_missing(stream)
        self._staged = None
        if not staged:
            return
        self._copy(self.worklist, self.n_work, self.max_active, stream, *self._worklist_layer)
        if self.tier is not None:
            self.tier.fence(self.device.event().record(stream))

    def _tier_sources(self, stream, layer: int, part: int = 0) -> bool:
        """The last admission's missed records into host memory and each worklist source rewritten to its host row
        (on the current stream; ``stream`` then waits for it). False when nothing was missed."""
        dev = self.device
        n = int(dev.to_host(self.n_work)[0])  # waits for the admission: the one synchronisation of this mode
        if n == 0:
            return False
        wl = np.array(dev.to_host(self.worklist[:2 * n]), np.int32).reshape(n, 2)
        flat = wl[:, 1].astype(np.int64)
        if (flat // self.num_experts != layer).any():
            raise CacheError(f"the worklist of an admission of layer {layer} lists records of other layers")
        wl[:, 1] = self.tier.ensure(layer, flat % self.num_experts)
        self.worklist[:2 * n] = dev.asarray(wl.reshape(-1))
        if stream is not None:
            stream.wait_event(dev.event().record())
        return True

    def _copy(self, worklist, n_work, max_items: int, stream, layer: int, part: int = 0) -> None:
        cache_copy(worklist, n_work, self._copy_tables[layer][part], max_items, stream=stream, device=self.device)

    def _layer_copy_table(self, layer: int, part: int) -> CopyTable:
        rows, first = self.pool.layer_rows(layer, part)
        slot = self.layer_slot_banks(layer, part)
        specs = self.pool.parts[layer].layouts[part].bank_specs()
        return CopyTable(self.device, [(rows[s.name], slot[s.name]) for s in specs], first)

    def layer_slot_banks(self, layer: int, part: int = 0) -> dict:
        """The slot banks as MoE layer ``layer``'s record layout (of its part ``part``) reads them: [slots, ...] by
        bank name (views of slot rows sized for the largest layout when the layers differ)."""
        return self.group_slot_banks[self.pool.group_of(layer, part)]

    def layer_record_bytes(self, layer: int) -> int:
        """Bytes of the layer's largest record."""
        return self.pool.layouts[layer].record_bytes

    # ---- prefill ---------------------------------------------------------------------------------------------
    def _check_prefill(self, layer: int) -> int:
        if not self.prefill_overlap:
            raise RuntimeError("this cache was built with prefill_overlap=False")
        if not 0 <= layer < self.num_layers:
            raise IndexError(f"layer {layer} out of range ({self.num_layers} MoE layers)")
        return layer % 2

    def begin_prefill(self) -> None:
        """Start a prefill pass (buffers free)."""
        self.device.synchronize()
        self._ready = [None, None]
        self._release = [None, None]

    def prefetch_layer(self, layer: int) -> int:
        """Borrow buffer ``layer % 2`` and copy all of ``layer``'s records into it on the transfer stream.

        Waits (on the transfer stream) for the release of the layer that used the buffer before. Returns the
        buffer's first slot.
        """
        b = self._check_prefill(layer)
        first = b * self.num_experts
        if self._release[b] is not None:
            self.transfer.wait_event(self._release[b])  # the fence before reuse
        wl, nw = self.prefill_worklists[b], self.prefill_n_work[b]
        cache_borrow_layer(layer, first, self.num_experts, self.slot_for_id, self.id_of_slot, self.recency, wl, nw,
                           stream=self.transfer, device=self.device)
        if self.tier is not None:  # the whole layer into host memory; the copies read it from its rows
            e = self.num_experts
            rows = self.tier.ensure(layer, np.arange(e))
            wl = self.device.asarray(np.stack([first + np.arange(e, dtype=np.int32), rows], axis=1).reshape(-1))
            self._tier_worklists[b] = wl
            self.transfer.wait_event(self.device.event().record())
        parts = self.pool.parts[layer]
        if not parts.mixed:
            self._copy(wl, nw, self.num_experts, self.transfer, layer)
        else:  # the worklist lists local ids 0 .. E - 1 in order: each part's records are one slice of it
            for g, (lo, hi) in enumerate(parts.bounds):
                self._copy(wl[2 * lo:], self._part_counts[(layer, g)], hi - lo, self.transfer, layer, g)
        self._ready[b] = self.device.event().record(self.transfer)
        if self.tier is not None:
            self.tier.fence(self._ready[b])
        self.prefill_bytes += parts.host_bytes
        return first

    def wait_layer(self, layer: int, stream=None) -> int:
        """Make ``stream`` (default: the current one) wait until ``layer``'s records are in their buffer."""
        b = self._check_prefill(layer)
        if self._ready[b] is None:
            raise RuntimeError(f"layer {layer} was not prefetched")
        self.device.wait_event(self._ready[b], stream)
        return b * self.num_experts

    def release_layer(self, layer: int, stream=None) -> None:
        """Record that ``layer``'s expert kernels have been issued; its buffer is refilled after they finish."""
        b = self._check_prefill(layer)
        self._release[b] = self.device.event().record(stream)

    # ---- pinning ---------------------------------------------------------------------------------------------
    def pin(self, layer: int, experts) -> None:
        """Keep ``experts`` of ``layer`` in slots that are never evicted (taken from the end of the pool)."""
        if not 0 <= layer < self.num_layers:
            raise IndexError(f"layer {layer} out of range ({self.num_layers} MoE layers)")
        for e in (int(v) for v in np.atleast_1d(experts)):
            if not 0 <= e < self.num_experts:
                raise ValueError(f"expert {e} out of range ({self.num_experts} experts)")
            f = layer * self.num_experts + e
            if f in self._pinned_ids():
                continue
            slot = self.slots - 1 - len(self._pinned_slots)
            floor = 2 * self.num_experts if self.prefill_overlap else 0
            if slot < floor or self.slots - len(self._pinned_slots) - 1 < self.max_distinct:
                raise ValueError(f"cannot pin more than {len(self._pinned_slots)} experts: {self.slots} slots must "
                                 f"keep {max(floor, self.max_distinct)} free for admission and prefill")
            cur = int(self.device.to_host(self.slot_for_id[f:f + 1])[0])
            if cur >= 0 and cur != slot:
                self.id_of_slot[cur:cur + 1] = -1
                self.recency[cur:cur + 1] = -1
            old = int(self.device.to_host(self.id_of_slot[slot:slot + 1])[0])
            if old >= 0:
                self.slot_for_id[old:old + 1] = -1
            self.id_of_slot[slot:slot + 1] = f
            self.slot_for_id[f:f + 1] = slot
            self.pinned[slot:slot + 1] = 1
            self.recency[slot:slot + 1] = self.clock
            src = f if self.tier is None else int(self.tier.ensure(layer, [e])[0])
            work = self.device.asarray(np.array([slot, src], np.int32))
            self._copy(work, self.device.asarray(np.array([1], np.int32)), 1, None, layer,
                       self.pool.parts[layer].part_of(e))
            self._pinned_slots.append(slot)
        self.device.synchronize()

    def _pinned_ids(self) -> set[int]:
        ids = self.device.to_host(self.id_of_slot)
        return {int(ids[s]) for s in self._pinned_slots}

    # ---- verification ----------------------------------------------------------------------------------------
    def check_invariants(self) -> None:
        """Both maps exact inverses, pins owned, and every owned slot's bytes equal to its host record."""
        dev = self.device
        dev.synchronize()
        sfi, ios = dev.to_host(self.slot_for_id), dev.to_host(self.id_of_slot)
        pinned = dev.to_host(self.pinned)
        for s, f in enumerate(ios):
            if f >= 0 and sfi[f] != s:
                raise AssertionError(f"slot {s} claims id {f}, but slot_for_id[{f}] = {sfi[f]}")
        for f in np.nonzero(sfi >= 0)[0]:
            if ios[sfi[f]] != f:
                raise AssertionError(f"id {f} maps to slot {sfi[f]}, which is owned by {ios[sfi[f]]}")
        for s in np.nonzero(pinned)[0]:
            if ios[s] < 0:
                raise AssertionError(f"pinned slot {s} is empty")
        for s in np.nonzero(ios >= 0)[0]:
            layer, local = divmod(int(ios[s]), self.num_experts)
            part = self.pool.parts[layer].part_of(local)
            for name, host in self.pool.record(int(ios[s])).items():
                row = dev.to_host(self.layer_slot_banks(layer, part)[name][int(s)])
                if not np.array_equal(np.ascontiguousarray(row).view(np.uint8), host.view(np.uint8)):
                    raise AssertionError(f"slot {s} bank {name}: bytes differ from host record {ios[s]}")


def _slot_banks(dev, layouts, slots: int) -> tuple[list[dict], int]:
    """(each layout's slot banks, [slots, ...] by bank name; the bytes they take). One layout: plain arrays of its
    banks. Several (layers in different formats): one uint8 array per bank name with rows as long as the longest of
    that bank over the layouts (rounded up to 16 bytes, so every slot's values stay 16-byte aligned), and each
    layout's banks as typed views of its rows: a slot holds any layer's record, and the slots cost the largest
    record, not the sum of them."""
    if len(layouts) == 1:
        banks = {s.name: dev.zeros((slots, *s.shape), s.dtype) for s in layouts[0].bank_specs()}
        return [banks], sum(int(b.nbytes) for b in banks.values())
    rows: dict[str, int] = {}
    for lay in layouts:
        for s in lay.bank_specs():
            rows[s.name] = max(rows.get(s.name, 0), -(-s.nbytes // 16) * 16)
    raw = {name: dev.zeros((slots, n), np.uint8) for name, n in rows.items()}
    views = [{s.name: raw[s.name][:, :s.nbytes].view(s.dtype).reshape(slots, *s.shape) for s in lay.bank_specs()}
             for lay in layouts]
    return views, sum(int(r.nbytes) for r in raw.values())
