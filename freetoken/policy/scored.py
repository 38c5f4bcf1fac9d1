"""The slot table and admission shared by the scored expert-cache policies (:mod:`~freetoken.policy.lfu_decay`,
:mod:`~freetoken.policy.next_use`): every slot has a **keep key** computed at the current clock from fixed-size
per-id, per-slot and small global arrays, and a miss takes the eligible slot with the smallest key.

One **call** (an admission, :func:`scored_admit`) is one MoE layer's unique active flat ids (``f = layer * E +
expert``), in increasing order, in one decode step. It does, in this order:

1. the call clock advances (``meta[CLOCK]``; it marks the slots the call touches) and so does the **layer clock**
   of the call's layer (``lclock[layer]``: how many calls that layer has had; one per decode step, so ages are in
   steps of the id's own layer): ``now = lclock[layer]``;
2. every active id's statistics are updated, in increasing id order (the policy's rule; ``last[f]`` is the layer
   clock of f's previous access, 0: never), then ``last[f] = now``;
3. hits (resident active ids) get ``stamp[slot] = clock``: a slot stamped with the current clock is not a victim for
   the rest of the call, nor is a pinned slot;
4. the misses, in increasing id order, each take the **victim**: the eligible slot with the smallest
   ``(key, slot)`` (ties: the lowest slot). An empty slot's key is ``-inf`` (empty slots go first, lowest first);
   an owned slot's key is the policy's keep key of its owner (:func:`keep_key`) at the current clocks, for a call
   of this layer. With **bypass**, a miss whose own key (computed the same way: its age is 0 and its layer is the
   call's) is not strictly greater than the victim's (it is not expected back sooner) is **bypassed**: it stays a
   miss (served from the CPU or streamed) but loads nothing and evicts nothing, and the victim stays the victim for
   the next miss. An empty victim always admits. Otherwise the victim's owner loses its mapping, the miss takes the
   slot and the slot is stamped;
5. next_use only: the loads (admitted misses) of the call update a global average (``glob[LOADS]``).

next_use's optional **transition predictor** (``params[TRANS_WEIGHT] != 0``; :mod:`~freetoken.policy.next_use`
spells out its rules) updates its tables in step 2 (before the statistics: the rows of the ids of the layer's
previous call; after them: the prediction of the layer's next call) and enters the keys of step 4.

Keys of eligible slots do not change within a call (only active ids' statistics change, and active ids are not
eligible; the global values a key reads are fixed for the call), so a call's victims are its smallest keys in
order: :func:`scored_admit` finds them with one scan of the slots (one argmin per miss, as ``cache_admit`` does for
LRU, gives the same slots).

The state is a tuple of arrays (:func:`scored_new`; field indices ``SLOT_OF`` ...) that passes into ``njit``
functions::

    slot_of     int32   [N]   slot holding flat id f, or -1                (the device's slot_for_id)
    owner       int32   [S]   flat id held by slot s, or -1                (id_of_slot)
    stamp       int64   [S]   the call clock of the slot's last hit or admission; -1 never
    pinned      uint8   [S]
    last        int64   [N]   layer clock of the id's last access (0: never)
    c1, c2, c3  float64 [N]   per-id decayed statistics (the policy's)
    dp          float64 [K]   the decay table (:func:`decay_table`), uploaded as data
    lclock      int64   [L]   per-layer call counts
    glob        float64 [3]   next_use's global estimates [continuations, re-accesses, loads per call]
    params      float64 [13]  [rate scale, rho, kappa, id decay, global decay, load weight, prior weight, prior keep,
                               long weight, long prior keep, trans weight, trans decay, trans prior]
    meta        int64   [7]   [call clock, kind, E, L, bypass, cycle, pinned count]
    c4          float64 [N]   next_use's long-memory return count (the decay table dp2)
    dp2         float64 [K2]  the long memory's decay table
    tn          float64 [N*E] the transition predictor's counts, row f (``tn[f * E + e]``); size 0 when it is off
    tr          float64 [N]   its row totals (size 0 when off)
    pt          float64 [N]   its prediction of each id's use at its layer's next call (size 0 when off)

Every operation is O(1) per active id plus one O(slots) scan per call that has misses; a borrow is O(borrowed), a
prefill prior O(E). :func:`scored_replay_calls` replays a trace's calls with the state unpacked once.
"""

