"""next_use's transition predictor (freetoken.policy.scored, RECOMMENDED_TRANS): off (weight 0) it is today's policy
bit for bit; on, it learns "expert i now -> expert j at the layer's next call" online and keeps j resident."""

from __future__ import annotations

import numpy as np
import pytest

from freetoken.policy import scored as sc
from freetoken.policy.next_use import RECOMMENDED, RECOMMENDED_TRANS, next_use_admit, next_use_new
from freetoken.sim import policies as P
from freetoken.sim.policies import scored_replay
from freetoken.trace import make_trace

#: RECOMMENDED's (misses, loads, sum of step * misses, sum of step * loads) on the trace below, from the policy core
#: before the transition predictor existed (commit bc822cd)
GOLDEN = {8: (794, 239, 46764, 13260), 12: (466, 348, 27621, 20696), 20: (164, 164, 9238, 9238)}


def _trace():
    return make_trace(num_layers=4, num_experts=8, top_k=2, steps=120, segments=3, locality=0.6, seed=7, tokens=2,
                      prefill_tokens=16)


@pytest.mark.parametrize("slots", sorted(GOLDEN))
def test_weight_zero_is_todays_policy(slots):
    t = _trace()
    w = np.arange(1, t.steps + 1)
    for extra in ({}, {"trans_weight": 0.0, "trans_decay": 0.5, "trans_prior": 3.0}):
        st = next_use_new(4, 8, slots, **RECOMMENDED, **extra)
        assert st[sc.TN].size == st[sc.TR].size == st[sc.PT].size == 0
        m, ld = scored_replay(t, slots, st)
        assert (int(m.sum()), int(ld.sum()), int((w * m).sum()), int((w * ld).sum())) == GOLDEN[slots]


def test_weight_zero_states_match():
    """Same calls, same every array (statistics, globals, slots) with and without the unused predictor values."""
    t = _trace()
    a = next_use_new(4, 8, 12, **RECOMMENDED)
    b = next_use_new(4, 8, 12, **RECOMMENDED, trans_decay=0.3, trans_prior=0.2)
    scored_replay(t, 12, a)
    scored_replay(t, 12, b)
    for i in (sc.SLOT_OF, sc.OWNER, sc.STAMP, sc.LAST, sc.C1, sc.C2, sc.C3, sc.C4, sc.LCLOCK, sc.GLOB):
        assert np.array_equal(a[i], b[i]), i


def _replay_pattern(pattern, slots, weight, reps=40):
    """One layer of 8 experts, one id per call, ``pattern`` repeated; misses of the second half, in total and on
    id 5."""
    st = next_use_new(1, 8, slots, trans_weight=weight)
    ev = np.empty(4, np.int32)
    total = on5 = 0
    for rep in range(reps):
        for x in pattern:
            m = next_use_admit(st, 0, np.array([x], np.int32), 1, ev)
            if rep >= reps // 2:
                total += m
                on5 += m if x == 5 else 0
    return total, on5, st


def test_predictor_keeps_the_expert_that_always_follows():
    """Expert 0 is always followed by expert 5, which is otherwise the rarest and oldest resident: the rates evict it
    at 0's miss every time; the predictor learns 0 -> 5 and keeps it (no miss on 5 once learned)."""
    pattern = [0, 5, 1, 2, 3, 1, 2, 3]
    _, off5, _ = _replay_pattern(pattern, 4, 0.0)
    _, on5, st = _replay_pattern(pattern, 4, 0.6)
    assert off5 == 20 and on5 == 0
    # the learned row of expert 0: its next call always used 5 (noisy-or of the single active row)
    g, a = 0.9, 1.0
    assert st[sc.TN][0 * 8 + 5] / st[sc.TR][0] == pytest.approx(1.0)
    assert st[sc.TR][0] == pytest.approx((1 - g ** 40) / (1 - g))
    next_use_admit(st, 0, np.array([0], np.int32), 1, np.empty(1, np.int32))
    assert st[sc.PT][5] == pytest.approx(st[sc.TN][5] / (st[sc.TR][0] + a))
    assert st[sc.PT][5] > 0.85 and st[sc.PT][4] == 0.0


def test_predictor_saves_misses():
    pattern = [0, 5, 1, 1, 2, 2, 1, 1, 2, 2, 3, 3]
    off, _, _ = _replay_pattern(pattern, 4, 0.0)
    on, _, _ = _replay_pattern(pattern, 4, 0.6)
    assert on < off


