"""The expert cache's LRU state machine in Numba: one implementation for the simulators and the runtime's shadow.

It follows ``cuda/cache.cu`` (and its NumPy oracle :class:`freetoken.testing.reference.cache.CacheModel`) rule for rule:

* one **call** (an admission) advances the clock once; its hits refresh their slots' recency; then its misses, in
  increasing flat-id order, each take the least recent slot that is not pinned and holds no id active in the call
  (ties: the lowest slot; empty slots have recency -1), and the victim's old owner loses its mapping;
* a **borrow** (prefill's double buffers) empties slots ``[first, first + n)``: owners lose their mapping, recency
  becomes -1, so those slots are the next victims (lowest slot first);
* a **pin** (:meth:`freetoken.cache.ExpertCache.pin`) puts a record in the next slot from the end of the pool,
  never evicted; a record that sat elsewhere leaves an empty slot (recency -1) behind.

The state is a tuple of arrays (:func:`lru_new`; field indices ``SLOT_OF`` ...), so it passes into any ``njit``
function and is also usable from Python::

    slot_of  int32 [num_ids]    slot holding flat id f, or -1            (the device's slot_for_id)
    owner    int32 [slots]      flat id held by slot s, or -1            (id_of_slot)
    nxt, prv int32 [slots + 1]  the recency list: unpinned slots ordered by (recency, slot), least recent first,
                                behind the sentinel ``slots``; a call's touched slots leave it until the call ends
    recency  int64 [slots]      the clock of the slot's last call, -1 for empty (borrowed, never used)
    pinned   uint8 [slots]
    touched  int32 [slots]      the current call's slots (``meta[N_TOUCHED]`` of them)
    meta     int64 [3]          [clock, touched count, pinned count]

One call is :func:`lru_admit` (unique flat ids in increasing order), or, when the caller decides between the hits
and the misses (the q* split admits only the fetched misses), :func:`lru_lookup` (the hits), :func:`lru_insert`
(the admitted misses, in increasing id order), :func:`lru_end`. Every operation is O(1) per id (a borrow or a pin
is O(borrowed + empty slots)); :func:`lru_replay_calls` replays a trace's calls. The functions take whole calls,
not single ids: a Numba call that unpacks the state costs about what a dozen ids do.
"""

from __future__ import annotations

import numba as nb
import numpy as np

SLOT_OF, OWNER, NXT, PRV, RECENCY, PINNED, TOUCHED, META = range(8)
CLOCK, N_TOUCHED, N_PINNED = range(3)


@nb.njit(cache=True)
def lru_new(num_ids, slots):  # pragma: no cover - compiled
    """A fresh state: ``slots`` empty slots for flat ids ``0 .. num_ids - 1``."""
    nxt = np.empty(slots + 1, np.int32)
    prv = np.empty(slots + 1, np.int32)
    for s in range(slots + 1):
        nxt[s] = s + 1 if s < slots else 0
        prv[s] = s - 1 if s > 0 else slots
    return (np.full(num_ids, -1, np.int32), np.full(slots, -1, np.int32), nxt, prv, np.full(slots, -1, np.int64),
            np.zeros(slots, np.uint8), np.empty(max(slots, 1), np.int32), np.zeros(3, np.int64))


@nb.njit(cache=True, inline="always")
def unmap_slot(slot_of, owner, s):  # pragma: no cover - compiled
    """Slot ``s`` lets go of its owner, whose mapping goes; returns that owner (-1: the slot was empty). With
    :func:`map_slot`, the one place the two maps (``slot_of``, ``owner``) change, for every policy of the core."""
    o = owner[s]
    if o >= 0:
        slot_of[o] = -1
        owner[s] = -1
    return o


@nb.njit(cache=True, inline="always")
def map_slot(slot_of, owner, s, f):  # pragma: no cover - compiled
    """Flat id ``f`` takes slot ``s`` (the slot's previous owner loses its mapping); returns that owner (-1: none)."""
    o = owner[s]
    if o >= 0:
        slot_of[o] = -1
    owner[s] = f
    slot_of[f] = s
    return o


@nb.njit(cache=True)
def _unlink(nxt, prv, s):  # pragma: no cover - compiled
    nxt[prv[s]] = nxt[s]
    prv[nxt[s]] = prv[s]


@nb.njit(cache=True)
def _insert_after(nxt, prv, p, s):  # pragma: no cover - compiled
    n = nxt[p]
    nxt[p] = s
    prv[s] = p
    nxt[s] = n
    prv[n] = s