from __future__ import annotations

import math

import numba as nb
import numpy as np

from freetoken.device.constants import (
    CACHE_BYPASSED,
    SCORED_CONSTS,
    SCORED_G_CONT,
    SCORED_G_LOADS,
    SCORED_G_REUSE,
    SCORED_PROTECT,
    SCORED_TAU_MAX,
    SCORED_TAU_MIN,
)
from freetoken.policy.lru import map_slot, unmap_slot

SLOT_OF, OWNER, STAMP, PINNED, LAST, C1, C2, C3, DP, LCLOCK, GLOB, PARAMS, META, C4, DP2, TN, TR, PT = range(18)
CLOCK, KIND, NUM_EXPERTS, NUM_LAYERS, BYPASS, CYCLE, N_PINNED = range(7)
G_CONT, G_REUSE, G_LOADS = SCORED_G_CONT, SCORED_G_REUSE, SCORED_G_LOADS
(RATE, RHO, KAPPA, ID_DECAY, GLOBAL_DECAY, LOAD_WEIGHT, PRIOR_WEIGHT, PRIOR_KEEP, LONG_WEIGHT, LONG_KEEP, TRANS_WEIGHT,
 TRANS_DECAY, TRANS_PRIOR) = range(13)
KIND_LFU_DECAY, KIND_NEXT_USE = 0, 1
#: decay tables run out after this many half-lives (2 ** -64 of a count is nothing)
TABLE_HALF_LIVES = 64
#: next_use's horizon bounds, steps
TAU_MIN, TAU_MAX = SCORED_TAU_MIN, SCORED_TAU_MAX
#: next_use's starting values: the continuation probability (one pseudo-observation) and the horizon (steps)
P_START, TAU_START = 0.5, 8.0
#: next_use's key offset of an id used at its layer's latest call (age 0): above every older id's key (|wait| <
#: L * TAU_MAX + L < 2 ** 40 for L < 10 ** 5), so such ids are victims only when no older one is eligible
PROTECT = SCORED_PROTECT
BYPASSED = CACHE_BYPASSED  # evicted[i] of a bypassed miss


def decay_table(half_life: float) -> np.ndarray:
    """``dp[k] = 2 ** (-k / half_life)`` for ``k < ceil(64 * half_life) + 1``, then one 0.0 entry (any longer gap
    decays a count to nothing; an index past the end is clamped to it). float64, computed by NumPy; the device gets
    the same table, not its formula."""
    if not (half_life > 0 and math.isfinite(half_life)):
        raise ValueError(f"half-life must be a positive number of steps, got {half_life!r}")
    n = int(math.ceil(TABLE_HALF_LIVES * half_life)) + 1
    dp = np.empty(n + 1, np.float64)
    dp[:n] = np.exp2(-np.arange(n, dtype=np.float64) / float(half_life))
    dp[n] = 0.0
    return dp