def test_noisy_or_prediction_by_hand():
    """Two layers, hand-checked tables: the update counts the previous call's ids' rows, the prediction is the
    noisy-or of the current ids' rows, in doubles in the documented order."""
    st = next_use_new(2, 4, 8, trans_weight=0.5, trans_decay=0.5, trans_prior=1.0)
    ev = np.empty(4, np.int32)
    calls = [(0, [0, 1]), (1, [4]), (0, [1, 2]), (1, [5]), (0, [0, 2]), (1, [4, 5])]
    for layer, ids in calls:
        next_use_admit(st, layer, np.array(ids, np.int32), len(ids), ev)
    tn = st[sc.TN].reshape(8, 4)
    tr = st[sc.TR]
    # layer 0: rows of {0, 1} after the 2nd call ({1, 2}), rows of {1, 2} after the 3rd ({0, 2})
    assert tr[0] == 1.0 and list(tn[0]) == [0.0, 1.0, 1.0, 0.0]
    assert tr[1] == 0.5 * 1.0 + 1.0 and list(tn[1]) == [1.0, 0.5, 1.5, 0.0]
    assert tr[2] == 1.0 and list(tn[2]) == [1.0, 0.0, 1.0, 0.0]
    # layer 1: row 4 after {5}, row 5 after {4, 5}
    assert tr[4] == 1.0 and list(tn[4]) == [0.0, 1.0, 0.0, 0.0]
    assert tr[5] == 1.0 and list(tn[5]) == [1.0, 1.0, 0.0, 0.0]
    for layer, ids in ((0, [0, 2]), (1, [4, 5])):
        for e in range(4):
            y = 1.0
            for f in ids:
                y = y * (1.0 - (tn[f, e] / (tr[f] + 1.0)))
            assert st[sc.PT][layer * 4 + e] == 1.0 - y


def test_key_mixes_the_prediction():
    """keep_key at age >= 1 and age 0 against the documented formulas."""
    st = next_use_new(1, 4, 4, trans_weight=0.6, cycle=True)
    ev = np.empty(4, np.int32)
    for ids in ([0, 1], [1, 2], [0, 1], [2, 3], [0, 1]):
        next_use_admit(st, 0, np.array(ids, np.int32), len(ids), ev)
    params, glob, lam = st[sc.PARAMS], st[sc.GLOB], 0.6
    pbar = glob[sc.G_CONT] / glob[sc.G_REUSE]
    tau = min(max(4 / (1 * glob[sc.G_LOADS]), sc.TAU_MIN), sc.TAU_MAX)
    itau = 1.0 / tau
    now = st[sc.LCLOCK][0]
    for f in range(4):
        a = now - st[sc.LAST][f]  # keep_key sees the next call: one step older
        a += 1
        r = params[sc.RATE] * (st[sc.C1][f] * st[sc.DP][min(a, st[sc.DP].size - 1)])
        beta = params[sc.LONG_WEIGHT]
        if beta != 0.0:
            r = ((1.0 - beta) * r) + (beta * ((1.0 - st[sc.DP2][1]) * (st[sc.C4][f] * st[sc.DP2][a])))
        w = 1.0 / (r + itau)
        p = ((1.0 - lam) * (1.0 / w)) + (lam * st[sc.PT][f])
        want = -((((1.0 - p) * 1) * w) + 1)
        assert sc.keep_key(st, f, 0) == want
    # age 0 (the id's layer clock not advanced: a call of another layer would see it), via the protected branch
    st2 = next_use_new(2, 4, 8, trans_weight=0.6)
    for layer, ids in ((0, [0, 1]), (1, [4]), (0, [0, 2]), (1, [5])):
        next_use_admit(st2, layer, np.array(ids, np.int32), len(ids), ev)
    k = sc.keep_key(st2, 0, 1)  # id 0 used at layer 0's latest call: age 0 for a call of layer 1
    assert k > sc.PROTECT / 2
    kap = st2[sc.PARAMS][sc.KAPPA]
    pbar = st2[sc.GLOB][sc.G_CONT] / st2[sc.GLOB][sc.G_REUSE]
    p = (st2[sc.C2][0] + kap * pbar) / (st2[sc.C3][0] + kap)
    p = ((1.0 - lam) * p) + (lam * st2[sc.PT][0])
    assert st2[sc.PT][0] > 0.0
    tau = min(max(8 / (2 * st2[sc.GLOB][sc.G_LOADS]), sc.TAU_MIN), sc.TAU_MAX)
    r = st2[sc.PARAMS][sc.RATE] * (st2[sc.C1][0] * st2[sc.DP][0])
    beta = st2[sc.PARAMS][sc.LONG_WEIGHT]
    assert beta == 0.0
    w = 1.0 / (r + 1.0 / tau)
    assert k == sc.PROTECT - ((((1.0 - p) * 2) * w) + 1)


def test_recommended_trans_row_and_arguments():
    t = _trace()
    r = P.POLICIES["default+trans"](t, 12)
    assert r.policy == "default+trans" and "trans" in r.note
    st = P.demand_state("default+trans", t, 12)
    assert st[sc.TN].size == 4 * 8 * 8 and st[sc.PARAMS][sc.TRANS_WEIGHT] == RECOMMENDED_TRANS["trans_weight"]
    assert P.belady_start(t, 12).misses <= r.misses
    with pytest.raises(ValueError):
        next_use_new(2, 4, 4, trans_weight=1.5)
    with pytest.raises(ValueError):
        next_use_new(2, 4, 4, trans_weight=0.5, trans_prior=0.0)
    with pytest.raises(ValueError):
        sc.device_consts(next_use_new(2, 4, 4, trans_weight=0.5))
