"""freetoken.policy (the q* split), freetoken.sim.predict (next-layer predictors) and freetoken.sim.timing (the
decode-step time model)."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest

from freetoken.cli import main as cli_main
from freetoken.policy import StepCosts, choose_fetch, fetch_order, objective, split, split_time, which_to_fetch
from freetoken.policy.qstar import auto_future_value, expected_hits, marginal_hit_value, place_bypassed
from freetoken.sim import policies as P
from freetoken.sim import timing as TM
from freetoken.sim.predict import (
    fit_coactivation,
    precision_recall,
    predict_coactivation,
    predict_oracle,
    predict_previous,
    predictions,
)
from freetoken.trace import Trace, load_trace, make_trace, prepare, save_trace
from freetoken.trace.derived import token_counts


def _critical_ref(costs: StepCosts, fetched_tokens, cpu_tokens, hits: int) -> float:
    """The cost model written out independently: fetched / CPU sets given by their tokens."""
    q, r = len(fetched_tokens), len(cpu_tokens)
    gpu = q * costs.transfer_s + (hits + q) * costs.gpu_s
    cpu = costs.cpu_handoff_s + r * costs.cpu_s + costs.cpu_token_s * sum(cpu_tokens) if r else 0.0
    return max(gpu, cpu)


def _random_costs(rng) -> StepCosts:
    def val(scale):
        return 0.0 if rng.random() < 0.1 else float(rng.uniform(0.05, 2.0) * scale)

    return StepCosts(transfer_s=val(1.0), cpu_s=val(1.0), gpu_s=val(0.05), cpu_handoff_s=val(0.5),
                     cpu_token_s=val(0.2) if rng.random() < 0.5 else 0.0)


# ---------------------------------------------------------------------------------------------- the split


def test_place_bypassed_is_the_best_split_with_the_admitted_misses_fetched():
    """next_use under hybrid: the admitted misses are fetched in any case; of the bypassed ones the streamed set is
    the first n in fetch order, n minimising the critical path (brute force over n, ties to the larger n)."""
    rng = np.random.default_rng(4)
    for _ in range(200):
        costs = StepCosts.from_bandwidths(int(rng.integers(1, 8)) * 1_000_000, float(rng.uniform(2, 60)),
                                          float(rng.uniform(2, 60)), 900.0, 1e-5, float(rng.uniform(0, 1e-4)),
                                          float(rng.uniform(0, 1e-5)))
        a, h, b = (int(v) for v in rng.integers(0, 6, 3))
        tokens = rng.integers(1, 5, b)
        mask = place_bypassed(costs, a, h, tokens)
        order = fetch_order(np.arange(b), tokens)
        crit = [split_time(costs, a + n, a + b, h, np.concatenate([np.ones(a, int), tokens[order]])).critical
                for n in range(b + 1)]
        n = int(mask.sum())
        assert crit[n] == min(crit) and all(c > crit[n] for c in crit[n + 1:])
        assert set(np.flatnonzero(mask)) == set(order[:n].tolist())


def test_choose_fetch_equals_brute_force_over_q():
    rng = np.random.default_rng(0)
    for case in range(600):
        costs = _random_costs(rng)
        m = int(rng.integers(0, 65)) if case % 3 else int(rng.integers(0, 6))
        h = int(rng.integers(0, 17))
        tok = None if rng.random() < 0.5 else rng.integers(1, 5, m)
        fv = 0.0 if case % 2 else float(rng.uniform(0, 1.5))
        q = choose_fetch(costs, m, h, future_value=fv, tokens=tok)
        objs = [objective(costs, j, m, h, fv, tok) for j in range(m + 1)]
        # brute force: the smallest objective, ties to the larger q
        best = min(objs)
        want = max(j for j in range(m + 1) if objs[j] == best)
        assert q == want, (case, costs, m, h, fv)
        # the objective itself against the cost model written out independently
        t = np.ones(m, np.int64) if tok is None else np.asarray(tok)
        for j in range(m + 1):
            ref = _critical_ref(costs, t[:j].tolist(), t[j:].tolist(), h) - fv * j
            assert objs[j] == pytest.approx(ref, rel=1e-12, abs=1e-15)


def test_split_extremes_and_edge_cases():
    c = StepCosts(transfer_s=1.0, cpu_s=1.0, gpu_s=0.01, cpu_handoff_s=0.1)
    assert choose_fetch(c, 0, 5) == 0  # m = 0
    assert choose_fetch(c, 0, 0, future_value=3.0) == 0
    assert split(c, [], hits=8).shape == (0,)  # all hits
    # a free link fetches everything, a free CPU takes everything (without future value)
    assert choose_fetch(StepCosts(transfer_s=0.0, cpu_s=1.0, gpu_s=0.0), 7, 1) == 7
    assert choose_fetch(StepCosts(transfer_s=1.0, cpu_s=0.0, gpu_s=0.0), 7, 1) == 0
    # equal costs: the paths balance (4 x 1 + 8 x 0.01 vs 0.1 + 4 x 1 -> q = 4 of 8)
    assert choose_fetch(c, 8, 0) == 4
    st = split_time(c, 4, 8, 0)
    assert st.transfer == 4.0 and st.gpu_path == pytest.approx(4.04) and st.cpu_path == pytest.approx(4.1)
    assert st.critical == pytest.approx(4.1)
    # the future value moves the split toward fetching, all the way when large
    qs = [choose_fetch(c, 8, 0, future_value=v) for v in (0.0, 0.5, 1.0, 2.5, 10.0)]
    assert qs == sorted(qs) and qs[-1] == 8
    # q* is never worse than both extremes when future_value = 0
    rng = np.random.default_rng(1)
    for _ in range(200):
        costs = _random_costs(rng)
        m, h = int(rng.integers(0, 20)), int(rng.integers(0, 10))
        q = choose_fetch(costs, m, h)
        crit = split_time(costs, q, m, h).critical
        assert crit <= min(split_time(costs, 0, m, h).critical, split_time(costs, m, m, h).critical)
    with pytest.raises(ValueError, match="future_value"):
        choose_fetch(c, 3, 0, future_value=-1.0)
    with pytest.raises(ValueError, match="non-negative"):
        choose_fetch(c, -1, 0)
    with pytest.raises(ValueError, match="one count per miss"):
        choose_fetch(c, 3, 0, tokens=[1, 2])
    with pytest.raises(ValueError, match="StepCosts.cpu_s"):
        StepCosts(transfer_s=1.0, cpu_s=-1.0, gpu_s=0.0)
    with pytest.raises(ValueError, match="q must be"):
        split_time(c, 4, 3, 0)


def test_step_costs_from_bandwidths():
    c = StepCosts.from_bandwidths(10_000_000, pcie_gbps=25, cpu_gbps=50, gpu_gbps=1000, copy_latency_s=1e-6,
                                  cpu_handoff_s=2e-5)
    assert c.transfer_s == pytest.approx(10e6 / 25e9 + 1e-6)
    assert c.cpu_s == pytest.approx(10e6 / 50e9) and c.gpu_s == pytest.approx(1e-5)
    assert c.cpu_handoff_s == 2e-5 and c.cpu_token_s == 0.0
    x, cc, g = c.transfer_s, c.cpu_s, c.gpu_s
    assert marginal_hit_value(c) == pytest.approx(x * cc / (x + g + cc))
    assert auto_future_value(c, 3.0) == pytest.approx(3 * marginal_hit_value(c))
    with pytest.raises(ValueError, match="pcie_gbps"):
        StepCosts.from_bandwidths(1000, 0, 50)


def test_which_to_fetch_is_optimal_over_subsets():
    """With the fetch order (most tokens first) the scan over q is the optimum over every subset of misses."""
    rng = np.random.default_rng(2)
    for _ in range(150):
        costs = _random_costs(rng)
        m, h = int(rng.integers(0, 8)), int(rng.integers(0, 5))
        ids = rng.choice(100, m, replace=False)
        tok = rng.integers(1, 6, m)
        fv = float(rng.choice([0.0, rng.uniform(0, 1)]))
        mask = split(costs, ids, h, future_value=fv, tokens=tok, reuse=rng.random(m))
        got = _critical_ref(costs, tok[mask].tolist(), tok[~mask].tolist(), h) - fv * mask.sum()
        best = min(_critical_ref(costs, [tok[i] for i in s], [tok[i] for i in range(m) if i not in s], h) - fv * len(s)
                   for r in range(m + 1) for s in itertools.combinations(range(m), r))
        assert got == pytest.approx(best, rel=1e-12, abs=1e-15)


def test_fetch_order_is_deterministic():
    ids = [7, 3, 9, 1, 4]
    assert fetch_order(ids).tolist() == [3, 1, 4, 0, 2]  # equal tokens and reuse: ascending id
    assert fetch_order(ids, tokens=[1, 1, 3, 1, 2]).tolist() == [2, 4, 3, 1, 0]
    assert fetch_order(ids, reuse=[5, 5, 0, 9, 5]).tolist() == [3, 1, 4, 0, 2]
    assert fetch_order(ids, tokens=[2, 1, 1, 1, 1], reuse=[0, 1, 2, 3, 4]).tolist() == [0, 4, 3, 2, 1]
    assert which_to_fetch(ids, 2, tokens=[1, 1, 3, 1, 2]).tolist() == [False, False, True, False, True]
    with pytest.raises(ValueError, match="q must be"):
        which_to_fetch(ids, 6)


# ----------------------------------------------------------------------------------------------- predictors


def _tiny_trace() -> Trace:
    ids = np.array([[0, 2], [1, 3], [0, 2], [1, 2]], np.int32)[:, :, None, None]  # [steps=4, L=2, T=1, k=1]
    return Trace(decode_ids=ids, step_segment=np.zeros(4, np.int32), prefill_counts=np.zeros((1, 2, 4), np.int32),
                 num_experts=4, num_layers=2, top_k=1, record_bytes=100).validate()


def test_predictors_by_hand():
    t = _tiny_trace()
    prev = predict_previous(t, 1)
    assert prev[:, :, 0].tolist() == [[-1, -1], [0, 2], [1, 3], [0, 2]]
    s = precision_recall(t, prev, "all")
    assert (s.predicted, s.actual, s.correct) == (6, 8, 1)
    assert s.precision == pytest.approx(1 / 6) and s.recall == pytest.approx(1 / 8)

    model = fit_coactivation(t, (0, 4))
    # layer 0 -> 1 (same step): 0 -> 2 twice; 1 -> 3 once, 1 -> 2 once. Layer 1 -> 0 (next step): 2 -> 1, 3 -> 0.
    assert model.prob[1, 0].tolist() == [0, 0, 1, 0] and model.prob[1, 1].tolist() == [0, 0, 0.5, 0.5]
    assert model.prob[0, 2].tolist() == [0, 1, 0, 0] and model.prob[0, 3].tolist() == [1, 0, 0, 0]
    co = predict_coactivation(t, 1, fit_steps=(0, 4))
    assert co[:, :, 0].tolist() == [[-1, 2], [1, 2], [0, 2], [1, 2]]  # (1, 1): a 0.5 / 0.5 tie -> the lower id
    s = precision_recall(t, co, "all")
    assert (s.predicted, s.actual, s.correct) == (7, 8, 6)
    s = precision_recall(t, co, "second_half")
    assert s.precision == 1.0 and s.recall == 1.0
    co2 = predict_coactivation(t, 2, fit_steps=(0, 4))
    assert co2[1, 1].tolist() == [2, 3] and co2[0, 1].tolist() == [2, -1]  # zero scores are not predicted
    s = precision_recall(t, co2, (1, 2))
    assert (s.predicted, s.actual, s.correct) == (3, 2, 2)

    orc = predict_oracle(t)
    s = precision_recall(t, orc, "all")
    assert s.precision == 1.0 and s.recall == 1.0 and orc.shape == (4, 2, 1)
    with pytest.raises(ValueError, match="unknown predictor"):
        predictions(t, "magic", 2)
    with pytest.raises(ValueError, match="shape"):
        precision_recall(t, orc[:2], "all")


def test_predictors_batch_trace():
    t = make_trace(num_layers=3, num_experts=8, top_k=2, tokens=3, steps=40, locality=0.8, seed=3)
    orc = predict_oracle(t)
    act = prepare(t).counts
    assert ((orc >= 0).sum(-1) == act).all()  # the unique ids of the batch
    for name in ("coact", "prev"):
        p = predictions(t, name, 4)
        assert p.shape == (40, 3, 4) and p.max() < 8
        s = precision_recall(t, p)
        assert 0.0 <= s.precision <= 1.0 and 0.0 <= s.recall <= 1.0


# ------------------------------------------------------------------------------------------ the time model


def _reference_timing(trace: Trace, mode: str, slots: int, costs: StepCosts, future_value="auto", layer_s=0.0):
    """fetch_all / cpu_all / qstar written out with the public split API, a literal LRU and the two future-value
    estimators as the timing module documents them (no prefetch)."""
    E = trace.num_experts
    slots = 0 if mode == "cpu_all" else slots
    owner, recency, slot_of = np.full(slots, -1), np.full(slots, -1), {}
    last_used, n_reacc, n_within = {}, {}, {}
    g_reacc = g_within = age_sum = n_age = tot_hits = tot_life = 0.0
    clock, times, fetched_tot, hits_count = 0, [], 0, 0
    s_hit = marginal_hit_value(costs)
    for t in range(trace.steps):
        if t == 0 or trace.step_segment[t] != trace.step_segment[t - 1]:
            for s in range(min(2 * E, slots)):
                if owner[s] >= 0:
                    del slot_of[owner[s]]
                    tot_life += 1
                owner[s], recency[s] = -1, -1
        step = 0.0
        for layer in range(trace.num_layers):
            clock += 1
            flat = (layer * E + trace.decode_ids[t, layer].ravel()).tolist()
            active = sorted(set(flat))
            tok = {f: flat.count(f) for f in active}
            hits = [f for f in active if f in slot_of]
            misses = [f for f in active if f not in slot_of]
            for f in hits:
                recency[slot_of[f]] = clock
            kw = {"tokens": [tok[f] for f in misses], "reuse": [last_used.get(f, -1) for f in misses]}
            if mode == "fetch_all":
                mask = np.ones(len(misses), bool)
            elif mode == "cpu_all":
                mask = np.zeros(len(misses), bool)
            elif future_value == "auto":
                pool = 1.0 if n_age == 0 else (g_within + 1.0) / (g_reacc + 1.0)
                values = [expected_hits((n_within.get(f, 0.0) + TM.PRIOR_WEIGHT * pool)
                                        / (n_reacc.get(f, 0.0) + TM.PRIOR_WEIGHT), TM.MAX_HITS) * s_hit
                          for f in misses]
                mask = split(costs, misses, len(hits), values, **kw)
            elif future_value == "global":
                mask = split(costs, misses, len(hits), (tot_hits + TM.PRIOR_HITS) / (tot_life + 1.0) * s_hit, **kw)
            else:
                mask = split(costs, misses, len(hits), future_value, **kw)
            fetched = [f for f, k in zip(misses, mask, strict=True) if k]
            for f in fetched:  # ascending id
                held = {slot_of[g] for g in active if g in slot_of}
                v = min((s for s in range(slots) if s not in held), key=lambda s: (recency[s], s))
                if owner[v] >= 0:
                    age_sum += t - last_used[owner[v]]
                    n_age += 1
                    tot_life += 1
                    del slot_of[owner[v]]
                owner[v], slot_of[f], recency[v] = f, v, clock
            cpu_tok = [tok[f] for f, k in zip(misses, mask, strict=True) if not k]
            step += layer_s + _critical_ref(costs, fetched, cpu_tok, len(hits))
            tot_hits += len(hits)
            hits_count += len(hits)
            fetched_tot += len(fetched)
            tc = age_sum / n_age if n_age else float("inf")
            for f in active:
                if f in last_used:
                    n_reacc[f] = n_reacc.get(f, 0.0) + 1
                    g_reacc += 1
                    if t - last_used[f] <= tc:
                        n_within[f] = n_within.get(f, 0.0) + 1
                        g_within += 1
                last_used[f] = t
        times.append(step)
    return np.array(times), hits_count, fetched_tot


@pytest.mark.parametrize("seed", range(3))
def test_timing_matches_literal_reference(seed):
    rng = np.random.default_rng(seed)
    tokens = 1 + seed % 2
    t = make_trace(num_layers=3, num_experts=6, top_k=2, steps=50, segments=1 + seed, locality=float(rng.random()),
                   seed=seed, tokens=tokens, record_bytes=4_000_000)
    slots = [4, 9, 18][seed]
    for pcie, fv, ctok in ((10.0, "auto", 0.0), (40.0, 0.0, 0.0), (25.0, 1e-4, 3e-5), (60.0, "auto", 1e-5),
                           (15.0, "global", 0.0), (30.0, "global", 2e-5)):
        costs = StepCosts.from_bandwidths(t.record_bytes, pcie, 30.0, 900.0, cpu_token_s=ctok)
        res = TM.time_modes(t, slots, pcie, 30.0, 900.0, modes=("fetch_all", "cpu_all", "qstar"), window="all",
                            future_value=fv, layer_s=2e-5, cpu_token_s=ctok)
        for r in res:
            want, hits, fetched = _reference_timing(t, r.mode, slots, costs, fv, layer_s=2e-5)
            np.testing.assert_allclose(r.per_step, want, rtol=1e-12)
            assert (r.hits, r.fetched) == (hits, fetched), r.mode
            assert r.step_s == pytest.approx(r.gpu_s + r.stall_s, rel=1e-12)


def test_fetch_all_is_the_device_lru_and_cpu_all_is_closed_form():
    t = make_trace(num_layers=4, num_experts=16, top_k=2, steps=120, segments=3, locality=0.6, seed=4,
                   record_bytes=2_000_000)
    costs = StepCosts.from_bandwidths(t.record_bytes, 20, 40)
    fa, ca = TM.time_modes(t, 12, 20, 40, modes=("fetch_all", "cpu_all"), window="all")
    lru_misses, _ = P.lru_replay(t, 12)
    assert fa.misses == fa.fetched == int(lru_misses.sum()) and fa.accesses == fa.hits + fa.misses
    n = prepare(t).counts  # [steps, L]
    want = (costs.cpu_handoff_s + n * costs.cpu_s).sum(1)
    np.testing.assert_allclose(ca.per_step, want, rtol=1e-12)
    assert ca.hits == 0 and ca.fetched == 0 and ca.gpu_s == 0.0 and ca.transfer_s == 0.0
    assert fa.cpu_s == 0.0 and fa.transfer_s == pytest.approx(fa.fetched / fa.steps * costs.transfer_s)
    with pytest.raises(ValueError, match="largest active set"):
        TM.time_modes(t, 1, 20, 40)
    with pytest.raises(ValueError, match="unknown mode"):
        TM.time_modes(t, 12, 20, 40, modes=("magic",))


SWEEP_CASES = [  # (locality, slots, tokens, layer_s)
    (0.0, 16, 1, 0.0), (0.6, 48, 1, 0.0), (0.9, 128, 1, 5e-5), (0.95, 512, 1, 0.0), (0.5, 24, 3, 0.0),
]


@pytest.mark.parametrize(("locality", "slots", "tokens", "layer_s"), SWEEP_CASES)
def test_qstar_at_or_below_both_extremes_on_the_sweep(locality, slots, tokens, layer_s):
    """Over a trace the cache states of the modes diverge, so this is measured, not by construction (see the
    timing module docstring): the global estimate exactly, the default (auto) within 0.5%."""
    t = make_trace(num_layers=8, num_experts=64, top_k=4, tokens=tokens, steps=300, segments=3, locality=locality,
                   seed=11, record_bytes=8 << 20)
    for fv, slack in (("global", 1e-12), ("auto", 5e-3)):
        rows = TM.sweep(t, slots, 50.0, modes=("fetch_all", "cpu_all", "qstar"), layer_s=layer_s, future_value=fv)
        assert sorted({r["ratio"] for r in rows}) == pytest.approx(list(TM.SWEEP_RATIOS))
        for ratio in TM.SWEEP_RATIOS:
            d = {r["mode"]: r["step_s"] for r in rows if r["ratio"] == ratio}
            best = min(d["fetch_all"], d["cpu_all"])
            assert d["qstar"] <= best * (1 + slack) + 1e-12, (fv, ratio, d)


def test_auto_future_value_splits_where_it_pays():
    """Where fetch_all and the global estimate coincide, the per-expert estimate splits and is much faster."""
    t = make_trace(num_layers=16, num_experts=64, top_k=8, steps=300, segments=2, locality=0.6, seed=0,
                   record_bytes=9 << 20)
    fa, glob = TM.time_modes(t, 256, 25.0, 50.0, modes=("fetch_all", "qstar"), future_value="global")
    (auto,) = TM.time_modes(t, 256, 25.0, 50.0, modes=("qstar",))
    assert glob.step_s <= fa.step_s + 1e-12 and auto.future_value == "auto" and glob.future_value == "global"
    assert auto.step_s < 0.9 * fa.step_s and auto.cpu_experts > 0


def test_per_call_split_beats_both_extremes_on_the_same_cache_state():
    t = make_trace(num_layers=6, num_experts=32, top_k=4, steps=200, segments=2, locality=0.7, seed=5,
                   record_bytes=4 << 20)
    split_somewhere = False
    for pcie in (10.0, 50.0, 200.0):
        d = TM.split_vs_extremes_same_state(t, 40, pcie, 50.0, future_value=0.0)
        assert (d[..., 0] <= np.minimum(d[..., 1], d[..., 2])).all()
        split_somewhere |= bool((d[..., 0] < np.minimum(d[..., 1], d[..., 2]) - 1e-9).any())
    assert split_somewhere  # the split does split


def test_oracle_prefetch_never_worse():
    t = make_trace(num_layers=8, num_experts=64, top_k=4, steps=200, segments=2, locality=0.6, seed=1,
                   record_bytes=8 << 20)
    oracle = predict_oracle(t, 4)
    for slots, layer_s in ((8, 3e-4), (16, 5e-5), (64, 3e-4), (256, 5e-5)):
        rows = TM.sweep(t, slots, 50.0, modes=("qstar", "qstar_prefetch", "fetch_all", "fetch_all_prefetch"),
                        layer_s=layer_s, predictor=oracle)
        gained = False
        for ratio in TM.SWEEP_RATIOS:
            d = {r["mode"]: r for r in rows if r["ratio"] == ratio}
            assert d["qstar_prefetch"]["step_s"] <= d["qstar"]["step_s"] + 1e-12, (slots, ratio)
            assert d["fetch_all_prefetch"]["step_s"] <= d["fetch_all"]["step_s"] + 1e-12, (slots, ratio)
            assert d["qstar_prefetch"]["precision"] == 1.0
            gained |= d["qstar_prefetch"]["step_s"] < d["qstar"]["step_s"] - 1e-9
            # fetch_all + oracle: every prefetched record is used
            fp = d["fetch_all_prefetch"]
            assert fp["prefetch_used"] == fp["prefetched"]
        assert gained
    full = TM.time_modes(t, 64, 50.0, 50.0, modes=("fetch_all", "fetch_all_prefetch"), window="all", layer_s=3e-4,
                         predictor=oracle)
    assert full[0].fetched == full[1].fetched + full[1].prefetched  # the same records loaded
    assert full[0].hits + full[1].prefetch_used == full[1].hits  # ... but ahead of time


# --------------------------------------------------------------------------------- time model per cache policy


def _policy_trace(tokens: int = 1) -> Trace:
    return make_trace(num_layers=4, num_experts=16, top_k=2, steps=120, segments=3, locality=0.6, seed=3,
                      tokens=tokens, record_bytes=2_000_000)


@pytest.mark.parametrize(("tokens", "host_memory"), [(1, None), (3, 40 * 2_000_000)])
def test_policy_time_model_lru_is_fetch_all(tokens, host_memory):
    """The time model with the ``lru`` policy is today's ``fetch_all`` (the device LRU), bit for bit."""
    t = _policy_trace(tokens)
    kw = dict(layer_s=3e-5, step_s=1e-4, cpu_token_s=2e-6, host_memory=host_memory, disk_gbps=3.0)
    for slots, window in ((8, "second_half"), (24, "all")):
        want = TM.time_modes(t, slots, 25, 50, modes=("fetch_all",), window=window, **kw)[0]
        got = TM.time_policies(t, slots, 25, 50, policies=("lru",), window=window, **kw)[0]
        assert got.mode == "lru"
        assert {**got.as_row(), "mode": ""} == {**want.as_row(), "mode": ""}
        assert np.array_equal(got.per_step, want.per_step)
        assert (got.disk_reads > 0) == (host_memory is not None)