def scored_new(kind: int, num_layers: int, num_experts: int, slots: int, half_life: float, bypass: bool = False,
               cycle: bool = False, rho: float = 1.0, kappa: float = 0.0, id_decay: float = 1.0,
               global_decay: float = 1.0, load_weight: float = 0.0, prior_weight: float = 0.0,
               prior_keep: float = 1.0, long_weight: float = 0.0, long_half_life: float = 64.0,
               long_prior_keep: float = 1.0, trans_weight: float = 0.0, trans_decay: float = 0.9,
               trans_prior: float = 1.0) -> tuple:
    """A fresh state: ``slots`` empty slots for the flat ids of ``num_layers x num_experts``. The policy modules'
    ``*_new`` functions fill in the parameters; see their docstrings."""
    if kind not in (KIND_LFU_DECAY, KIND_NEXT_USE):
        raise ValueError(f"unknown scored policy kind {kind}")
    if min(num_layers, num_experts) < 1 or slots < 0:
        raise ValueError("num_layers and num_experts must be >= 1, slots >= 0")
    n = num_layers * num_experts
    dp = decay_table(half_life)
    if not 0.0 <= long_weight <= 1.0 or not 0.0 <= long_prior_keep <= 1.0:
        raise ValueError("long_weight and long_prior_keep must be in [0, 1]")
    if not 0.0 <= trans_weight <= 1.0 or not 0.0 <= trans_decay <= 1.0 or not trans_prior > 0.0:
        raise ValueError("trans_weight and trans_decay must be in [0, 1], trans_prior > 0")
    if trans_weight != 0.0 and kind != KIND_NEXT_USE:
        raise ValueError("the transition predictor is next_use's")
    dp2 = decay_table(long_half_life)
    params = np.array([1.0 - dp[1], rho, kappa, id_decay, global_decay, load_weight, prior_weight, prior_keep,
                       long_weight, long_prior_keep, trans_weight, trans_decay, trans_prior], np.float64)
    # loads per call such that the horizon starts at TAU_START steps
    glob = np.array([P_START, 1.0, slots / (TAU_START * num_layers)], np.float64)
    meta = np.array([0, kind, num_experts, num_layers, int(bool(bypass)), int(bool(cycle)), 0], np.int64)
    nt = n if trans_weight != 0.0 else 0  # the transition predictor's arrays exist only when it is on
    return (np.full(n, -1, np.int32), np.full(slots, -1, np.int32), np.full(slots, -1, np.int64),
            np.zeros(slots, np.uint8), np.zeros(n, np.int64), np.zeros(n, np.float64), np.zeros(n, np.float64),
            np.zeros(n, np.float64), dp, np.zeros(num_layers, np.int64), glob, params, meta,
            np.zeros(n, np.float64), dp2, np.zeros(nt * num_experts, np.float64), np.zeros(nt, np.float64),
            np.zeros(nt, np.float64))


@nb.njit(cache=True, inline="always")
def _call_globals(glob, params, slots, num_layers):  # pragma: no cover - compiled
    """next_use's values fixed for one call: (the global continuation probability, 1 / horizon)."""
    pbar = glob[G_CONT] / glob[G_REUSE]
    ld = glob[G_LOADS]
    tau = TAU_MAX
    if ld > 0.0:
        tau = slots / (num_layers * ld)
    if tau < TAU_MIN:
        tau = TAU_MIN
    if tau > TAU_MAX:
        tau = TAU_MAX
    return pbar, 1.0 / tau


@nb.njit(cache=True, inline="always")
def _key(kind, o, lo, c, num_layers, last, c1, c2, c3, dp, lclock, params, pbar, itau, cycle, c4,
         dp2, pt):  # pragma: no cover - compiled
    """The keep key of id ``o`` (of layer ``lo``) for a call of layer ``c`` at the current clocks."""
    a = lclock[lo] - last[o]
    t = c1[o] * dp[min(a, dp.shape[0] - 1)]
    if kind == KIND_LFU_DECAY:
        return t
    r = params[RATE] * t
    beta = params[LONG_WEIGHT]
    if beta != 0.0:
        t2 = c4[o] * dp2[min(a, dp2.shape[0] - 1)]
        r = ((1.0 - beta) * r) + (beta * ((1.0 - dp2[1]) * t2))
    w = 1.0 / (r + itau)
    d = num_layers
    if cycle:
        d = (lo - c - 1 + num_layers) % num_layers + 1
    lam = params[TRANS_WEIGHT]
    if a == 0:
        kap = params[KAPPA]
        p = (c2[o] + kap * pbar) / (c3[o] + kap)
        if lam != 0.0:
            p = ((1.0 - lam) * p) + (lam * pt[o])
        x = 1.0 - p
        x = x * num_layers
        x = x * w
        x = x + d
        return PROTECT - x
    if lam != 0.0:
        p = ((1.0 - lam) * (1.0 / w)) + (lam * pt[o])
        x = 1.0 - p
        x = x * num_layers
        x = x * w
        x = x + d
        return -x
    x = w - 1.0
    x = num_layers * x
    x = x + d
    return -x


