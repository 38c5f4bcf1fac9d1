"""The scored expert-cache policies of the policy core (freetoken.policy.lfu_decay, .next_use on .scored): hand-worked
victims, bypass, a plain-Python model of the documented rules, online-ness, replay = whole calls, capacity, and
their rows in the simulator and ``freetoken trace simulate``."""

from __future__ import annotations

import math

import numpy as np
import pytest

from freetoken.cli import main as trace_main
from freetoken.policy import scored as SC
from freetoken.policy.lfu_decay import lfu_decay_new
from freetoken.policy.lru import OWNER as LRU_OWNER
from freetoken.policy.lru import lru_admit, lru_borrow, lru_new
from freetoken.policy.next_use import PRIOR_ONLY, RECOMMENDED, next_use_new
from freetoken.policy.scored import (
    BYPASSED,
    OWNER,
    SLOT_OF,
    decay_table,
    scored_admit,
    scored_borrow,
    scored_pin,
    scored_prefill,
    scored_replay_calls,
    victim_order,
)
from freetoken.sim import policies as P
from freetoken.sim import simulate
from freetoken.trace import Trace, make_trace, prepare, save_trace


def _ids(*xs) -> np.ndarray:
    return np.asarray(sorted(xs), np.int32)


def _admit(st, layer, *ids):
    a = _ids(*ids)
    ev = np.empty(max(a.size, 1), np.int32)
    m = scored_admit(st, layer, a, a.size, ev)
    return ev[:m].tolist()


def _check_tables(st, slots):
    owner, slot_of = st[OWNER], st[SLOT_OF]
    held = owner[owner >= 0]
    assert held.size <= slots and np.unique(held).size == held.size
    assert all(slot_of[o] == s for s, o in enumerate(owner) if o >= 0)
    assert np.count_nonzero(slot_of >= 0) == held.size


# ---------------------------------------------------------------------------------------------- hand-worked


def test_lfu_decay_hand_example():
    """1 layer x 4 experts, 2 slots, half-life 4: id 0 used three times, id 1 once; then id 2 evicts id 1 (the
    less frequent, though more recent: LRU would evict id 0)."""
    dp = decay_table(4.0)
    st = lfu_decay_new(1, 4, 2, half_life=4.0)
    for _ in range(3):
        _admit(st, 0, 0)
    assert _admit(st, 0, 1) == [-1]  # the empty slot
    c0 = 1.0 + (1.0 + dp[1]) * dp[1]  # id 0's count at its third access (call 3)
    # call 5: id 0 has age 2 (count c0 * dp[2]), id 1 age 1 (dp[1]): id 1 goes
    assert c0 * dp[2] > dp[1]
    assert _admit(st, 0, 2) == [1]
    assert st[OWNER].tolist() == [0, 2]
    # the same with LRU evicts id 0
    lru = lru_new(4, 2)
    ev, sc = np.empty(2, np.int32), np.empty(2, np.int32)
    for x in (0, 0, 0, 1, 2):
        lru_admit(lru, _ids(x), 1, sc, ev)
    assert lru[LRU_OWNER].tolist() == [2, 1]


def test_lfu_decay_bypass_hand_example():
    """1 slot: id 0 used three times; id 1 (count 1) is not more frequent than id 0 now (2.55 * dp[1]): bypassed,
    nothing loads; after id 0 has gone unused long enough, id 1 is admitted."""
    dp = decay_table(4.0)
    st = lfu_decay_new(1, 4, 1, half_life=4.0, bypass=True)
    for _ in range(3):
        _admit(st, 0, 0)
    assert _admit(st, 0, 1) == [BYPASSED]
    assert st[OWNER].tolist() == [0] and st[SLOT_OF][1] == -1
    # id 1's count is now 1 + dp[1] * 1 at each call; id 0 decays: it loses once 2.55 * dp[a] < 1 + dp[1]
    c0 = 1.0 + (1.0 + dp[1]) * dp[1]
    a = 2
    while c0 * dp[a] >= 1.0 + dp[1]:
        assert _admit(st, 0, 1) == [BYPASSED]
        a += 1
    assert _admit(st, 0, 1) == [0]
    assert st[OWNER].tolist() == [1]