def test_policy_time_model_has_the_miss_rate_tables_decisions():
    """Per policy, the time model's misses and fetches are the miss-rate table's misses and loads (same trace,
    capacity, window, borrow); the bypassed misses go to the CPU."""
    t = _policy_trace(2)
    bypassed = 0
    for slots, window, borrow in ((8, "second_half", True), (20, "all", False)):
        got = TM.time_policies(t, slots, 25, 50, policies=TM.POLICY_MODES, window=window, prefill_borrow=borrow)
        for r in got:
            table = P.POLICIES[r.mode](t, slots, window=window, prefill_borrow=borrow)
            assert (r.accesses, r.misses, r.fetched) == (table.accesses, table.misses, table.loads), r.mode
            assert r.hits + r.misses == r.accesses
            if "bypass" not in r.mode and not r.mode.startswith("default"):
                assert r.cpu_experts == 0 and r.cpu_s == 0.0
            bypassed += r.cpu_experts
    assert bypassed > 0  # the small cache makes the bypass policies serve misses on the CPU
    with pytest.raises(ValueError, match="demand policies"):
        TM.time_policies(t, 8, 25, 50, policies=("belady",))


def test_policy_time_model_streams_bypassed_misses():
    """bypassed="stream" (the runtime's gpu mode): the same decisions, so the same misses, but every miss is fetched
    and none runs on the CPU; with no bypass (lru) nothing changes, and an unknown target is refused."""
    t = _policy_trace(2)
    cpu, stream = (TM.time_policies(t, 8, 25, 50, policies=("lru", "default"), bypassed=b) for b in ("cpu", "stream"))
    for a, b in zip(cpu, stream, strict=True):
        assert (a.mode, a.misses, a.hits) == (b.mode, b.misses, b.hits)
        assert b.fetched == b.misses and b.cpu_experts == 0 and b.cpu_s == 0.0
    assert cpu[0].step_s == stream[0].step_s  # lru bypasses nothing
    assert cpu[1].cpu_experts > 0 and cpu[1].fetched < stream[1].fetched
    assert "through a scratch slot" in TM.format_policy_timing(stream, "stream")
    with pytest.raises(ValueError, match="bypassed misses go to"):
        TM.time_policies(t, 8, 25, 50, bypassed="disk")


