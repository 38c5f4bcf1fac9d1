"""A pure NumPy model of the expert cache's state machine: the oracle of the device kernels.

It tracks maps, recency, pins, statistics and, per slot, which record's bytes the slot holds (``content``),
with exactly the semantics of ``cuda/cache.cu`` and its Numba twin ``cpu_kernels/cache.py`` (see
:func:`CacheModel.admit`).
"""

from __future__ import annotations

import math

import numpy as np

from freetoken.device.constants import (
    CACHE_BYPASSED,
    NO_ROUTE,
    SCORED_G_CONT,
    SCORED_G_LOADS,
    SCORED_G_REUSE,
    SCORED_PROTECT,
    SCORED_TAU_MAX,
    SCORED_TAU_MIN,
)


class CacheModel:
    def __init__(self, num_layers: int, num_experts: int, slots: int):
        self.num_layers, self.num_experts, self.slots = num_layers, num_experts, slots
        self.reset()

    def reset(self) -> None:
        self.slot_for_id = np.full(self.num_layers * self.num_experts, -1, np.int32)
        self.id_of_slot = np.full(self.slots, -1, np.int32)
        self.recency = np.full(self.slots, -1, np.int64)
        self.pinned = np.zeros(self.slots, bool)
        self.content = np.full(self.slots, -1, np.int64)  # flat id whose bytes the slot holds (-1: none yet)
        self.clock = 0
        self.hits = np.zeros(self.num_layers, np.int64)
        self.misses = np.zeros(self.num_layers, np.int64)

    def _assign(self, slot: int, flat: int) -> None:
        old = self.id_of_slot[slot]
        if old >= 0:
            self.slot_for_id[old] = -1
        self.id_of_slot[slot] = flat
        self.slot_for_id[flat] = slot
        self.content[slot] = flat

    def admit(self, layer: int, ids: np.ndarray) -> tuple[np.ndarray, list[tuple[int, int]]]:
        """Admit one layer's routed expert ids [T, k]; returns (slot ids [T, k], worklist of (slot, flat id)).

        The clock advances; hits refresh recency; misses in increasing flat-id order take the lowest-recency
        slot that is not pinned and holds no id active in this call (ties: lowest slot); empty slots have -1.
        """
        ids = np.asarray(ids)
        routed = ids != NO_ROUTE  # the other pairs go to another format's experts: left out
        if ((ids[routed] < 0) | (ids[routed] >= self.num_experts)).any():
            raise ValueError("expert id out of range")
        self.clock += 1
        now = self.clock
        flat = layer * self.num_experts + ids.astype(np.int64)
        active = np.unique(flat[routed])
        missing = []
        for f in active:
            s = self.slot_for_id[f]
            if s >= 0:
                self.recency[s] = now
            else:
                missing.append(int(f))
        work = []
        for f in missing:
            eligible = ~self.pinned & (self.recency != now)
            if not eligible.any():
                raise RuntimeError("no victim: too few slots")
            key = np.where(eligible, self.recency, np.iinfo(np.int64).max)
            v = int(np.argmin(key))  # argmin returns the lowest index among ties
            self._assign(v, f)
            self.recency[v] = now
            work.append((v, f))
        self.hits[layer] += len(active) - len(missing)
        self.misses[layer] += len(missing)
        return np.where(routed, self.slot_for_id[np.where(routed, flat, 0)], NO_ROUTE).astype(np.int32), work

    def borrow(self, layer: int, first: int) -> list[tuple[int, int]]:
        """Prefill borrows slots [first, first + E) for ``layer``; returns the copy worklist."""
        work = []
        for e in range(self.num_experts):
            s = first + e
            old = self.id_of_slot[s]
            if old >= 0:
                self.slot_for_id[old] = -1
            self.id_of_slot[s] = -1
            self.recency[s] = -1
            self.content[s] = layer * self.num_experts + e
            work.append((s, layer * self.num_experts + e))
        return work

    def pin(self, flat: int, slot: int) -> None:
        """Pin record ``flat`` into ``slot`` (which must not be pinned already)."""
        cur = self.slot_for_id[flat]
        if cur >= 0 and cur != slot:
            self.id_of_slot[cur] = -1
            self.recency[cur] = -1
            self.slot_for_id[flat] = -1
        self._assign(slot, flat)
        self.pinned[slot] = True
        self.recency[slot] = self.clock