def test_next_use_cycle_hand_example():
    """3 layers x 2 experts, 2 slots, same statistics: at layer 2's call, layer 0's id (needed at the very next call)
    stays and layer 1's (needed 2 calls later) goes; LRU evicts layer 0's (the least recent)."""
    st = next_use_new(3, 2, 2)
    assert _admit(st, 0, 0) == [-1] and _admit(st, 1, 2) == [-1]
    assert victim_order(st, 2).tolist() == [1, 0]  # slot 1 (id 2) first
    assert _admit(st, 2, 4) == [2]
    assert st[OWNER].tolist() == [0, 4]
    off = next_use_new(3, 2, 2, cycle=False)  # every id waits L calls: equal keys, the lowest slot goes
    _admit(off, 0, 0)
    _admit(off, 1, 2)
    assert _admit(off, 2, 4) == [0]


def test_next_use_returns_beat_recency_hand_example():
    """1 layer x 8 experts, 3 slots, rho = 0 (a continuation adds nothing to the return count). Id 0 returns every
    other step (t1, t3, t5), id 1 runs t4..t7, id 7 once at t2. At t8 id 2 evicts 7 (one return, oldest); at t9
    id 3 evicts id 1, though id 0 is less recent (LRU evicts id 0): all three are idle (age >= 1) and id 1 has
    the lowest return rate (c1: 1 at t4, then only decayed, ~dp[5] now, against id 0's (1 + (1 + dp[2]) dp[2])
    dp[4] and id 2's dp[1])."""
    dp = decay_table(32.0)
    st = next_use_new(1, 8, 3, half_life=32.0, rho=0.0)
    calls = [[0], [7], [0], [1], [0, 1], [1], [1]]
    for ids in calls:
        _admit(st, 0, *ids)
    assert sorted(st[OWNER].tolist()) == [0, 1, 7]
    assert _admit(st, 0, 2) == [7]
    c0 = (1.0 + (1.0 + dp[2]) * dp[2]) * dp[4]
    c1 = dp[1] * dp[1] * dp[1] * dp[2]
    assert c1 < dp[1] < c0
    assert _admit(st, 0, 3) == [1]
    assert sorted(st[OWNER].tolist()) == [0, 2, 3]
    lru = lru_new(8, 3)
    ev, sc = np.empty(2, np.int32), np.empty(2, np.int32)
    for ids in calls + [[2], [3]]:
        a = _ids(*ids)
        lru_admit(lru, a, a.size, sc, ev)
    assert sorted(lru[LRU_OWNER].tolist()) == [1, 2, 3]


def test_next_use_long_memory_hand_example():
    """1 layer x 8 experts, 2 slots, rho = 0. Id 0 returns at t1, t3, t5 then idles; id 1 comes once, at t6. At t9
    (id 2 misses) both are idle: the short memory alone (half-life 1) rates id 1 higher (it is more recent) and
    evicts id 0, as LRU would; with the long memory (half-life 64, weight 0.8) id 0's three returns outweigh id 1's
    recency and id 1 goes. The rates, as the docstring's rule computes them, decide it."""
    calls = [[0], [], [0], [], [0], [1], [], []]
    short = next_use_new(1, 8, 2, half_life=1.0, rho=0.0)
    mixed = next_use_new(1, 8, 2, half_life=1.0, rho=0.0, long_weight=0.8, long_half_life=64.0)
    for st in (short, mixed):
        for ids in calls:
            _admit(st, 0, *ids)
        assert sorted(st[OWNER].tolist()) == [0, 1]
    dp, dp2 = decay_table(1.0), decay_table(64.0)
    q, q2 = 1.0 - dp[1], 1.0 - dp2[1]
    # counts at the last access: id 0 at t5 (t1, t3, t5), id 1 at t6 (once); ages at t9: 4 and 3
    c0, c0l = 1.0 + (1.0 + dp[2]) * dp[2], 1.0 + (1.0 + dp2[2]) * dp2[2]
    r0s, r1s = q * (c0 * dp[4]), q * dp[3]
    r0m = 0.2 * r0s + 0.8 * (q2 * (c0l * dp2[4]))
    r1m = 0.2 * r1s + 0.8 * (q2 * dp2[3])
    assert r0s < r1s and r0m > r1m
    slot0 = int(short[SLOT_OF][0])
    assert _admit(short, 0, 2) == [0] and short[OWNER][slot0] == 2
    assert _admit(mixed, 0, 2) == [1] and sorted(mixed[OWNER].tolist()) == [0, 2]


