"""The scored (next_use) admission on the device (issue 19): ``cache_admit_scored`` (emu: the CUDA source on the
host; cpu: its Numba twin) against the NumPy reference ``ScoredCacheModel`` step by step, and the reference against
the simulator's Numba core (:func:`freetoken.policy.scored.scored_admit`) on the same calls."""

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_cache import _compare, _pool

from freetoken import ops
from freetoken.device.constants import CACHE_BYPASSED, NO_ROUTE
from freetoken.policy import scored as sc
from freetoken.policy.next_use import RECOMMENDED, next_use_device, next_use_new
from freetoken.testing.reference.cache import ScoredCacheModel

LAYERS, EXPERTS, SLOTS = 3, 6, 5
#: the runtime's recommended policy (bypass, long memory), one without bypass nor cycle, and one with decay tables
#: short enough that gaps run past their end (the clamp)
POLICIES = [
    RECOMMENDED,
    {"half_life": 4.0, "bypass": False, "cycle": False},
    {"half_life": 0.05, "long_weight": 0.5, "long_half_life": 0.1, "bypass": True, "rho": 0.3, "kappa": 1.0,
     "prior_weight": 2.0, "prior_keep": 0.25, "long_prior_keep": 0.75},
]
CALL = st.tuples(st.integers(0, LAYERS - 1),
                 st.lists(st.lists(st.integers(-1, EXPERTS - 1), min_size=2, max_size=2), min_size=1, max_size=2))
PRIOR = st.tuples(st.integers(0, LAYERS - 1), st.lists(st.integers(0, 5), min_size=EXPERTS, max_size=EXPERTS),
                  st.sampled_from([1.0, 2.0, 6.0]))  # (layer, prefill counts per expert, k_eff)
SEQ = st.lists(st.one_of(st.tuples(st.just("admit"), CALL), st.tuples(st.just("borrow"), st.integers(0, 1)),
                         st.tuples(st.just("prior"), PRIOR)), min_size=1, max_size=40)


def _scored_state(policy):
    return next_use_new(LAYERS, EXPERTS, SLOTS, **policy)


@settings(max_examples=80, deadline=None)
@given(policy=st.sampled_from(range(len(POLICIES))), seq=SEQ)
def test_reference_equals_the_simulator_core(policy, seq):
    """Every call: the same slot maps, bypassed misses, stamps and statistics (bit for bit) as scored_admit's."""
    model = ScoredCacheModel(LAYERS, EXPERTS, SLOTS, **POLICIES[policy])
    st_ = _scored_state(POLICIES[policy])
    evicted = np.empty(LAYERS * EXPERTS, np.int32)
    for op in seq:
        if op[0] == "borrow":  # a one-slot borrow: scored_borrow's semantics on slot op[1]
            sc.scored_borrow(st_, op[1], 1, evicted)
            f = int(model.id_of_slot[op[1]])
            if f >= 0:
                model.slot_for_id[f] = -1
                model.id_of_slot[op[1]] = -1
            continue
        if op[0] == "prior":
            layer, counts, k_eff = op[1]
            model.prefill(layer, counts, k_eff)
            sc.scored_prefill(st_, layer, np.array(counts, np.float64), k_eff)
            for name, idx in (("last", sc.LAST), ("c1", sc.C1), ("c4", sc.C4)):
                np.testing.assert_array_equal(getattr(model, name), st_[idx], err_msg=name)
            continue
        layer, rows = op[1]
        ids = np.array(rows, np.int32)
        got, work, bypassed = model.admit(layer, ids)
        flat = np.unique(layer * EXPERTS + ids[ids != NO_ROUTE].astype(np.int64)).astype(np.int32)
        before = st_[sc.SLOT_OF].copy()
        m = sc.scored_admit(st_, layer, flat, flat.size, evicted)
        missed = [int(f) for f in flat if before[f] < 0]
        assert m == len(missed)
        assert bypassed == [f for f, e in zip(missed, evicted[:m], strict=True) if e == sc.BYPASSED]
        assert [f for _, f in work] == [f for f, e in zip(missed, evicted[:m], strict=True) if e != sc.BYPASSED]
        np.testing.assert_array_equal(model.slot_for_id, st_[sc.SLOT_OF])
        np.testing.assert_array_equal(model.id_of_slot, st_[sc.OWNER])
        for name, idx in (("last", sc.LAST), ("c1", sc.C1), ("c2", sc.C2), ("c3", sc.C3), ("c4", sc.C4),
                          ("lclock", sc.LCLOCK), ("glob", sc.GLOB)):
            np.testing.assert_array_equal(getattr(model, name), st_[idx], err_msg=name)
        np.testing.assert_array_equal(model.stamp, np.where(st_[sc.STAMP] >= 0, st_[sc.STAMP], -1))
        want = np.where(ids == NO_ROUTE, NO_ROUTE, st_[sc.SLOT_OF][np.where(ids == NO_ROUTE, 0, layer * EXPERTS + ids)])
        want = np.where((ids != NO_ROUTE) & (want < 0), CACHE_BYPASSED, want)
        np.testing.assert_array_equal(got, want)