@nb.njit(cache=True)
def _sort_slots(a, n):  # pragma: no cover - compiled
    """Insertion sort of ``a[:n]`` (one call's handful of slots)."""
    for i in range(1, n):
        v = a[i]
        j = i - 1
        while j >= 0 and a[j] > v:
            a[j + 1] = a[j]
            j -= 1
        a[j + 1] = v


@nb.njit(cache=True)
def sort_ids(a, n):  # pragma: no cover - compiled
    """Sort ``a[:n]`` in place, ascending (a call's ids before :func:`lru_insert`)."""
    _sort_slots(a, n)


@nb.njit(cache=True)
def _lookup(slot_of, nxt, prv, rec, pinned, touched, meta, ids, n, slot_out):  # pragma: no cover - compiled
    meta[CLOCK] += 1
    now = meta[CLOCK]
    nt = 0
    hits = 0
    for j in range(n):
        s = slot_of[ids[j]]
        slot_out[j] = s
        if s < 0:
            continue
        hits += 1
        if rec[s] != now and pinned[s] == 0:
            _unlink(nxt, prv, s)
            touched[nt] = s
            nt += 1
        rec[s] = now
    meta[N_TOUCHED] = nt
    return hits


@nb.njit(cache=True)
def _insert(slot_of, owner, nxt, prv, rec, touched, meta, ids, n, protect_previous,
            evicted):  # pragma: no cover - compiled
    head = rec.shape[0]
    now = meta[CLOCK]
    prev = now - 1
    nt = meta[N_TOUCHED]
    for i in range(n):
        s = nxt[head]
        if protect_previous:
            while s != head and rec[s] == prev:
                s = nxt[s]
        if s == head:
            meta[N_TOUCHED] = nt
            return i
        _unlink(nxt, prv, s)
        evicted[i] = map_slot(slot_of, owner, s, ids[i])
        rec[s] = now
        touched[nt] = s
        nt += 1
    meta[N_TOUCHED] = nt
    return n


@nb.njit(cache=True)
def _end(nxt, prv, touched, meta, head):  # pragma: no cover - compiled
    nt = meta[N_TOUCHED]
    _sort_slots(touched, nt)
    for a in range(nt):
        _insert_after(nxt, prv, prv[head], touched[a])
    return nt


@nb.njit(cache=True)
def lru_lookup(st, ids, n, slot_out):  # pragma: no cover - compiled
    """Start a call (the clock advances) with the flat ids ``ids[:n]``: ``slot_out[j]`` is the slot of a hit
    (refreshed: no victim for the rest of the call) or -1 for a miss. Returns the number of hits."""
    slot_of, owner, nxt, prv, rec, pinned, touched, meta = st
    return _lookup(slot_of, nxt, prv, rec, pinned, touched, meta, ids, n, slot_out)


@nb.njit(cache=True)
def lru_insert(st, ids, n, protect_previous, evicted):  # pragma: no cover - compiled
    """Admit the misses ``ids[:n]`` (increasing, none resident) into the call started by :func:`lru_lookup`, each
    into the least recent eligible slot: ``evicted[i]`` is the id the i-th one evicted (-1: the slot was empty).
    Returns how many were admitted (fewer than n when every slot is pinned or active in the call: the rest are
    not). ``protect_previous``: also spare the slots of the call before this one (the simulator's prefetch never
    evicts what the call it overlaps computes from; the device has no such rule)."""
    slot_of, owner, nxt, prv, rec, pinned, touched, meta = st
    return _insert(slot_of, owner, nxt, prv, rec, touched, meta, ids, n, protect_previous, evicted)


@nb.njit(cache=True)
def lru_end(st):  # pragma: no cover - compiled
    """End the call: its slots become the most recent, ordered by slot index (they share the call's recency).
    Returns how many slots the call touched."""
    slot_of, owner, nxt, prv, rec, pinned, touched, meta = st
    return _end(nxt, prv, touched, meta, rec.shape[0])


@nb.njit(cache=True)
def _admit(slot_of, owner, nxt, prv, rec, pinned, touched, meta, ids, n, scratch, evicted):  # pragma: no cover
    """:func:`lru_admit` on the unpacked state (the replay loop unpacks it once: Numba types a tuple of arrays far
    slower than the arrays)."""
    _lookup(slot_of, nxt, prv, rec, pinned, touched, meta, ids, n, scratch)
    m = 0
    for j in range(n):
        if scratch[j] < 0:
            scratch[m] = ids[j]
            m += 1
    if _insert(slot_of, owner, nxt, prv, rec, touched, meta, scratch, m, False, evicted) < m:
        raise ValueError("no victim: too few slots for one call")
    _end(nxt, prv, touched, meta, rec.shape[0])
    return m