def test_long_memory_off_is_the_old_policy():
    """long_weight 0 leaves every decision as without the long memory (its counts are kept but never read)."""
    t = make_trace(num_layers=3, num_experts=10, top_k=2, steps=120, segments=3, locality=0.5, seed=5)
    a = P.next_use(t, 12, window="all", bypass=True, prior_weight=1.0, prior_keep=0.5)
    b = P.next_use(t, 12, window="all", bypass=True, prior_weight=1.0, prior_keep=0.5, long_half_life=3.0,
                   long_prior_keep=0.0)
    c = P.next_use(t, 12, window="all", bypass=True, prior_weight=1.0, prior_keep=0.5, long_weight=0.5)
    assert (a.misses, a.loads) == (b.misses, b.loads)
    assert (a.misses, a.loads) != (c.misses, c.loads)
    with pytest.raises(ValueError, match="long_weight"):
        next_use_new(2, 4, 4, long_weight=1.5)


def test_no_victim_raises_and_pins():
    st = next_use_new(1, 4, 2)
    assert scored_pin(st, 3) == -1 and scored_pin(st, 3) == -2
    _admit(st, 0, 0)
    with pytest.raises(ValueError, match="no victim"):
        _admit(st, 0, 1, 2)  # slot 0 is the only eligible one
    st = lfu_decay_new(1, 4, 2)
    scored_pin(st, 3)
    for x in (0, 1, 2, 0, 1):
        _admit(st, 0, x)
    assert st[OWNER][1] == 3  # the pinned slot (from the end) is never a victim


# ------------------------------------------------------------------------ the documented rules, in plain Python