class ScoredCacheModel:
    """The scored (next_use) admission of ``cache_admit_scored`` (``cuda/cache.cu``) in plain Python: the rules of
    :mod:`freetoken.policy.next_use`'s docstring, one double operation at a time in the order written there (Python
    floats are IEEE doubles and are never fused), so its decisions equal :func:`freetoken.policy.scored.scored_admit`'s
    on the same calls and its statistics equal them bit for bit. ``policy`` are :func:`~freetoken.policy.next_use.
    next_use_new`'s keyword arguments (default: its ``RECOMMENDED`` configuration, the simulator's ``default``, with the
    prefill prior: :meth:`prefill`)."""

    def __init__(self, num_layers: int, num_experts: int, slots: int, **policy):
        from freetoken.policy.next_use import RECOMMENDED, next_use_new

        self.num_layers, self.num_experts, self.slots = num_layers, num_experts, slots
        self._st = next_use_new(num_layers, num_experts, slots, **(policy or RECOMMENDED))
        self.reset()

    def reset(self) -> None:
        from freetoken.policy import scored as sc

        st = self._st
        self.dp, self.dp2 = st[sc.DP].copy(), st[sc.DP2].copy()
        p, meta = st[sc.PARAMS], st[sc.META]
        self.q, self.q2 = float(p[sc.RATE]), 1.0 - float(self.dp2[1])
        self.rho, self.kappa, self.id_decay = float(p[sc.RHO]), float(p[sc.KAPPA]), float(p[sc.ID_DECAY])
        self.global_decay, self.load_weight = float(p[sc.GLOBAL_DECAY]), float(p[sc.LOAD_WEIGHT])
        self.long_weight = float(p[sc.LONG_WEIGHT])
        self.prior_weight, self.prior_keep = float(p[sc.PRIOR_WEIGHT]), float(p[sc.PRIOR_KEEP])
        self.long_prior_keep = float(p[sc.LONG_KEEP])
        self.bypass, self.cycle = bool(meta[sc.BYPASS]), bool(meta[sc.CYCLE])
        n = self.num_layers * self.num_experts
        self.slot_for_id = np.full(n, -1, np.int32)
        self.id_of_slot = np.full(self.slots, -1, np.int32)
        self.stamp = np.full(self.slots, -1, np.int64)
        self.pinned = np.zeros(self.slots, bool)
        self.content = np.full(self.slots, -1, np.int64)
        self.last = np.zeros(n, np.int64)
        self.c1, self.c2, self.c3, self.c4 = (np.zeros(n, np.float64) for _ in range(4))
        self.lclock = np.zeros(self.num_layers, np.int64)
        self.glob = st[sc.GLOB].copy()
        self.clock = 0
        self.hits = np.zeros(self.num_layers, np.int64)
        self.misses = np.zeros(self.num_layers, np.int64)
        self.bypassed = np.zeros(self.num_layers, np.int64)

    def consts(self):
        """The kernels' ``ScoredConsts`` (a ``SCORED_CONSTS`` scalar) of this policy."""
        from freetoken.policy.scored import device_consts

        return device_consts(self._st)

    def prefill(self, layer: int, counts, k_eff: float) -> None:
        """The prefill prior of ``layer`` at a segment start (``cache_scored_prefill``, ``scored_prefill``'s rule):
        ``counts[e]`` prefill tokens routed to expert e, ``k_eff`` tokens per step x top-k."""
        total = 0.0
        for e in range(self.num_experts):
            total = total + float(counts[e])
        if not total > 0.0:
            return
        now = int(self.lclock[layer])
        steady, steady2 = 1.0 / self.q, 1.0 / self.q2
        for e in range(self.num_experts):
            f = layer * self.num_experts + e
            a = now - int(self.last[f])
            t = float(self.c1[f]) * float(self.dp[min(a, self.dp.size - 1)])
            t2 = float(self.c4[f]) * float(self.dp2[min(a, self.dp2.size - 1)])
            p = min((float(k_eff) * float(counts[e])) / total, 1.0)
            self.c1[f] = self.prior_keep * t + (self.prior_weight * p) * steady
            self.c4[f] = self.long_prior_keep * t2 + (self.prior_weight * p) * steady2
            self.last[f] = now

    def key(self, o: int, layer: int, pbar: float, itau: float) -> float:
        """The keep key of flat id ``o`` for a call of ``layer`` (after that call's clock advanced)."""
        L = self.num_layers
        lo = o // self.num_experts
        a = int(self.lclock[lo] - self.last[o])
        r = self.q * (float(self.c1[o]) * float(self.dp[min(a, self.dp.size - 1)]))
        if self.long_weight != 0.0:
            t2 = float(self.c4[o]) * float(self.dp2[min(a, self.dp2.size - 1)])
            r = ((1.0 - self.long_weight) * r) + (self.long_weight * (self.q2 * t2))
        w = 1.0 / (r + itau)
        d = (lo - layer - 1 + L) % L + 1 if self.cycle else L
        if a == 0:
            p = (float(self.c2[o]) + self.kappa * pbar) / (float(self.c3[o]) + self.kappa)
            return SCORED_PROTECT - ((((1.0 - p) * L) * w) + d)
        return -((L * (w - 1.0)) + d)

    def admit(self, layer: int, ids: np.ndarray, max_bypass: int | None = None
              ) -> tuple[np.ndarray, list[tuple[int, int]], list[int]]:
        """One call of ``layer`` with routed ids [T, k]: returns (slot ids [T, k], ``CACHE_BYPASSED`` for a bypassed
        miss's pairs; the worklist of (slot, flat id); the bypassed flat ids in order). ``max_bypass``: the most misses
        the call may bypass (None: no limit); later ones are admitted."""
        ids = np.asarray(ids)
        routed = ids != NO_ROUTE
        if ((ids[routed] < 0) | (ids[routed] >= self.num_experts)).any():
            raise ValueError("expert id out of range")
        self.clock += 1
        call = self.clock
        self.lclock[layer] += 1
        now = int(self.lclock[layer])
        flat = layer * self.num_experts + ids.astype(np.int64)
        active = [int(f) for f in np.unique(flat[routed])]
        gd, idd = self.global_decay, self.id_decay
        glob = self.glob
        missing = []
        for f in active:
            g = now - int(self.last[f])
            cont = 0.0
            if self.last[f] > 0:
                cont = 1.0 if g == 1 else 0.0
                glob[SCORED_G_CONT] = gd * float(glob[SCORED_G_CONT]) + cont
                glob[SCORED_G_REUSE] = gd * float(glob[SCORED_G_REUSE]) + 1.0
                self.c2[f] = idd * float(self.c2[f]) + cont
                self.c3[f] = idd * float(self.c3[f]) + 1.0
            inc = self.rho if cont != 0.0 else 1.0
            self.c1[f] = inc + float(self.c1[f]) * float(self.dp[min(g, self.dp.size - 1)])
            self.c4[f] = inc + float(self.c4[f]) * float(self.dp2[min(g, self.dp2.size - 1)])
            self.last[f] = now
            s = self.slot_for_id[f]
            if s >= 0:
                self.stamp[s] = call
            else:
                missing.append(f)
        pbar = float(glob[SCORED_G_CONT]) / float(glob[SCORED_G_REUSE])
        ld = float(glob[SCORED_G_LOADS])
        tau = SCORED_TAU_MAX
        if ld > 0.0:
            tau = float(self.slots) / (float(self.num_layers) * ld)
        tau = min(max(tau, SCORED_TAU_MIN), SCORED_TAU_MAX)
        itau = 1.0 / tau
        work, bypassed = [], []
        for f in missing:
            best = None
            for s in range(self.slots):
                if self.pinned[s] or self.stamp[s] == call:
                    continue
                o = int(self.id_of_slot[s])
                k = -math.inf if o < 0 else self.key(o, layer, pbar, itau)
                if best is None or k < best[0]:
                    best = (k, s)
            if best is None:
                raise RuntimeError("no victim: too few slots")
            k, v = best
            room = max_bypass is None or len(bypassed) < max_bypass
            if self.bypass and room and self.id_of_slot[v] >= 0 and not self.key(f, layer, pbar, itau) > k:
                bypassed.append(f)
                continue
            self._assign(v, f)
            self.stamp[v] = call
            work.append((v, f))
        keep = (1.0 - self.load_weight) * float(glob[SCORED_G_LOADS])
        glob[SCORED_G_LOADS] = keep if not missing else keep + self.load_weight * float(len(work))
        self.hits[layer] += len(active) - len(missing)
        self.misses[layer] += len(missing)
        self.bypassed[layer] += len(bypassed)
        slot = self.slot_for_id[np.where(routed, flat, 0)]
        out = np.where(routed, np.where(slot >= 0, slot, CACHE_BYPASSED), NO_ROUTE).astype(np.int32)
        return out, work, bypassed

    _assign = CacheModel._assign

    def borrow(self, layer: int, first: int) -> list[tuple[int, int]]:
        """Prefill borrows slots [first, first + E) (``cache_borrow_layer`` with the stamps as its recency): the
        owners lose their mapping, the statistics stay."""
        work = []
        for e in range(self.num_experts):
            s = first + e
            old = self.id_of_slot[s]
            if old >= 0:
                self.slot_for_id[old] = -1
            self.id_of_slot[s] = -1
            self.stamp[s] = -1
            self.content[s] = layer * self.num_experts + e
            work.append((s, layer * self.num_experts + e))
        return work

    def pin(self, flat: int, slot: int) -> None:
        """Pin record ``flat`` into ``slot`` exactly as :meth:`CacheModel.pin` (the stamps as its recency: a pinned
        slot is never a victim, an emptied one has key -inf whatever its stamp)."""
        CacheModel.pin(self, flat, slot)

    @property
    def recency(self):
        """The stamps, under :class:`CacheModel`'s name (ExpertCache keeps them in its ``recency`` array)."""
        return self.stamp

    @recency.setter
    def recency(self, value):
        self.stamp = value


def stream_bypassed_reference(ids: np.ndarray, slots: np.ndarray, layer: int, experts: int, bypassed: list[int],
                              scratch: int, work: list[tuple[int, int]], limit: int = -1
                              ) -> tuple[np.ndarray, list[tuple[int, int]]]:
    """``cache_stream_bypassed``: (the pairs' slots with every ``CACHE_BYPASSED`` pair of the first ``limit`` (all
    when < 0) bypassed ids at its id's scratch slot, ``scratch`` + its index in ``bypassed``, and those of the others
    ``NO_ROUTE``; the worklist ``work`` with the streamed ids' items appended)."""
    streamed = list(bypassed) if limit < 0 else list(bypassed)[:limit]
    out = np.array(slots, np.int32, copy=True)
    where = {f: NO_ROUTE for f in bypassed} | {f: scratch + i for i, f in enumerate(streamed)}
    marked = out == CACHE_BYPASSED
    out[marked] = [where[layer * experts + int(e)] for e in np.asarray(ids)[marked]]
    return out, list(work) + [(scratch + i, f) for i, f in enumerate(streamed)]
