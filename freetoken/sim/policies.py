"""Expert-cache policies replayed on a routing trace.

Terms used throughout:

* **admit call**: one (decode step, MoE layer). Its **active set** is the unique flat ids (``layer * E + expert``)
  of all the step's tokens' top-k in that layer.
* **access**: one (admit call, active id). Every policy sees the same accesses; tokens of a batch that share an
  expert count once, as on the device.
* **miss**: an access not served from the GPU cache. **load**: a record copied into the cache;
  ``bytes moved = loads * record_bytes``.
* **window**: the decode steps that are scored, ``"all"`` or ``"second_half"`` (steps ``steps // 2`` onward).
  Policies that learn or warm up may look at the steps before the window; only the window's misses and loads are
  reported. One-time initial placements (static policies, the placement live when the window starts, Belady's
  free initial contents) are reported as loads too; the ``note`` says so.

Each policy is ``policy(trace, slots, window=...) -> PolicyResult``; :data:`POLICIES` maps names to them.
The demand policies (``lru``, ``lfu_decay``, ``next_use`` and their ``+bypass`` variants, ``next_use+bypass+prior``,
and ``default``: the runtime's cache policy on gpu/emu (``--cache-policy next_use``, the default there),
:data:`freetoken.policy.next_use.RECOMMENDED`, next_use with bypass, the prefill prior and the long memory;
``default+trans``: it plus the transition predictor, :data:`freetoken.policy.next_use.RECOMMENDED_TRANS`) replay the
whole trace through the policy core's state machines (:mod:`freetoken.policy`), with prefill borrowing;
:data:`BORROWING` names them.

Belady is the lower bound: with its free (re)fills at the window start and at every segment start, every other
policy here is one of the schedules it minimises over, so its misses are <= theirs on the same window (see
:func:`belady`). LRU and Belady run as Numba kernels (O(1) per access for LRU, O(log S) amortised for Belady).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numba as nb
import numpy as np

from freetoken.policy.lfu_decay import DEFAULT_HALF_LIFE, lfu_decay_new
from freetoken.policy.lru import OWNER, lru_new, lru_replay_calls
from freetoken.policy.next_use import PRIOR_ONLY, RECOMMENDED, RECOMMENDED_TRANS, next_use_new
from freetoken.policy.scored import scored_replay_calls
from freetoken.trace.derived import WINDOWS, check_slots, prepare, window_steps
from freetoken.trace.format import Trace

__all__ = ["BORROWING", "DEFAULT_POLICIES", "POLICIES", "WINDOWS", "PolicyResult", "belady", "belady_sequence",
           "belady_start", "demand_state", "lfu_decay", "lru", "lru_replay", "next_use", "prefill_placement",
           "recommended_policy", "recommended_trans", "routing_blind", "scored_replay", "static_frequency"]


@dataclass
class PolicyResult:
    policy: str
    slots: int
    window: str
    accesses: int
    misses: int
    loads: int
    record_bytes: int
    note: str = ""

    @property
    def miss_rate(self) -> float:
        return self.misses / self.accesses if self.accesses else 0.0

    @property
    def bytes_moved(self) -> int:
        return self.loads * self.record_bytes

    def as_row(self) -> dict:
        return {"policy": self.policy, "slots": self.slots, "window": self.window, "accesses": self.accesses,
                "misses": self.misses, "miss_rate": self.miss_rate, "loads": self.loads,
                "bytes_moved": self.bytes_moved, "note": self.note}


def _top_ids(scores: np.ndarray, slots: int) -> np.ndarray:
    """Boolean mask of the ``slots`` highest scores (ties: lower index first)."""
    mask = np.zeros(scores.shape[0], bool)
    mask[np.argsort(-scores.astype(np.int64), kind="stable")[:slots]] = True
    return mask


def _static_misses(seq: np.ndarray, placed: np.ndarray) -> int:
    return int(seq.size - np.count_nonzero(placed[seq]))


# ------------------------------------------------------------------------------------------------------- LRU


def _demand_setup(trace: Trace, slots: int, who: str, prefill_borrow: bool):
    """(slots, the trace's derived arrays, slots borrowed at each segment start) for a demand policy's replay, which
    must hold one layer's whole active set; ``who`` names the policy in the error."""
    slots = check_slots(slots)
    p = prepare(trace)
    if slots < max(p.max_active, 1):
        raise ValueError(f"{who} needs at least as many slots as the largest active set ({p.max_active} = unique "
                         f"experts of one layer's decode batch), got {slots}")
    return slots, p, (min(2 * trace.num_experts, slots) if prefill_borrow else 0)


def _borrow_note(prefill_borrow: bool) -> str:
    return "prefill borrows 2E slots per segment" if prefill_borrow else "no prefill borrowing"


def lru_replay(trace: Trace, slots: int, prefill_borrow: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """Replay the device LRU over the whole trace; returns (misses per decode step int64 [steps], the final
    ``id_of_slot`` int32 [slots], -1 for empty). See :func:`lru` for the semantics."""
    slots, p, borrow_n = _demand_setup(trace, slots, "lru", prefill_borrow)
    st = lru_new(trace.num_flat, slots)
    misses = np.zeros(trace.steps, np.int64)
    lru_replay_calls(st, p.active, p.counts, p.seg_start, borrow_n, misses)
    return misses, st[OWNER]


def lru(trace: Trace, slots: int, window: str = "second_half", prefill_borrow: bool = True) -> PolicyResult:
    """The device LRU (``cuda/cache.cu`` admission), replayed over the whole trace; the window's misses count.

    One admit call per (decode step, layer), a clock that advances per call; hits refresh recency; misses, in
    increasing flat-id order, take the slot with the smallest recency among slots that hold no id active in the
    call (empty slots: -1; ties: lowest slot), evicting its owner; every miss is a load. Nothing is pinned.
    With ``prefill_borrow``, every segment start empties slots [0, 2 * num_experts) (prefill's double buffers;
    all slots when there are fewer). Before a ``second_half`` window the cache warms up on the first half.
    O(1) per access: slots sit in a list ordered by (recency, slot); a call's touched slots move to the tail.
    """
    t0, t1 = window_steps(trace, window)
    p = prepare(trace)
    per_step, _ = lru_replay(trace, slots, prefill_borrow)
    misses = int(per_step[t0:t1].sum())
    return PolicyResult("lru", int(slots), window, int(p.step_offsets[t1] - p.step_offsets[t0]), misses, misses,
                        trace.record_bytes, _borrow_note(prefill_borrow))


# ------------------------------------------------------------------------------- scored: lfu_decay, next_use


def scored_replay(trace: Trace, slots: int, state, prefill_borrow: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """Replay a scored policy's ``state`` (:mod:`freetoken.policy.scored`, made for this trace's shape and
    ``slots``) over the whole trace; returns (misses, loads) per decode step, int64 [steps] each."""
    slots, p, borrow_n = _demand_setup(trace, slots, "this policy", prefill_borrow)
    misses = np.zeros(trace.steps, np.int64)
    loads = np.zeros(trace.steps, np.int64)
    prefill = np.ascontiguousarray(trace.prefill_counts, np.float64)
    step_segment = np.ascontiguousarray(trace.step_segment, np.int64)
    scored_replay_calls(state, p.active, p.counts, p.seg_start, step_segment, prefill,
                        float(trace.tokens * trace.top_k), borrow_n, misses, loads)
    return misses, loads


def _scored_result(name: str, trace: Trace, slots: int, window: str, prefill_borrow: bool, state,
                   note: str) -> PolicyResult:
    t0, t1 = window_steps(trace, window)
    p = prepare(trace)
    misses, loads = scored_replay(trace, slots, state, prefill_borrow)
    note += "; " + _borrow_note(prefill_borrow)
    return PolicyResult(name, int(slots), window, int(p.step_offsets[t1] - p.step_offsets[t0]),
                        int(misses[t0:t1].sum()), int(loads[t0:t1].sum()), trace.record_bytes, note)


def lfu_decay(trace: Trace, slots: int, window: str = "second_half", prefill_borrow: bool = True,
              half_life: float = DEFAULT_HALF_LIFE, bypass: bool = False) -> PolicyResult:
    """LFU with exponential decay (:mod:`freetoken.policy.lfu_decay`), replayed over the whole trace as
    :func:`lru` is (same calls, same prefill borrowing); the window's misses count, loads are the admitted misses
    (``bypass``: a miss less frequent than its victim is served without loading)."""
    st = lfu_decay_new(trace.num_layers, trace.num_experts, check_slots(slots), half_life, bypass)
    return _scored_result("lfu_decay+bypass" if bypass else "lfu_decay", trace, slots, window, prefill_borrow, st,
                          f"half-life {half_life:g} steps")


def next_use(trace: Trace, slots: int, window: str = "second_half", prefill_borrow: bool = True,
             bypass: bool = False, name: str | None = None, **params) -> PolicyResult:
    """Expected time to next use (:mod:`freetoken.policy.next_use`; ``params``: :func:`next_use_new`'s), replayed
    over the whole trace as :func:`lru` is; loads are the admitted misses (``bypass``: a miss expected back later
    than its victim is served without loading). With a prefill prior, each segment's prefill counts seed it."""
    st = next_use_new(trace.num_layers, trace.num_experts, check_slots(slots), bypass=bypass, **params)
    name = name or ("next_use+bypass" if bypass else "next_use")
    prior = params.get("prior_weight", 0.0) != 0.0 or params.get("prior_keep", 1.0) != 1.0
    return _scored_result(name, trace, slots, window, prefill_borrow, st, "prefill prior" if prior else "online")


def next_use_bypass(trace: Trace, slots: int, window: str = "second_half", prefill_borrow: bool = True,
                    **params) -> PolicyResult:
    """:func:`next_use` with bypass."""
    return next_use(trace, slots, window, prefill_borrow, bypass=True, **params)


def lfu_decay_bypass(trace: Trace, slots: int, window: str = "second_half", prefill_borrow: bool = True,
                     half_life: float = DEFAULT_HALF_LIFE) -> PolicyResult:
    """:func:`lfu_decay` with bypass."""
    return lfu_decay(trace, slots, window, prefill_borrow, half_life, bypass=True)


def next_use_prior(trace: Trace, slots: int, window: str = "second_half",
                   prefill_borrow: bool = True) -> PolicyResult:
    """:func:`next_use` with bypass and the prefill prior (:data:`freetoken.policy.next_use.PRIOR_ONLY`, the
    previous recommendation: no long memory)."""
    r = next_use(trace, slots, window, prefill_borrow, name="next_use+bypass+prior", **PRIOR_ONLY)
    r.note = "next_use+bypass+prior; " + r.note
    return r


def recommended_policy(trace: Trace, slots: int, window: str = "second_half",
                       prefill_borrow: bool = True) -> PolicyResult:
    """The runtime's cache policy on gpu/emu (``cache_admit_scored``), row ``default``:
    :func:`next_use` with :data:`freetoken.policy.next_use.RECOMMENDED` (bypass, the prefill prior, the long
    memory)."""
    r = next_use(trace, slots, window, prefill_borrow, name="default", **RECOMMENDED)
    r.note = "next_use+bypass+prior+long; " + r.note
    return r


def recommended_trans(trace: Trace, slots: int, window: str = "second_half",
                      prefill_borrow: bool = True) -> PolicyResult:
    """Row ``default+trans``: :func:`recommended_policy` plus next_use's transition predictor
    (:data:`freetoken.policy.next_use.RECOMMENDED_TRANS`; the device admission does not run it yet)."""
    r = next_use(trace, slots, window, prefill_borrow, name="default+trans", **RECOMMENDED_TRANS)
    r.note = "next_use+bypass+prior+long+trans; " + r.note
    return r


# ------------------------------------------------------------------------------------------------ static ones


def static_frequency(trace: Trace, slots: int, window: str = "second_half") -> PolicyResult:
    """Place the ``slots`` flat ids most accessed in the first half of the decode steps (ties: lower id) and
    score the second half (always, whatever ``window`` says). Loads: the one-time placement."""
    slots = check_slots(slots)
    p = prepare(trace)
    h = trace.steps // 2
    train = p.seq[: p.step_offsets[h]]
    test = p.seq[p.step_offsets[h]:]
    placed = _top_ids(np.bincount(train, minlength=trace.num_flat), slots)
    return PolicyResult("static_frequency", slots, "second_half", int(test.size), _static_misses(test, placed),
                        int(placed.sum()), trace.record_bytes, "one-time placement; trained on first half")


def routing_blind(trace: Trace, slots: int, window: str = "second_half") -> PolicyResult:
    """``slots // num_layers`` slots per layer holding experts 0 .. slots//L - 1 of every layer. Loads: once."""
    slots = check_slots(slots)
    p = prepare(trace)
    t0, t1 = window_steps(trace, window)
    per = min(slots // trace.num_layers, trace.num_experts)
    placed = np.zeros((trace.num_layers, trace.num_experts), bool)
    placed[:, :per] = True
    seq = p.seq[p.step_offsets[t0]: p.step_offsets[t1]]
    return PolicyResult("routing_blind", slots, window, int(seq.size), _static_misses(seq, placed.ravel()),
                        per * trace.num_layers, trace.record_bytes, "one-time placement")


def prefill_placement(trace: Trace, slots: int, window: str = "second_half") -> PolicyResult:
    """At each segment start, place the ``slots`` flat ids with the highest prefill counts of that segment (ties:
    lower id); misses over the segment's decode steps. Loads: the placement live at the window start, then the
    records newly placed at each segment change (segments without decode steps in the window are skipped)."""
    slots = check_slots(slots)
    p = prepare(trace)
    t0, t1 = window_steps(trace, window)
    seg = trace.step_segment
    misses = loads = 0
    prev = None
    t = t0
    while t < t1:
        s = int(seg[t])
        e = int(np.searchsorted(seg, s, side="right"))
        e = min(e, t1)
        placed = _top_ids(trace.prefill_counts[s].reshape(-1), slots)
        loads += int(placed.sum()) if prev is None else int(np.count_nonzero(placed & ~prev))
        misses += _static_misses(p.seq[p.step_offsets[t]: p.step_offsets[e]], placed)
        prev = placed
        t = e
    return PolicyResult("prefill_placement", slots, window, int(p.step_offsets[t1] - p.step_offsets[t0]), misses,
                        loads, trace.record_bytes, "placement at window start + per segment change")


# ---------------------------------------------------------------------------------------------------- Belady


@nb.njit(cache=True, inline="always")
def _sift_up(hk, hv, i):  # pragma: no cover - compiled
    k = hk[i]
    v = hv[i]
    while i > 0:
        par = (i - 1) >> 1
        if hk[par] >= k:
            break
        hk[i] = hk[par]
        hv[i] = hv[par]
        i = par
    hk[i] = k
    hv[i] = v


@nb.njit(cache=True, inline="always")
def _sift_down(hk, hv, i, size):  # pragma: no cover - compiled
    k = hk[i]
    v = hv[i]
    while True:
        c = 2 * i + 1
        if c >= size:
            break
        if c + 1 < size and hk[c + 1] > hk[c]:
            c += 1
        if hk[c] <= k:
            break
        hk[i] = hk[c]
        hv[i] = hv[c]
        i = c
    hk[i] = k
    hv[i] = v


@nb.njit(cache=True)
def _heap_rebuild(hk, hv, cached, count, key):  # pragma: no cover - compiled
    """Heapify the resident ids ``cached[:count]`` by their next use ``key``; returns the heap size."""
    for j in range(count):
        hk[j] = key[cached[j]]
        hv[j] = cached[j]
    for j in range(count // 2 - 1, -1, -1):
        _sift_down(hk, hv, j, count)
    return count


@nb.njit(cache=True)
def _heap_push(hk, hv, size, k, v, cached, count, key):  # pragma: no cover - compiled
    """Push (k, v); when the heap is full, rebuild it from the resident ids instead (drops stale entries; v must
    already be resident with key k). Returns the new size."""
    if size < hk.shape[0]:
        hk[size] = k
        hv[size] = v
        _sift_up(hk, hv, size)
        return size + 1
    return _heap_rebuild(hk, hv, cached, count, key)


@nb.njit(cache=True)
def _belady_kernel(seq, block_starts, slots, num_flat):  # pragma: no cover - compiled
    n = seq.shape[0]
    inf = np.int64(n) + 1
    nblocks = block_starts.shape[0]
    # next use of every access inside its block (inf when none: the next block starts from a free refill)
    nuse = np.empty(n, np.int64)
    last = np.full(num_flat, -1, np.int64)
    for b in range(nblocks - 1, -1, -1):
        b0 = block_starts[b]
        b1 = block_starts[b + 1] if b + 1 < nblocks else n
        for i in range(b1 - 1, b0 - 1, -1):
            f = seq[i]
            j = last[f]
            nuse[i] = j if (j >= 0 and j < b1) else inf
            last[f] = i
    resident = np.zeros(num_flat, np.bool_)
    was = np.zeros(num_flat, np.bool_)
    key = np.zeros(num_flat, np.int64)
    pos = np.full(num_flat, -1, np.int64)
    cached = np.empty(max(slots, 1), np.int32)
    prev = np.empty(max(slots, 1), np.int32)
    cap = 4 * slots + 16
    hk = np.empty(cap, np.int64)
    hv = np.empty(cap, np.int32)
    count = 0
    misses = 0
    loads = 0  # inserted misses
    placed = 0  # records placed by the free refills that were not already resident
    for b in range(nblocks):
        b0 = block_starts[b]
        b1 = block_starts[b + 1] if b + 1 < nblocks else n
        # free refill: the (up to) `slots` ids whose first use in the block comes first
        nprev = count
        for j in range(count):
            prev[j] = cached[j]
            was[cached[j]] = True
            resident[cached[j]] = False
            pos[cached[j]] = -1
        count = 0
        i = b0
        while i < b1 and count < slots:
            f = seq[i]
            if not resident[f]:
                resident[f] = True
                key[f] = i
                pos[f] = count
                cached[count] = f
                count += 1
                if not was[f]:
                    placed += 1
            i += 1
        for j in range(nprev):
            was[prev[j]] = False
        size = _heap_rebuild(hk, hv, cached, count, key)
        for i in range(b0, b1):
            f = seq[i]
            kn = nuse[i]
            if resident[f]:
                key[f] = kn
                size = _heap_push(hk, hv, size, kn, f, cached, count, key)
                continue
            misses += 1
            if kn >= inf or slots == 0:
                continue  # never used again in this block: bypass
            if count < slots:
                resident[f] = True
                key[f] = kn
                pos[f] = count
                cached[count] = f
                count += 1
                loads += 1
                size = _heap_push(hk, hv, size, kn, f, cached, count, key)
                continue
            while True:  # drop stale tops (evicted ids, or keys since refreshed)
                y = hv[0]
                if resident[y] and key[y] == hk[0]:
                    break
                size -= 1
                hk[0] = hk[size]
                hv[0] = hv[size]
                _sift_down(hk, hv, 0, size)
            if hk[0] <= kn:
                continue  # the incoming id is needed last: bypass
            y = hv[0]
            resident[y] = False
            pj = pos[y]
            pos[y] = -1
            cached[pj] = f
            pos[f] = pj
            resident[f] = True
            key[f] = kn
            loads += 1
            hk[0] = kn
            hv[0] = f
            _sift_down(hk, hv, 0, size)
    return misses, loads, placed


def belady_sequence(seq: np.ndarray, slots: int, block_starts=None,
                    num_ids: int | None = None) -> tuple[int, int, int]:
    """Belady with bypass on an access sequence; returns (misses, inserted loads, refill placements).

    The cache holds up to ``slots`` ids and may be refilled with any ids for free at the start of every block
    (``block_starts``, default ``[0]``: just the start). Within a block, a miss on an id never used again in the
    block is bypassed; otherwise, when the cache is full, the farthest-next-use id among the cache contents and
    the incoming id is evicted (or the incoming id bypassed). The free refill takes the ids whose first use in
    the block comes first, which is what Belady itself would keep after a free prefix touching every id, so the
    misses are the minimum over every initial content and every demand schedule with bypass. Inserted loads:
    misses that entered the cache; placements: refilled ids that were not resident already. O(n log S)
    amortised: next uses by one backward scan, a max-heap of next uses with lazy deletion, rebuilt in O(S)
    when it reaches 4S + 16 entries; O(n + S + num_ids) memory.
    """
    slots = check_slots(slots)
    seq = np.ascontiguousarray(seq, dtype=np.int32)
    if num_ids is None:
        num_ids = int(seq.max()) + 1 if seq.size else 1
    if seq.size and (int(seq.min()) < 0 or int(seq.max()) >= num_ids):
        raise ValueError("belady_sequence: ids must be in [0, num_ids)")
    starts = np.zeros(1, np.int64) if block_starts is None else np.asarray(block_starts, np.int64)
    if starts.size == 0 or starts[0] != 0 or (np.diff(starts) < 0).any() or starts[-1] > max(seq.size, 0):
        raise ValueError("belady_sequence: block_starts must start at 0, be non-decreasing and within the sequence")
    if seq.size == 0:
        return 0, 0, 0
    m, ld, pl = _belady_kernel(seq, starts, slots, num_ids)
    return int(m), int(ld), int(pl)


def belady(trace: Trace, slots: int, window: str = "second_half", refill: str = "segment") -> PolicyResult:
    """Belady's optimal replacement with bypass over the window alone (see :func:`belady_sequence`).

    The access sequence: steps in order, layers in order, each call's unique active ids ascending. The cache
    contents are free at the window start and, with ``refill="segment"`` (default), at every segment start in
    the window: prefill then streams the whole model, and :func:`prefill_placement` re-places for free there, so
    the bound must allow it too. Then the misses are a lower bound for every policy in this module on the same
    window (the static ones, LRU warmed up before the window, prefill placement). ``refill="start"``
    (policy ``belady_start``) only refills at the window start: a lower bound for every demand policy
    (everything here but prefill_placement). Belady ignores that one call's active ids must be resident together;
    that only makes the bound lower.
    """
    if refill not in ("segment", "start"):
        raise ValueError(f"refill must be 'segment' or 'start', got {refill!r}")
    slots = check_slots(slots)
    p = prepare(trace)
    t0, t1 = window_steps(trace, window)
    base = p.step_offsets[t0]
    seq = p.seq[base: p.step_offsets[t1]]
    starts = [0]
    if refill == "segment":
        ts = np.nonzero(p.seg_start[t0 + 1: t1])[0] + t0 + 1
        starts += (p.step_offsets[ts] - base).tolist()
    misses, inserted, placed = belady_sequence(seq, slots, np.unique(np.asarray(starts, np.int64)), trace.num_flat)
    name = "belady" if refill == "segment" else "belady_start"
    where = "window + segment starts" if refill == "segment" else "window start"
    note = f"free refill at {where}; loads: {inserted:,} inserted + {placed:,} placed"
    return PolicyResult(name, slots, window, int(seq.size), misses, inserted + placed, trace.record_bytes, note)


def belady_start(trace: Trace, slots: int, window: str = "second_half") -> PolicyResult:
    """:func:`belady` with ``refill="start"``."""
    return belady(trace, slots, window, refill="start")


POLICIES: dict[str, Callable[..., PolicyResult]] = {
    "lru": lru,
    "lfu_decay": lfu_decay,
    "lfu_decay+bypass": lfu_decay_bypass,
    "next_use": next_use,
    "next_use+bypass": next_use_bypass,
    "next_use+bypass+prior": next_use_prior,
    "default": recommended_policy,
    "default+trans": recommended_trans,
    "static_frequency": static_frequency,
    "prefill_placement": prefill_placement,
    "routing_blind": routing_blind,
    "belady": belady,
    "belady_start": belady_start,
}
DEFAULT_POLICIES = ("lru", "static_frequency", "prefill_placement", "routing_blind", "belady")
#: the policies that take ``prefill_borrow`` (demand policies replayed with the device's prefill borrowing)
BORROWING = ("lru", "lfu_decay", "lfu_decay+bypass", "next_use", "next_use+bypass", "next_use+bypass+prior",
             "default", "default+trans")


def demand_state(name: str, trace: Trace, slots: int):
    """A fresh state of the scored demand policy ``name`` (one of :data:`BORROWING` but ``lru``) for ``trace`` and
    ``slots``, made as its row here makes it (for the time model's per-policy replay,
    :func:`freetoken.sim.timing.time_policies`)."""
    slots = check_slots(slots)
    L, E = trace.num_layers, trace.num_experts
    if name in ("lfu_decay", "lfu_decay+bypass"):
        return lfu_decay_new(L, E, slots, DEFAULT_HALF_LIFE, name.endswith("+bypass"))
    if name in ("next_use", "next_use+bypass"):
        return next_use_new(L, E, slots, bypass=name.endswith("+bypass"))
    if name == "next_use+bypass+prior":
        return next_use_new(L, E, slots, **PRIOR_ONLY)
    if name == "default":
        return next_use_new(L, E, slots, **RECOMMENDED)
    if name == "default+trans":
        return next_use_new(L, E, slots, **RECOMMENDED_TRANS)
    raise ValueError(f"no scored demand policy {name!r} (known: {', '.join(BORROWING[1:])})")