class RefModel:
    """The rules of the module docstrings, written out per miss with an argmin over slots."""

    def __init__(self, kind, L, E, S, half_life, bypass, cycle, rho=1.0, kappa=1.0, id_decay=1.0,
                 global_decay=1.0, load_weight=0.0, prior_weight=0.0, prior_keep=1.0, long_weight=0.0,
                 long_half_life=64.0, long_prior_keep=1.0):
        self.kind, self.L, self.E, self.S = kind, L, E, S
        self.dp = decay_table(half_life).tolist()
        self.q = 1.0 - self.dp[1]
        self.bypass, self.cycle = bypass, cycle
        self.rho, self.kappa, self.gamma, self.gamma_g, self.omega = rho, kappa, id_decay, global_decay, load_weight
        self.prior_weight, self.prior_keep = prior_weight, prior_keep
        self.beta, self.dp2, self.keep2 = long_weight, decay_table(long_half_life).tolist(), long_prior_keep
        self.q2 = 1.0 - self.dp2[1]
        self.c4 = [0.0] * (L * E)
        n = L * E
        self.owner, self.slot_of, self.stamp, self.pinned = [-1] * S, [-1] * n, [-1] * S, [False] * S
        self.last, self.c1, self.c2, self.c3 = [0] * n, [0.0] * n, [0.0] * n, [0.0] * n
        self.lclock, self.clock = [0] * L, 0
        self.gc, self.gr, self.ld = 0.5, 1.0, S / (8.0 * L)

    def _dp(self, k):
        return self.dp[min(k, len(self.dp) - 1)]

    def _dp2(self, k):
        return self.dp2[min(k, len(self.dp2) - 1)]

    def key(self, o, c):
        lo = o // self.E
        a = self.lclock[lo] - self.last[o]
        t = self.c1[o] * self._dp(a)
        if self.kind == SC.KIND_LFU_DECAY:
            return t
        r = self.q * t
        if self.beta != 0.0:
            r = (1.0 - self.beta) * r + self.beta * (self.q2 * (self.c4[o] * self._dp2(a)))
        w = 1.0 / (r + self.itau)
        d = (lo - c - 1 + self.L) % self.L + 1 if self.cycle else self.L
        if a == 0:
            p = (self.c2[o] + self.kappa * self.pbar) / (self.c3[o] + self.kappa)
            return SC.PROTECT - (((1.0 - p) * self.L) * w + d)
        return -(self.L * (w - 1.0) + d)

    def admit(self, c, ids):
        self.clock += 1
        self.lclock[c] += 1
        now = self.lclock[c]
        for f in ids:
            g = now - self.last[f]
            if self.kind == SC.KIND_LFU_DECAY:
                self.c1[f] = 1.0 + self.c1[f] * self._dp(g)
            else:
                cont = 0.0
                if self.last[f] > 0:
                    cont = 1.0 if g == 1 else 0.0
                    self.gc = self.gamma_g * self.gc + cont
                    self.gr = self.gamma_g * self.gr + 1.0
                    self.c2[f] = self.gamma * self.c2[f] + cont
                    self.c3[f] = self.gamma * self.c3[f] + 1.0
                self.c1[f] = (self.rho if cont else 1.0) + self.c1[f] * self._dp(g)
                self.c4[f] = (self.rho if cont else 1.0) + self.c4[f] * self._dp2(g)
            self.last[f] = now
            if self.slot_of[f] >= 0:
                self.stamp[self.slot_of[f]] = self.clock
        self.pbar = self.gc / self.gr
        tau = self.S / (self.L * self.ld) if self.ld > 0 else 1e6
        self.itau = 1.0 / min(max(tau, 1.0), 1e6)
        out, loads = [], 0
        for f in ids:
            if self.slot_of[f] >= 0:
                continue
            cands = [(-math.inf if self.owner[s] < 0 else self.key(self.owner[s], c), s) for s in range(self.S)
                     if self.stamp[s] != self.clock and not self.pinned[s]]
            assert cands, "no victim"
            k, s = min(cands)
            o = self.owner[s]
            if self.bypass and o >= 0 and not self.key(f, c) > k:
                out.append(BYPASSED)
                continue
            if o >= 0:
                self.slot_of[o] = -1
            self.owner[s], self.slot_of[f], self.stamp[s] = f, s, self.clock
            out.append(o)
            loads += 1
        if self.kind == SC.KIND_NEXT_USE:
            self.ld = (1.0 - self.omega) * self.ld + self.omega * loads
        return out

    def borrow(self, first, n):
        for s in range(first, first + n):
            if self.owner[s] >= 0:
                self.slot_of[self.owner[s]] = -1
                self.owner[s] = -1

    def prefill(self, layer, counts, k_eff):
        total = float(sum(counts))
        if total <= 0:
            return
        now = self.lclock[layer]
        for e in range(self.E):
            f = layer * self.E + e
            t = self.c1[f] * self._dp(now - self.last[f])
            t2 = self.c4[f] * self._dp2(now - self.last[f])
            p = min(1.0, k_eff * counts[e] / total)
            self.c1[f] = self.prior_keep * t + self.prior_weight * p * (1.0 / self.q)
            self.c4[f] = self.keep2 * t2 + self.prior_weight * p * (1.0 / self.q2)
            self.last[f] = now

    def pin(self, f):
        slot = self.S - 1 - sum(self.pinned)
        cur = self.slot_of[f]
        if cur >= 0 and cur != slot:
            self.owner[cur] = -1
            self.slot_of[f] = -1
        old = self.owner[slot]
        if old >= 0:
            self.slot_of[old] = -1
        self.owner[slot], self.slot_of[f], self.pinned[slot] = f, slot, True