def test_bypass_happens_in_a_small_cache():
    """A cache of fewer slots than a step's ids with bypass: some misses are bypassed (the test above is not
    vacuous), their pairs marked CACHE_BYPASSED."""
    model = ScoredCacheModel(LAYERS, EXPERTS, SLOTS, **POLICIES[0])
    rng = np.random.default_rng(0)
    n = 0
    for _ in range(60):
        for layer in range(LAYERS):
            ids = rng.integers(0, EXPERTS, (2, 2)).astype(np.int32)
            got, _, bypassed = model.admit(layer, ids)
            n += len(bypassed)
            if bypassed:
                assert (got == CACHE_BYPASSED).sum() >= len(bypassed)
    assert n > 0


def _device_state(dev, model):
    def arr(a):  # a copy: the cpu device may share a NumPy array
        return dev.asarray(np.array(a, copy=True))
    i32, i64 = np.int32, np.int64
    return {"sfi": arr(model.slot_for_id), "ios": arr(model.id_of_slot), "stamp": arr(model.stamp),
            "pin": arr(model.pinned.astype(np.uint8)), "clock": arr(np.zeros(1, i64)), "lclock": arr(model.lclock),
            "last": arr(model.last), **{c: arr(getattr(model, c)) for c in ("c1", "c2", "c3", "c4")},
            "dp": arr(model.dp), "dp2": arr(model.dp2), "glob": arr(model.glob), "consts": model.consts(),
            "work": arr(np.full(2 * LAYERS * EXPERTS, -7, i32)), "n_work": arr(np.zeros(1, i32)),
            "bypass": arr(np.full(LAYERS * EXPERTS, -7, i32)), "n_bypass": arr(np.zeros(1, i32)),
            "hits": arr(np.zeros(LAYERS, i64)), "misses": arr(np.zeros(LAYERS, i64)),
            "bypassed": arr(np.zeros(LAYERS, i64)), "err": arr(np.zeros(1, i32))}


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(policy=st.sampled_from(range(len(POLICIES))), seq=SEQ, pin=st.booleans())
def test_device_equals_the_reference_step_by_step(device, policy, seq, pin):
    dev = device
    model = ScoredCacheModel(LAYERS, EXPERTS, SLOTS, **POLICIES[policy])
    if pin:
        model.pin(2 * EXPERTS + 1, SLOTS - 1)
    d = _device_state(dev, model)
    for op in seq:
        if op[0] == "borrow":  # prefill's borrow, the stamps as its recency
            ops.cache_borrow_layer(op[1], 0, 2, d["sfi"], d["ios"], d["stamp"], d["work"], d["n_work"], device=dev)
            for e in range(2):
                s, f = e, int(model.id_of_slot[e])
                if f >= 0:
                    model.slot_for_id[f] = -1
                model.id_of_slot[s], model.stamp[s] = -1, -1
            continue
        if op[0] == "prior":
            layer, counts, k_eff = op[1]
            model.prefill(layer, counts, k_eff)
            ops.cache_scored_prefill(layer, EXPERTS, dev.asarray(np.array(counts, np.float64)), k_eff, d["lclock"],
                                     d["last"], d["c1"], d["c4"], d["dp"], d["dp2"], d["consts"], device=dev)
            for name in ("last", "c1", "c4"):
                np.testing.assert_array_equal(dev.to_host(d[name]), getattr(model, name), err_msg=name)
            continue
        layer, rows = op[1]
        ids = np.array(rows, np.int32)
        want, work, bypassed = model.admit(layer, ids)
        got = dev.asarray(ids.copy())
        ops.cache_admit_scored(got, layer, EXPERTS, d["sfi"], d["ios"], d["stamp"], d["pin"], d["clock"], d["lclock"],
                               d["last"], d["c1"], d["c2"], d["c3"], d["c4"], d["dp"], d["dp2"], d["glob"],
                               d["consts"], d["work"], d["n_work"], d["bypass"], d["n_bypass"], d["hits"],
                               d["misses"], d["bypassed"], d["err"], device=dev)
        h = dev.to_host
        np.testing.assert_array_equal(h(got), want)
        n = int(h(d["n_work"])[0])
        assert h(d["work"])[:2 * n].reshape(-1, 2).tolist() == [list(w) for w in work]
        nb_ = int(h(d["n_bypass"])[0])
        assert h(d["bypass"])[:nb_].tolist() == bypassed
        for name, attr in (("sfi", "slot_for_id"), ("ios", "id_of_slot"), ("stamp", "stamp"), ("lclock", "lclock"),
                           ("last", "last"), ("c1", "c1"), ("c2", "c2"), ("c3", "c3"), ("c4", "c4"),
                           ("glob", "glob"), ("hits", "hits"), ("misses", "misses"), ("bypassed", "bypassed")):
            np.testing.assert_array_equal(h(d[name]), getattr(model, attr), err_msg=name)
        assert int(h(d["err"])[0]) == 0