@nb.njit(cache=True)
def keep_key(st, f, layer):  # pragma: no cover - compiled
    """The keep key of flat id ``f`` as a call of ``layer`` would see it now (that call's layer clock is already
    advanced: an id of that layer is then one step older than now). Victims have the smallest keys."""
    lclock, meta, params = st[LCLOCK], st[META], st[PARAMS]
    e = meta[NUM_EXPERTS]
    pbar, itau = _call_globals(st[GLOB], params, st[OWNER].shape[0], meta[NUM_LAYERS])
    lclock[layer] += 1
    k = _key(meta[KIND], f, f // e, layer, meta[NUM_LAYERS], st[LAST], st[C1], st[C2], st[C3], st[DP], lclock,
             params, pbar, itau, meta[CYCLE] != 0, st[C4], st[DP2], st[PT])
    lclock[layer] -= 1
    return k


@nb.njit(cache=True)
def _trans_update(last, tn, tr, params, e_n, layer, now, ids, n):  # pragma: no cover - compiled
    """The transition predictor's counts at a call of ``layer`` (``now``: its advanced layer clock), before the
    statistics update: every id i of the layer with ``last > 0`` and ``last == now - 1`` (active at the layer's
    previous call, or touched by a prefill prior since) gets ``tr = g * tr + 1`` and, for every expert e of the layer,
    ``tn[i, e] = g * tn[i, e] + (e active now ? 1 : 0)``."""
    g = params[TRANS_DECAY]
    base = layer * e_n
    for i in range(e_n):
        f = base + i
        if last[f] <= 0 or last[f] != now - 1:
            continue
        tr[f] = g * tr[f] + 1.0
        row = f * e_n
        j = 0
        for e in range(e_n):
            while j < n and ids[j] < base + e:
                j += 1
            x = 0.0
            if j < n and ids[j] == base + e:
                x = 1.0
            tn[row + e] = g * tn[row + e] + x


@nb.njit(cache=True)
def _trans_predict(tn, tr, pt, params, e_n, layer, ids, n):  # pragma: no cover - compiled
    """The transition predictor's noisy-or of the active ids' rows: ``pt[e] = 1 - prod_i (1 - tn[i, e] / (tr[i] +
    a))`` over the call's ids i in increasing order, for every expert e of ``layer``."""
    a = params[TRANS_PRIOR]
    base = layer * e_n
    for e in range(e_n):
        pt[base + e] = 1.0
    for j in range(n):
        f = ids[j]
        den = tr[f] + a
        row = f * e_n
        for e in range(e_n):
            pt[base + e] = pt[base + e] * (1.0 - (tn[row + e] / den))
    for e in range(e_n):
        pt[base + e] = 1.0 - pt[base + e]