def _configs():
    nu = dict(rho=0.3, kappa=4.0, id_decay=0.9, global_half_life=64.0, load_half_life=4.0)
    return [
        ("lfu", False, dict(half_life=3.0), {}),
        ("lfu", True, dict(half_life=6.0), {}),
        ("nu", False, dict(half_life=8.0, **nu), {}),
        ("nu", True, dict(half_life=8.0, **nu), {}),
        ("nu", True, dict(half_life=16.0, cycle=False, **nu), {}),
        ("nu", True, dict(half_life=8.0, prior_weight=0.5, prior_keep=0.5, **nu), {"prior": True}),
        ("nu", True, dict(half_life=4.0, long_weight=0.35, long_half_life=32.0, prior_weight=0.5, prior_keep=0.5,
                          long_prior_keep=0.0, **nu), {"prior": True}),
        ("nu", False, dict(half_life=4.0, long_weight=1.0, long_half_life=16.0, **nu), {}),
    ]


def _make(kind, bypass, kw, L, E, S):
    if kind == "lfu":
        st = lfu_decay_new(L, E, S, bypass=bypass, **kw)
        ref = RefModel(SC.KIND_LFU_DECAY, L, E, S, kw["half_life"], bypass, False)
    else:
        st = next_use_new(L, E, S, bypass=bypass, **kw)
        p = st[SC.PARAMS]
        ref = RefModel(SC.KIND_NEXT_USE, L, E, S, kw["half_life"], bypass, kw.get("cycle", True), kw["rho"],
                       kw["kappa"], kw["id_decay"], p[SC.GLOBAL_DECAY], p[SC.LOAD_WEIGHT],
                       kw.get("prior_weight", 0.0), kw.get("prior_keep", 1.0), kw.get("long_weight", 0.0),
                       kw.get("long_half_life", 64.0), kw.get("long_prior_keep", 1.0))
    return st, ref