# ---- ExpertCache(policy="default") on the emu device ------------------------------------------------------------
C_LAYERS, C_EXPERTS, C_SLOTS, C_ACTIVE = 3, 4, 11, 6  # tests/test_cache.py's pool; 8 slots are prefill's buffers
C_OPS = st.one_of(
    st.tuples(st.just("admit"), st.integers(0, C_LAYERS - 1),
              st.lists(st.lists(st.integers(0, C_EXPERTS - 1), min_size=2, max_size=2), min_size=1, max_size=3)),
    st.tuples(st.just("prefill"), st.integers(1, C_LAYERS)),
    st.tuples(st.just("pin"), st.integers(0, C_LAYERS - 1), st.integers(0, C_EXPERTS - 1)),
    st.tuples(st.just("reset")),
    st.tuples(st.just("prior"), st.integers(0, C_LAYERS - 1),
              st.lists(st.integers(0, 4), min_size=C_EXPERTS, max_size=C_EXPERTS)),
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seq=st.lists(C_OPS, min_size=1, max_size=20), bypass=st.booleans())
def test_expert_cache_default_policy_matches_the_reference(cuda_device, seq, bypass):
    dev = cuda_device
    from freetoken.cache import ExpertCache

    pool, _ = _pool(dev, seed=7)
    params = {**POLICIES[0], "bypass": bypass}
    cache = ExpertCache(pool, C_SLOTS, max_active=C_ACTIVE, policy="default", scratch=0,
                        policy_state=next_use_device(C_LAYERS, C_EXPERTS, C_SLOTS, **params))
    model = ScoredCacheModel(C_LAYERS, C_EXPERTS, C_SLOTS, **params)
    for op in seq:
        if op[0] == "admit":
            _, layer, rows = op
            ids = np.array(rows, np.int32)
            want_ids, want_work, want_bypass = model.admit(layer, ids)
            d_ids = dev.asarray(ids)
            cache.admit(layer, d_ids)
            cache.copy_missing()
            np.testing.assert_array_equal(dev.to_host(d_ids), want_ids)
            n = int(dev.to_host(cache.n_work)[0])
            assert dev.to_host(cache.worklist)[:2 * n].reshape(-1, 2).tolist() == [list(w) for w in want_work]
            nb_ = int(dev.to_host(cache.n_bypass)[0])
            assert dev.to_host(cache.bypass)[:nb_].tolist() == want_bypass
            for name in ("c1", "c4", "glob", "last", "lclock"):
                np.testing.assert_array_equal(dev.to_host(getattr(cache, name)), getattr(model, name), err_msg=name)
        elif op[0] == "prefill":
            cache.begin_prefill()
            for layer in range(op[1]):
                first = cache.prefetch_layer(layer)
                model.borrow(layer, first)
                cache.wait_layer(layer)
                cache.release_layer(layer)
            dev.synchronize()
        elif op[0] == "prior":
            _, layer, counts = op
            cache.prefill_prior(layer, dev.asarray(np.array(counts, np.float64)), 2.0)
            model.prefill(layer, counts, 2.0)
            for name in ("c1", "c4", "last"):
                np.testing.assert_array_equal(dev.to_host(getattr(cache, name)), getattr(model, name), err_msg=name)
        elif op[0] == "pin":
            _, layer, e = op
            f = layer * C_EXPERTS + e
            if model.slot_for_id[f] >= 0 and model.pinned[model.slot_for_id[f]]:
                cache.pin(layer, [e])
            elif model.pinned.sum() >= 3:
                with pytest.raises(ValueError, match="cannot pin more than 3 experts"):
                    cache.pin(layer, [e])
            else:
                cache.pin(layer, [e])
                model.pin(f, C_SLOTS - 1 - int(model.pinned.sum()))
        else:
            cache.reset()
            model.reset()
            model.content[:] = -1
        _compare(cache, model)