def test_policy_time_model_matches_literal_reference():
    """A bypassing policy's step times written out from its decisions: per call, admitted misses fetched, bypassed
    ones (with their tokens) on the CPU."""
    t = _policy_trace(3)
    costs = StepCosts.from_bandwidths(t.record_bytes, 10.0, 50.0, 900.0, 1e-5, 3e-5, 2e-6)
    status = TM.policy_decisions(t, "default", 8)
    p = prepare(t)
    tok = token_counts(t)
    want = np.zeros(t.steps)
    for step in range(t.steps):
        for layer in range(t.num_layers):
            n = int(p.counts[step, layer])
            st = status[step, layer, :n]
            fetched = [1] * int((st == 1).sum())
            cpu = [int(v) for v in tok[step, layer, :n][st == 2]]
            want[step] += 4e-5 + _critical_ref(costs, fetched, cpu, int((st == 0).sum()))
    assert (status == 2).any()
    r = TM.time_policies(t, 8, 10.0, 50.0, policies=("default",), window="all", layer_s=4e-5, copy_latency_s=1e-5,
                         cpu_handoff_s=3e-5, cpu_token_s=2e-6)[0]
    np.testing.assert_allclose(r.per_step, want, rtol=1e-12)
    assert r.cpu_s > 0 and r.cpu_experts == int((status == 2).sum())