@pytest.mark.parametrize("cfg", range(len(_configs())))
@pytest.mark.parametrize("seed", range(3))
def test_matches_the_documented_rules(cfg, seed):
    """Random calls, borrows, prefill priors and pins: the Numba state machine (one scan per call for the call's
    victims) evicts exactly what the per-miss argmin of the documented keys evicts."""
    kind, bypass, kw, extra = _configs()[cfg]
    rng = np.random.default_rng(100 * cfg + seed)
    L, E = 3, 6
    S = 4 + 3 * seed  # 4 slots: less than a step's accesses, where next_use's bypass acts
    st, ref = _make(kind, bypass, kw, L, E, S)
    ev = np.empty(16, np.int32)
    pins = evictions = bypassed = 0
    for step in range(160):
        if rng.random() < 0.05:
            first = int(rng.integers(0, 2))
            n = int(rng.integers(1, S - first - pins + 1))
            scored_borrow(st, first, n, ev)
            ref.borrow(first, n)
            if extra.get("prior"):
                for layer in range(L):
                    counts = rng.integers(0, 5, E).astype(np.float64)
                    scored_prefill(st, layer, counts, 2.0)
                    ref.prefill(layer, counts.tolist(), 2.0)
        if pins < 2 and rng.random() < 0.02:
            f = int(rng.integers(L * E))
            if f not in [ref.owner[s] for s in range(S) if ref.pinned[s]]:
                scored_pin(st, f)
                ref.pin(f)
                pins += 1
        for layer in range(L):
            k = int(rng.integers(1, min(3, S - pins - 1) + 1))
            hot = rng.random() < 0.7  # some locality
            pool = np.arange(E // 2) if hot else np.arange(E)
            ids = np.sort(rng.choice(pool, k, replace=False) + layer * E).astype(np.int32)
            m = scored_admit(st, layer, ids, ids.size, ev)
            want = ref.admit(layer, ids.tolist())
            assert ev[:m].tolist() == want, (step, layer, ids)
            assert st[OWNER].tolist() == ref.owner
            _check_tables(st, S)
            evictions += sum(1 for x in want if x >= 0)
            bypassed += want.count(BYPASSED)
    assert evictions > 20 and (bypassed > 0 if bypass and seed == 0 else bypass or bypassed == 0)


# -------------------------------------------------------------------------------------- properties on traces


def _states(trace, slots):
    L, E = trace.num_layers, trace.num_experts
    return {
        "lfu_decay": lfu_decay_new(L, E, slots),
        "lfu_decay+bypass": lfu_decay_new(L, E, slots, bypass=True),
        "next_use": next_use_new(L, E, slots),
        "next_use+bypass": next_use_new(L, E, slots, bypass=True),
        "next_use+bypass+prior": next_use_new(L, E, slots, **PRIOR_ONLY),
        "default": next_use_new(L, E, slots, **RECOMMENDED),
    }


def _step_by_step(trace, st, slots, check=None):
    """Borrow (+ prefill prior) at segment starts and one admission per call; returns per-step misses, loads and
    the calls' outcomes."""
    p = prepare(trace)
    borrow_n = min(2 * trace.num_experts, slots)
    prior = st[SC.PARAMS][SC.PRIOR_WEIGHT] != 0 or st[SC.PARAMS][SC.PRIOR_KEEP] != 1
    ev = np.empty(max(p.active.shape[2], borrow_n), np.int32)
    misses, loads, outcomes = [], [], []
    for t in range(trace.steps):
        if p.seg_start[t]:
            scored_borrow(st, 0, borrow_n, ev)
            if prior:
                for layer in range(trace.num_layers):
                    scored_prefill(st, layer, trace.prefill_counts[trace.step_segment[t], layer].astype(np.float64),
                                   float(trace.tokens * trace.top_k))
        m_t = l_t = 0
        for layer in range(trace.num_layers):
            n = int(p.counts[t, layer])
            m = scored_admit(st, layer, p.active[t, layer], n, ev)
            outcomes.append(ev[:m].tolist())
            m_t += m
            l_t += sum(1 for x in ev[:m] if x != BYPASSED)
            if check is not None:
                check(st)
        misses.append(m_t)
        loads.append(l_t)
    return np.asarray(misses), np.asarray(loads), outcomes


@pytest.mark.parametrize("tokens", [1, 2])
def test_replay_equals_whole_calls_and_capacity(tokens):
    t = make_trace(num_layers=4, num_experts=10, top_k=2, steps=120, segments=3, locality=0.6, seed=tokens,
                   tokens=tokens, prefill_tokens=32)
    slots = 14
    p = prepare(t)
    for name, st in _states(t, slots).items():
        a = tuple(x.copy() for x in st)
        mis, lds, _ = _step_by_step(t, a, slots, check=lambda s: _check_tables(s, slots))
        b = tuple(x.copy() for x in st)
        m2, l2 = np.zeros(t.steps, np.int64), np.zeros(t.steps, np.int64)
        scored_replay_calls(b, p.active, p.counts, p.seg_start, t.step_segment.astype(np.int64),
                            t.prefill_counts.astype(np.float64), float(t.tokens * t.top_k), min(2 * t.num_experts,
                                                                                                slots), m2, l2)
        np.testing.assert_array_equal(mis, m2, err_msg=name)
        np.testing.assert_array_equal(lds, l2, err_msg=name)
        for x, y in zip(a, b, strict=True):
            np.testing.assert_array_equal(x, y, err_msg=name)
        assert (lds <= mis).all() and ("bypass" in name or name == "default" or (lds == mis).all())
        # and the simulator's rows count the same
        r = P.POLICIES[name](t, slots, window="all")
        assert (r.misses, r.loads) == (int(mis.sum()), int(lds.sum())), name


def test_bypass_never_loads():
    t = make_trace(num_layers=3, num_experts=12, top_k=3, steps=150, segments=2, locality=0.4, seed=4)
    p = prepare(t)
    slots = 6  # less than a step's 9 accesses: next_use bypasses only when every eligible id is that recent
    for name in ("lfu_decay+bypass", "next_use+bypass", "next_use+bypass+prior", "default"):
        st = _states(t, slots)[name]
        ev = np.empty(8, np.int32)
        bypassed = 0
        for step in range(t.steps):
            for layer in range(t.num_layers):
                before = st[OWNER].copy()
                n = int(p.counts[step, layer])
                ids = p.active[step, layer, :n]
                m = scored_admit(st, layer, ids, n, ev)
                changed = np.nonzero(st[OWNER] != before)[0]
                admitted = [x for x in ev[:m] if x != BYPASSED]
                assert changed.size == len(admitted)  # only admissions change slots
                for x, f in zip(ev[:m], [f for f in ids if f not in before], strict=True):
                    if x == BYPASSED:
                        assert st[SLOT_OF][f] == -1  # a bypassed miss is not resident, and nothing was evicted
                        bypassed += 1
        assert bypassed > 0, name


@pytest.mark.parametrize("name", ["lru", "lfu_decay", "lfu_decay+bypass", "next_use", "next_use+bypass",
                                  "next_use+bypass+prior", "default"])
def test_policies_are_online(name):
    """Changing a trace's future (decode routing and prefill counts from step T on) leaves every decision before T
    as it was."""
    a = make_trace(num_layers=3, num_experts=8, top_k=2, steps=160, segments=4, locality=0.5, seed=7,
                   prefill_tokens=24)
    b = make_trace(num_layers=3, num_experts=8, top_k=2, steps=160, segments=4, locality=0.8, seed=8,
                   prefill_tokens=24)
    T = 90  # inside segment 2 (steps 80..119)
    ids = a.decode_ids.copy()
    ids[T:] = b.decode_ids[T:]
    pre = a.prefill_counts.copy()
    pre[3:] = b.prefill_counts[3:]
    fut = Trace(decode_ids=ids, step_segment=a.step_segment, prefill_counts=pre, num_experts=8, num_layers=3,
                top_k=2, record_bytes=a.record_bytes).validate()
    slots = 10
    if name == "lru":
        def run(t):
            p = prepare(t)
            st = lru_new(t.num_flat, slots)
            ev, sc = np.empty(8, np.int32), np.empty(8, np.int32)
            out = []
            for step in range(t.steps):
                if p.seg_start[step]:
                    lru_borrow(st, 0, min(16, slots), ev)
                for layer in range(t.num_layers):
                    m = lru_admit(st, p.active[step, layer], int(p.counts[step, layer]), sc, ev)
                    out.append(ev[:m].tolist())
            return out
    else:
        def run(t):
            return _step_by_step(t, _states(t, slots)[name], slots)[2]
    x, y = run(a), run(fut)
    cut = T * a.num_layers
    assert x[:cut] == y[:cut]
    assert x[cut:] != y[cut:]


def test_lower_bound_and_recommended_row():
    t = make_trace(num_layers=4, num_experts=16, top_k=2, steps=200, segments=3, locality=0.6, seed=2)
    for slots in (8, 16, 32):
        rows = simulate(t, [slots], window="all", policies=["lfu_decay", "lfu_decay+bypass", "next_use",
                                                            "next_use+bypass", "next_use+bypass+prior", "default",
                                                            "belady_start"])
        bound = rows[-1]["misses"]
        for r in rows[:-1]:
            assert r["misses"] >= bound and r["loads"] <= r["misses"] + slots, r
        assert rows[4]["policy"] == "next_use+bypass+prior" and "next_use+bypass+prior" in rows[4]["note"]
        assert rows[5]["policy"] == "default" and "long" in rows[5]["note"]
    no_borrow = simulate(t, [16], policies=["next_use"], prefill_borrow=False)[0]
    assert "no prefill borrowing" in no_borrow["note"]
    with pytest.raises(ValueError, match="at least as many slots"):
        P.next_use(t, 1)


def test_cli_lists_and_plots_the_new_policies(tmp_path, capsys):
    t = make_trace(num_layers=3, num_experts=8, top_k=2, steps=100, segments=2, locality=0.5, seed=3)
    path = tmp_path / "t.npz"
    save_trace(path, t)
    png = tmp_path / "m.png"
    assert trace_main(["trace", "simulate", str(path), "--slots", "6,12", "--policies",
                       "lru,lfu_decay,lfu_decay+bypass,next_use,next_use+bypass,next_use+bypass+prior,default,"
                       "belady_start",
                       "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    for name in ("lfu_decay+bypass", "next_use+bypass", "next_use+bypass+prior", "default"):
        assert name in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(SystemExit):
        trace_main(["trace", "simulate", "--help"])
    assert "next_use+bypass" in capsys.readouterr().out
