"""A pure NumPy model of the expert cache's state machine: the oracle of the device kernels.

It tracks maps, recency, pins, statistics and, per slot, which record's bytes the slot holds (``content``),
with exactly the semantics of ``cuda/cache.cu`` and its Numba twin ``cpu_kernels/cache.py`` (see
:func:`CacheModel.admit`).
"""

from __future__ import annotations

import numpy as np

from freetoken.device.constants import NO_ROUTE


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