@nb.njit(cache=True)
def lru_admit(st, ids, n, scratch, evicted):  # pragma: no cover - compiled
    """One whole call: the unique flat ids ``ids[:n]`` in increasing order; ``scratch``: n ints of room. Returns
    the number of misses; ``evicted[i]`` is the id the i-th miss evicted (-1: an empty slot). Raises when the
    slots cannot hold the call (the device reports error 2)."""
    slot_of, owner, nxt, prv, rec, pinned, touched, meta = st
    return _admit(slot_of, owner, nxt, prv, rec, pinned, touched, meta, ids, n, scratch, evicted)


@nb.njit(cache=True)
def lru_replay_calls(st, active, counts, seg_start, borrow_n, misses):  # pragma: no cover - compiled
    """Replay whole calls: ``active`` int32 [steps, L, A] each call's unique flat ids ascending (``counts[t, l]`` of
    them), a borrow of slots [0, borrow_n) before every step where ``seg_start``; ``misses[t]`` += step t's misses.
    Equivalent to :func:`lru_borrow` and :func:`lru_admit` per call, with the state unpacked once."""
    slot_of, owner, nxt, prv, rec, pinned, touched, meta = st
    steps, layers, width = active.shape
    scratch = np.empty(max(width, 1), np.int32)
    evicted = np.empty(max(width, borrow_n, 1), np.int32)
    for t in range(steps):
        if seg_start[t]:
            lru_borrow(st, 0, borrow_n, evicted)
        m_t = 0
        for layer in range(layers):
            m_t += _admit(slot_of, owner, nxt, prv, rec, pinned, touched, meta, active[t, layer], counts[t, layer],
                          scratch, evicted)
        misses[t] += m_t


@nb.njit(cache=True)
def _make_empty(st, s, p):  # pragma: no cover - compiled
    """Slot ``s`` (out of the list) becomes empty with recency -1: placed among the empty slots at the front of the
    list by slot index, searching from list position ``p`` (which must precede every empty slot above s). Returns
    s (the next search start)."""
    nxt, prv, rec = st[NXT], st[PRV], st[RECENCY]
    head = rec.shape[0]
    while True:
        q = nxt[p]
        if q == head or rec[q] != -1 or q > s:
            break
        p = q
    rec[s] = -1
    _insert_after(nxt, prv, p, s)
    return s


@nb.njit(cache=True)
def lru_borrow(st, first, n, evicted):  # pragma: no cover - compiled
    """Prefill borrows slots ``[first, first + n)``: their owners lose their mapping (written to ``evicted``, the
    count returned) and the slots become the least recent (recency -1, lowest slot first)."""
    slot_of, owner, rec = st[SLOT_OF], st[OWNER], st[RECENCY]
    head = rec.shape[0]
    k = 0
    p = head
    for s in range(first, first + n):
        o = unmap_slot(slot_of, owner, s)
        if o >= 0:
            evicted[k] = o
            k += 1
        if st[PINNED][s] == 0:
            _unlink(st[NXT], st[PRV], s)
            p = _make_empty(st, s, p)
        else:  # a pinned slot lent to prefill (the cache never does this) stays out of the victim list
            rec[s] = -1
    return k


@nb.njit(cache=True)
def lru_pin(st, f):  # pragma: no cover - compiled
    """Pin flat id ``f`` into the next slot from the end (as ``ExpertCache.pin``): returns the id that slot held
    before (-1: none), or -2 when ``f`` is pinned already (nothing changes). The caller checks capacity."""
    slot_of, owner, rec, pinned, meta = st[SLOT_OF], st[OWNER], st[RECENCY], st[PINNED], st[META]
    nxt, prv = st[NXT], st[PRV]
    cur = slot_of[f]
    if cur >= 0 and pinned[cur] != 0:
        return -2
    slots = rec.shape[0]
    slot = slots - 1 - meta[N_PINNED]
    if cur >= 0 and cur != slot:  # f leaves an empty slot behind
        unmap_slot(slot_of, owner, cur)
        _unlink(nxt, prv, cur)
        _make_empty(st, cur, slots)
    old = map_slot(slot_of, owner, slot, f)
    if pinned[slot] == 0:
        _unlink(nxt, prv, slot)
    pinned[slot] = 1
    rec[slot] = meta[CLOCK]
    meta[N_PINNED] += 1
    return old if old != f else -1


def lru_order(st) -> np.ndarray:
    """The unpinned slots from least to most recent (the victim order; for tests and debugging)."""
    nxt, head = st[NXT], st[RECENCY].shape[0]
    out = []
    s = int(nxt[head])
    while s != head:
        out.append(s)
        s = int(nxt[s])
    return np.asarray(out, np.int64)