# ------------------------------------------------------------------------------------------------------ CLI


def test_cli_time_model(tmp_path, capsys):
    path = tmp_path / "syn.npz"
    save_trace(path, make_trace(num_layers=4, num_experts=16, top_k=2, steps=200, segments=2, locality=0.7, seed=5,
                                record_bytes=4_000_000))
    assert cli_main(["trace", "simulate", str(path), "--slots", "8,32", "--pcie", "25", "--cpu", "50",
                     "--layer-us", "40"]) == 0
    out = capsys.readouterr().out
    for mode in TM.MODES:
        assert mode in out
    assert "coact: precision" in out and "tok/s" in out and "stall us" in out and "PCIe 25 GB/s" in out
    assert "PCIe/CPU" not in out  # no sweep asked for
    assert "tokens/s per cache policy" not in out  # only with --policies
    assert cli_main(["trace", "simulate", str(path), "--slots", "8,32", "--pcie", "25", "--cpu", "50",
                     "--modes", "fetch_all", "--policies", "lru,default"]) == 0
    out = capsys.readouterr().out
    assert "tokens/s per cache policy" in out and out.count("\ndefault ") == 2  # the default row, 2 slot counts

    png = tmp_path / "sweep.png"
    argv = ["trace", "simulate", str(path), "--slots", "16", "--pcie", "25", "--cpu", "50", "--sweep",
            "--future-value", "0", "--predictor", "prev"]
    try:
        import matplotlib  # noqa: F401
        argv += ["--plot", str(png)]
    except ImportError:
        png = None
    assert cli_main(argv) == 0
    out = capsys.readouterr().out
    assert "PCIe/CPU" in out and "0.25x" in out and "4x" in out and "qstar/best" in out and "future value 0 s" in out
    if png is not None:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and "plot written" in out

    assert cli_main(["trace", "simulate", str(path), "--slots", "16", "--pcie", "25", "--cpu", "50", "--json",
                     "--sweep", "--modes", "fetch_all,qstar", "--policies", "lru,default"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [r["mode"] for r in data["timing"]] == ["fetch_all", "qstar"]
    assert len(data["sweep"]) == 2 * len(TM.SWEEP_RATIOS) and data["timing"][1]["future_value"] == "auto"
    assert [r["policy"] for r in data["policies"]] == ["lru", "default"]
    assert data["policies"][0]["tokens_per_s"] == data["timing"][0]["tokens_per_s"]  # lru = fetch_all

    assert cli_main(["trace", "simulate", str(path), "--slots", "16", "--pcie", "25", "--cpu", "50", "--json",
                     "--modes", "qstar", "--policies", "next_use+bypass,default"]) == 0
    data = json.loads(capsys.readouterr().out)
    want = {n: P.POLICIES[n](load_trace(path), 16) for n in ("next_use+bypass", "default")}
    assert [(r["policy"], r["misses"]) for r in data["policies"]] == [(n, w.misses) for n, w in want.items()]
    assert cli_main(["trace", "simulate", str(path), "--slots", "16", "--pcie", "25", "--cpu", "50",
                     "--policies", "lru,belady"]) == 2
    assert "demand policies" in capsys.readouterr().err

    assert cli_main(["trace", "simulate", str(path), "--slots", "16", "--pcie", "25"]) == 2
    assert "needs both --pcie and --cpu" in capsys.readouterr().err
    assert cli_main(["trace", "simulate", str(path), "--slots", "1", "--pcie", "25", "--cpu", "5"]) == 2
    assert "largest active set" in capsys.readouterr().err
    assert cli_main(["trace", "simulate", str(path), "--slots", "16", "--pcie", "-3", "--cpu", "5"]) == 2
    assert "argument --pcie: must be a finite number > 0, got -3" in capsys.readouterr().err