@nb.njit(cache=True)
def _admit(slot_of, owner, stamp, pinned, last, c1, c2, c3, dp, lclock, glob, params, meta, c4, dp2, tn, tr, pt, layer,
           ids, n, evicted, vslot, vkey):  # pragma: no cover - compiled
    """:func:`scored_admit` on the unpacked state; ``vslot``/``vkey``: room for n victims."""
    kind = meta[KIND]
    num_layers = meta[NUM_LAYERS]
    cycle = meta[CYCLE] != 0
    meta[CLOCK] += 1
    call = meta[CLOCK]
    lclock[layer] += 1
    now = lclock[layer]
    kmax = dp.shape[0] - 1
    kmax2 = dp2.shape[0] - 1
    rho = params[RHO]
    idd = params[ID_DECAY]
    gd = params[GLOBAL_DECAY]
    trans = kind == KIND_NEXT_USE and params[TRANS_WEIGHT] != 0.0
    if trans:
        _trans_update(last, tn, tr, params, meta[NUM_EXPERTS], layer, now, ids, n)
    hits = 0
    for j in range(n):
        f = ids[j]
        g = now - last[f]
        if kind == KIND_LFU_DECAY:
            c1[f] = 1.0 + c1[f] * dp[min(g, kmax)]
        else:
            cont = 0.0
            if last[f] > 0:
                if g == 1:
                    cont = 1.0
                glob[G_CONT] = gd * glob[G_CONT] + cont
                glob[G_REUSE] = gd * glob[G_REUSE] + 1.0
                c2[f] = idd * c2[f] + cont
                c3[f] = idd * c3[f] + 1.0
            inc = 1.0
            if cont != 0.0:
                inc = rho
            c1[f] = inc + c1[f] * dp[min(g, kmax)]
            c4[f] = inc + c4[f] * dp2[min(g, kmax2)]
        last[f] = now
        s = slot_of[f]
        if s >= 0:
            stamp[s] = call
            hits += 1
    if trans and n > 0:
        _trans_predict(tn, tr, pt, params, meta[NUM_EXPERTS], layer, ids, n)
    m = n - hits
    if m == 0:
        if kind == KIND_NEXT_USE:
            glob[G_LOADS] = (1.0 - params[LOAD_WEIGHT]) * glob[G_LOADS]
        return 0
    pbar, itau = _call_globals(glob, params, owner.shape[0], num_layers)
    # the m smallest (key, slot) among eligible slots, ascending
    nv = 0
    for s in range(owner.shape[0]):
        if stamp[s] == call or pinned[s] != 0:
            continue
        o = owner[s]
        if o < 0:
            k = -np.inf
        else:
            k = _key(kind, o, o // meta[NUM_EXPERTS], layer, num_layers, last, c1, c2, c3, dp, lclock, params, pbar,
                     itau, cycle, c4, dp2, pt)
        if nv == m:
            if not k < vkey[m - 1]:
                continue
            nv -= 1
        i = nv
        while i > 0 and vkey[i - 1] > k:
            vkey[i] = vkey[i - 1]
            vslot[i] = vslot[i - 1]
            i -= 1
        vkey[i] = k
        vslot[i] = s
        nv += 1
    bypass = meta[BYPASS] != 0
    p = 0
    i = 0
    for j in range(n):
        f = ids[j]
        if slot_of[f] >= 0:
            continue
        if p >= nv:
            raise ValueError("no victim: too few slots for one call")
        s = vslot[p]
        o = owner[s]
        if bypass and o >= 0:
            kin = _key(kind, f, layer, layer, num_layers, last, c1, c2, c3, dp, lclock, params, pbar, itau, cycle,
                       c4, dp2, pt)
            if not kin > vkey[p]:
                evicted[i] = BYPASSED
                i += 1
                continue
        evicted[i] = map_slot(slot_of, owner, s, f)
        stamp[s] = call
        p += 1
        i += 1
    if kind == KIND_NEXT_USE:
        glob[G_LOADS] = (1.0 - params[LOAD_WEIGHT]) * glob[G_LOADS] + params[LOAD_WEIGHT] * p
    return m


@nb.njit(cache=True)
def scored_admit(st, layer, ids, n, evicted):  # pragma: no cover - compiled
    """One whole call of ``layer``: its unique flat ids ``ids[:n]`` in increasing order. Returns the number of
    misses; ``evicted[i]`` (n ints of room) is what the i-th miss did: the id it evicted, -1 (it took an empty
    slot) or -2 (bypassed: not loaded). Raises when a miss finds no eligible slot (the device reports error 2)."""
    slot_of, owner, stamp, pinned, last, c1, c2, c3, dp, lclock, glob, params, meta, c4, dp2, tn, tr, pt = st
    vslot = np.empty(max(n, 1), np.int32)
    vkey = np.empty(max(n, 1), np.float64)
    return _admit(slot_of, owner, stamp, pinned, last, c1, c2, c3, dp, lclock, glob, params, meta, c4, dp2, tn, tr, pt,
                  layer, ids, n, evicted, vslot, vkey)