def test_expert_cache_default_policy_bypasses_in_a_small_cache(cuda_device):
    """8 slots for 12 records, no prefill buffers: the recommended policy bypasses misses; the pairs, the bypass list
    and the copied bytes stay those of the reference (check_invariants reads every owned slot's bytes)."""
    dev = cuda_device
    from freetoken.cache import ExpertCache

    pool, _ = _pool(dev, seed=7)
    cache = ExpertCache(pool, 8, max_active=C_ACTIVE, policy="default", prefill_overlap=False,
                        scratch=0, policy_state=next_use_device(C_LAYERS, C_EXPERTS, 8))
    model = ScoredCacheModel(C_LAYERS, C_EXPERTS, 8)
    rng = np.random.default_rng(1)
    n = 0
    for t in range(90):
        layer = t % C_LAYERS
        ids = rng.integers(0, C_EXPERTS, (3, 2)).astype(np.int32)
        want, _, bypassed = model.admit(layer, ids)
        n += len(bypassed)
        d = dev.asarray(ids)
        cache.admit(layer, d)
        cache.copy_missing()
        np.testing.assert_array_equal(dev.to_host(d), want)
        assert dev.to_host(cache.bypass)[:int(dev.to_host(cache.n_bypass)[0])].tolist() == bypassed
    assert n > 0
    stats = cache.stats()
    assert stats["bypassed"] == n == int(model.bypassed.sum())
    assert stats["bytes_copied"] == (stats["misses"] - n) * cache.record_bytes
    cache.check_invariants()
    cache.check_errors()


@pytest.mark.parametrize("scratch, place", [(None, False), (1, False), (None, True)])
def test_bypassed_misses_stream_through_scratch_slots(cuda_device, scratch, place):
    """The same small cache with streaming (the runtime's way): every pair, bypassed or not, points at a slot whose
    bytes are its own record's (scratch slots past the 8 for bypassed misses, which stay out of the cache), the
    statistics count every miss as copied, and the admission itself is the reference's (with one scratch slot, a
    call bypasses at most one miss and admits the others). ``place``: the hybrid split's way, every other call's
    bypassed misses but the last streamed and the last left to the CPU (its pairs NO_ROUTE, its bytes not copied)."""
    dev = cuda_device
    from freetoken.cache import ExpertCache

    pool, _ = _pool(dev, seed=7)
    cache = ExpertCache(pool, 8, max_active=C_ACTIVE, policy="default", prefill_overlap=False, scratch=scratch,
                        policy_state=next_use_device(C_LAYERS, C_EXPERTS, 8))
    assert cache.scratch == (min(C_ACTIVE, C_EXPERTS) if scratch is None else scratch)
    model = ScoredCacheModel(C_LAYERS, C_EXPERTS, 8)
    rng = np.random.default_rng(1)
    streamed = elsewhere = 0
    for t in range(90):
        layer = t % C_LAYERS
        ids = rng.integers(0, C_EXPERTS, (3, 2)).astype(np.int32)
        ids[t % 3, 1] = NO_ROUTE if t % 7 == 0 else ids[t % 3, 1]
        want, _, bypassed = model.admit(layer, ids, max_bypass=cache.scratch)
        assert len(bypassed) <= cache.scratch
        d = dev.asarray(ids.copy())  # emu's asarray may share the buffer: admission rewrites it
        cache.admit(layer, d, stream_bypassed=not place)
        marked = want == CACHE_BYPASSED
        if place:
            listed = cache.bypassed_ids()
            assert listed.tolist() == bypassed
            cut = len(listed) - (1 if t % 2 and len(listed) else 0)
            cache.place_bypassed(listed[:cut], listed[cut:])
            elsewhere += len(listed) - cut
            cpu = np.isin(layer * C_EXPERTS + ids, listed[cut:]) & marked
            marked &= ~cpu
            want = np.where(cpu, NO_ROUTE, want)
        cache.copy_missing()
        got = dev.to_host(d)
        np.testing.assert_array_equal(got[want >= 0], want[want >= 0])  # admitted pairs: the reference's slots
        assert (got[want == NO_ROUTE] == NO_ROUTE).all()
        streamed += int(marked.sum())
        assert ((got[marked] >= 8) & (got[marked] < 8 + cache.scratch)).all()
        for (tok, j), s in np.ndenumerate(got):
            if s == NO_ROUTE:
                continue
            flat = layer * C_EXPERTS + int(ids[tok, j])
            for name, host in cache.pool.record(flat).items():
                row = dev.to_host(cache.slot_banks[name][int(s)])
                assert np.array_equal(np.ascontiguousarray(row).view(np.uint8), host.view(np.uint8)), (t, tok, j)
    assert streamed > 0
    stats = cache.stats()
    assert stats["bypassed"] == int(model.bypassed.sum()) > 0
    assert (elsewhere > 0) == place and int(cache.served_elsewhere.sum()) == elsewhere
    assert stats["bytes_copied"] == (stats["misses"] - elsewhere) * cache.record_bytes
    cache.check_invariants()
    cache.check_errors()


# ---- a whole trace: ExpertCache(policy="default") on emu == the simulator's `default` row -------------------------
@pytest.mark.parametrize("layers,experts,slots,tokens", [(3, 8, 16, 1), (3, 8, 19, 2), (8, 4, 9, 2), (8, 4, 12, 1)])
def test_expert_cache_replays_a_trace_as_the_simulator(cuda_device, layers, experts, slots, tokens):
    """A synthetic trace (segments with prefill; the 8 x 4 ones in caches smaller than a step's accesses, where
    bypass acts: 2082 misses, 147 loads) through ExpertCache(policy="default") on emu,
    as the runtime would drive it (each segment: prefill borrows both buffers, then the prefill prior of every layer;
    then each step's layers admitted in order): its misses and loads per decode step equal the simulator's replay of
    the same policy (freetoken/sim/policies.py scored_replay, the `default` row's engine)."""
    dev = cuda_device
    from freetoken import formats
    from freetoken.cache import ExpertCache, HostPool
    from freetoken.formats import RecordLayout
    from freetoken.sim.policies import scored_replay
    from freetoken.trace.synthetic import make_trace

    trace = make_trace(num_layers=layers, num_experts=experts, top_k=2, steps=160, segments=3, seed=3, tokens=tokens,
                       prefill_tokens=32)
    want_misses, want_loads = scored_replay(trace, slots, next_use_new(layers, experts, slots, **RECOMMENDED))
    pool = HostPool(dev, RecordLayout(formats.get("q4_0"), 64, 32), layers, experts)
    cache = ExpertCache(pool, slots, max_active=tokens * 2, policy="default",
                        policy_state=next_use_device(layers, experts, slots))
    prefill = np.ascontiguousarray(trace.prefill_counts, np.float64)
    k_eff = float(trace.tokens * trace.top_k)
    seg = trace.step_segment
    got_misses, got_loads = [], []
    for t in range(trace.steps):
        if t == 0 or seg[t] != seg[t - 1]:
            cache.begin_prefill()
            for layer in range(layers):
                cache.prefetch_layer(layer)
                cache.wait_layer(layer)
                cache.release_layer(layer)
            for layer in range(layers):
                cache.prefill_prior(layer, dev.asarray(prefill[seg[t], layer]), k_eff)
        before = cache.stats()
        for layer in range(layers):
            cache.admit(layer, dev.asarray(np.ascontiguousarray(trace.decode_ids[t, layer], np.int32)))
            cache.copy_missing()
        after = cache.stats()
        got_misses.append(after["misses"] - before["misses"])
        got_loads.append(got_misses[-1] - (after["bypassed"] - before["bypassed"]))
    cache.check_errors()
    np.testing.assert_array_equal(got_misses, want_misses)
    np.testing.assert_array_equal(got_loads, want_loads)
    assert want_misses.sum() > 0


def test_expert_cache_default_policy_needs_its_state(cuda_device):
    dev = cuda_device
    from freetoken.cache import ExpertCache

    pool, _ = _pool(dev, seed=7)
    with pytest.raises(ValueError, match="needs policy_state"):
        ExpertCache(pool, C_SLOTS, max_active=C_ACTIVE, policy="default")
    with pytest.raises(ValueError, match="policy_state is for 3 x 4 ids and 12 slots"):
        ExpertCache(pool, C_SLOTS, max_active=C_ACTIVE, policy="default",
                    policy_state=next_use_device(C_LAYERS, C_EXPERTS, 12))
    with pytest.raises(ValueError, match="unknown cache policy"):
        ExpertCache(pool, C_SLOTS, max_active=C_ACTIVE, policy="next_use")