@nb.njit(cache=True)
def scored_borrow(st, first, n, evicted):  # pragma: no cover - compiled
    """Prefill borrows slots ``[first, first + n)``: their owners lose their mapping (written to ``evicted``, the
    count returned) and the slots are empty (key -inf: the next victims, lowest slot first). Statistics stay."""
    slot_of, owner = st[SLOT_OF], st[OWNER]
    k = 0
    for s in range(first, first + n):
        o = unmap_slot(slot_of, owner, s)
        if o >= 0:
            evicted[k] = o
            k += 1
    return k


@nb.njit(cache=True)
def _prefill(last, c1, dp, lclock, params, meta, c4, dp2, layer, counts, k_eff):  # pragma: no cover - compiled
    weight = params[PRIOR_WEIGHT]
    keep = params[PRIOR_KEEP]
    e_n = meta[NUM_EXPERTS]
    total = 0.0
    for e in range(e_n):
        total += counts[e]
    if total <= 0.0:
        return 0
    now = lclock[layer]
    kmax = dp.shape[0] - 1
    kmax2 = dp2.shape[0] - 1
    steady = 1.0 / params[RATE]
    steady2 = 1.0 / (1.0 - dp2[1])
    keep2 = params[LONG_KEEP]
    for e in range(e_n):
        f = layer * e_n + e
        t = c1[f] * dp[min(now - last[f], kmax)]
        t2 = c4[f] * dp2[min(now - last[f], kmax2)]
        p = k_eff * counts[e] / total
        if p > 1.0:
            p = 1.0
        c1[f] = keep * t + weight * p * steady
        c4[f] = keep2 * t2 + weight * p * steady2
        last[f] = now
    return e_n


@nb.njit(cache=True)
def scored_prefill(st, layer, counts, k_eff):  # pragma: no cover - compiled
    """A prefill prior for ``layer`` at a segment start (next_use): ``counts[e]`` prefill tokens routed to expert e
    (``total`` of them). Every id of the layer gets ``c1 = keep * (c1 * dp[age]) + (weight * p) * (1.0 / q)``, ``p =
    min(1, k_eff * counts[e] / total)`` (the expert's share of the prefill routing as a per-step use probability;
    ``k_eff`` = tokens per step x top-k), and ``last = now`` (its count is brought to the current layer clock). A
    layer without prefill tokens is left alone. Returns the ids touched."""
    last, c1, dp, lclock, params, meta = st[LAST], st[C1], st[DP], st[LCLOCK], st[PARAMS], st[META]
    return _prefill(last, c1, dp, lclock, params, meta, st[C4], st[DP2], layer, counts, k_eff)


@nb.njit(cache=True)
def scored_pin(st, f):  # pragma: no cover - compiled
    """Pin flat id ``f`` into the next slot from the end (as ``ExpertCache.pin`` and ``lru_pin``): returns the id
    that slot held before (-1: none), or -2 when ``f`` is pinned already. The caller checks capacity."""
    slot_of, owner, pinned, meta = st[SLOT_OF], st[OWNER], st[PINNED], st[META]
    cur = slot_of[f]
    if cur >= 0 and pinned[cur] != 0:
        return -2
    slot = owner.shape[0] - 1 - meta[N_PINNED]
    if cur >= 0 and cur != slot:
        unmap_slot(slot_of, owner, cur)
    old = map_slot(slot_of, owner, slot, f)
    pinned[slot] = 1
    meta[N_PINNED] += 1
    return old if old != f else -1


@nb.njit(cache=True)
def scored_replay_calls(st, active, counts, seg_start, step_segment, prefill, k_eff, borrow_n, misses,
                        loads):  # pragma: no cover - compiled
    """Replay whole calls: ``active`` int32 [steps, L, A] each call's unique flat ids ascending (``counts[t, l]``
    of them); before every step where ``seg_start``: a borrow of slots [0, borrow_n) and, when the state has a
    prefill prior, :func:`scored_prefill` of every layer with ``prefill[step_segment[t], layer]``.
    ``misses[t]`` += step t's misses, ``loads[t]`` += its admitted ones. Equivalent to :func:`scored_borrow`,
    :func:`scored_prefill` and :func:`scored_admit` per call."""
    slot_of, owner, stamp, pinned, last, c1, c2, c3, dp, lclock, glob, params, meta, c4, dp2, tn, tr, pt = st
    steps, layers, width = active.shape
    evicted = np.empty(max(width, borrow_n, 1), np.int32)
    vslot = np.empty(max(width, 1), np.int32)
    vkey = np.empty(max(width, 1), np.float64)
    prior = params[PRIOR_WEIGHT] != 0.0 or params[PRIOR_KEEP] != 1.0
    for t in range(steps):
        if seg_start[t]:
            scored_borrow(st, 0, borrow_n, evicted)
            if prior:
                for layer in range(layers):
                    _prefill(last, c1, dp, lclock, params, meta, c4, dp2, layer, prefill[step_segment[t], layer],
                             k_eff)
        m_t = 0
        l_t = 0
        for layer in range(layers):
            m = _admit(slot_of, owner, stamp, pinned, last, c1, c2, c3, dp, lclock, glob, params, meta, c4, dp2, tn,
                       tr, pt, layer, active[t, layer], counts[t, layer], evicted, vslot, vkey)
            m_t += m
            for i in range(m):
                if evicted[i] != BYPASSED:
                    l_t += 1
        misses[t] += m_t
        loads[t] += l_t


def victim_order(st, layer: int) -> np.ndarray:
    """The eligible slots (not pinned) in the order a call of ``layer`` that hits nothing would take them
    (smallest ``(key, slot)`` first; empty slots first). For tests and debugging."""
    owner, pinned = st[OWNER], st[PINNED]
    keys = []
    for s in range(owner.shape[0]):
        if pinned[s]:
            continue
        o = int(owner[s])
        keys.append((-math.inf if o < 0 else float(keep_key(st, o, layer)), s))
    return np.asarray([s for _, s in sorted(keys)], np.int64)


def device_consts(st) -> np.void:
    """The ``SCORED_CONSTS`` scalar (``ScoredConsts`` in ``cuda/cache.cu``: the device admission's per-cache
    constants) of a next_use state."""
    p, meta, dp, dp2 = st[PARAMS], st[META], st[DP], st[DP2]
    if int(meta[KIND]) != KIND_NEXT_USE:
        raise ValueError("the device runs the next_use kind of the scored policies only")
    if p[TRANS_WEIGHT] != 0.0:
        raise ValueError("the device admission has no transition predictor (trans_weight must be 0)")
    c = np.zeros((), SCORED_CONSTS)
    c["q"], c["q2"] = p[RATE], 1.0 - dp2[1]
    c["rho"], c["kappa"], c["id_decay"] = p[RHO], p[KAPPA], p[ID_DECAY]
    c["global_decay"], c["load_weight"], c["long_weight"] = p[GLOBAL_DECAY], p[LOAD_WEIGHT], p[LONG_WEIGHT]
    c["prior_weight"], c["prior_keep"], c["long_prior_keep"] = p[PRIOR_WEIGHT], p[PRIOR_KEEP], p[LONG_KEEP]
    c["dp_last"], c["dp2_last"] = dp.size - 1, dp2.size - 1
    c["layers"], c["bypass"], c["cycle"] = meta[NUM_LAYERS], meta[BYPASS], meta[CYCLE]
    return c[()]


def device_policy(st) -> dict:
    """What the device admission (``ExpertCache(policy="default", policy_state=...)``) takes from a fresh next_use
    state: ``consts`` (:func:`device_consts`), the decay tables ``dp``, ``dp2`` and the starting ``glob``; the per-id
    and per-layer arrays start at zero."""
    return {"consts": device_consts(st), "dp": st[DP].copy(), "dp2": st[DP2].copy(), "glob": st[GLOB].copy(),
            "layers": int(st[META][NUM_LAYERS]), "experts": int(st[META][NUM_EXPERTS]),
            "slots": int(st[OWNER].shape[0])}
