"""The policy core (freetoken.policy.lru, .estimators, .split_policy): the Numba LRU against the NumPy cache model,
MissPolicy's shadow against a real ExpertCache on the emu (and gpu) device, and the runtime split against the
simulator's on the same trace."""

from __future__ import annotations

import numpy as np
import pytest

from freetoken import formats
from freetoken.cache import ExpertCache, HostPool
from freetoken.formats import RecordLayout
from freetoken.policy.lru import (
    OWNER,
    SLOT_OF,
    lru_admit,
    lru_borrow,
    lru_end,
    lru_insert,
    lru_lookup,
    lru_new,
    lru_order,
    lru_pin,
)
from freetoken.policy.qstar import StepCosts
from freetoken.policy.qstar import split as qstar_split
from freetoken.policy.split_policy import DEFAULT_FUTURE_VALUE, MissPolicy
from freetoken.sim import timing as TM
from freetoken.testing.reference.cache import CacheModel
from freetoken.trace import make_trace, prepare, token_counts


def _victim_order(model: CacheModel) -> list[int]:
    """The reference's unpinned slots by (recency, slot): the order victims are taken in."""
    free = [s for s in range(model.slots) if not model.pinned[s]]
    return sorted(free, key=lambda s: (int(model.recency[s]), s))


@pytest.mark.parametrize("seed", range(6))
def test_lru_matches_the_numpy_cache_model(seed):
    """Random admissions, prefill borrows and pins: same owners, maps and victim order after every operation."""
    rng = np.random.default_rng(seed)
    L, E = 3, 5
    slots = 2 * E + int(rng.integers(3, 8))
    model = CacheModel(L, E, slots)
    st = lru_new(L * E, slots)
    ev = np.empty(16, np.int32)
    scratch = np.empty(16, np.int32)
    pins = 0
    for _ in range(300):
        op = rng.random()
        if op < 0.08:
            layer, first = int(rng.integers(L)), int(rng.integers(2)) * E
            model.borrow(layer, first)
            lru_borrow(st, first, E, ev)
        elif op < 0.12 and pins < slots - 2 * E - 3:
            f = int(rng.integers(L * E))
            if model.slot_for_id[f] >= 0 and model.pinned[model.slot_for_id[f]]:
                assert lru_pin(st, f) == -2
                continue
            model.pin(f, slots - 1 - pins)
            lru_pin(st, f)
            pins += 1
        else:
            layer = int(rng.integers(L))
            experts = rng.choice(E, int(rng.integers(1, 4)), replace=False)
            _, work = model.admit(layer, experts[None])
            ids = np.sort(experts + layer * E).astype(np.int32)
            m = lru_admit(st, ids, ids.size, scratch, ev)
            assert m == len(work)
        np.testing.assert_array_equal(st[OWNER], model.id_of_slot)
        np.testing.assert_array_equal(st[SLOT_OF], model.slot_for_id)
        assert lru_order(st).tolist() == _victim_order(model)


def test_lru_split_call_and_protected_previous_call():
    """lookup / insert / end as one call equal lru_admit; protect_previous spares the call before."""
    a, b = lru_new(20, 6), lru_new(20, 6)
    ev = np.empty(8, np.int32)
    sl = np.empty(8, np.int32)
    for ids in ([1, 2], [3, 4, 5], [2, 6], [7, 8, 9]):
        ids = np.asarray(ids, np.int32)
        lru_admit(a, ids, ids.size, np.empty(8, np.int32), ev)
        lru_lookup(b, ids, ids.size, sl)
        miss = ids[sl[: ids.size] < 0]
        assert lru_insert(b, miss, miss.size, False, ev) == miss.size
        lru_end(b)
        np.testing.assert_array_equal(a[OWNER], b[OWNER])
    # the last call used slots of 7, 8, 9; a call inserting 3 ids with protect_previous must not take them
    lru_lookup(a, np.zeros(0, np.int32), 0, sl)
    assert lru_insert(a, np.asarray([10, 11, 12], np.int32), 3, True, ev) == 3
    lru_end(a)
    owners = set(a[OWNER].tolist())
    assert {7, 8, 9} <= owners and {10, 11, 12} <= owners
    lru_lookup(a, np.zeros(0, np.int32), 0, sl)  # 6 slots, 3 protected (10, 11, 12): only 3 victims
    assert lru_insert(a, np.asarray([13, 14, 15, 16], np.int32), 4, True, ev) == 3
    lru_end(a)


# ------------------------------------------------------------------------------ MissPolicy vs the device cache

LAYERS, EXPERTS, MAX_ACTIVE = 3, 4, 4
LAYOUT = RecordLayout(formats.get("q4_0"), 64, 32)


def _pool(device):
    rng = np.random.default_rng(0)
    pool = HostPool(device, LAYOUT, LAYERS, EXPERTS)
    for layer in range(LAYERS):
        gate, up = (rng.standard_normal((EXPERTS, 32, 64), np.float32) * 0.2 for _ in range(2))
        down = rng.standard_normal((EXPERTS, 64, 32), np.float32) * 0.2
        pool.write_layer(layer, LAYOUT.quantize(gate, up, down))
    return pool


def test_miss_policy_shadows_the_device_cache(cuda_device):
    """The same admissions (decode calls, prefetches with count=False), prefill borrows and pins on a real
    ExpertCache and on MissPolicy: the shadow's slot owners equal the device's after every call."""
    dev = cuda_device
    cache = ExpertCache(_pool(dev), 2 * EXPERTS + 5, max_active=MAX_ACTIVE)
    policy = MissPolicy.for_cache(cache)
    rng = np.random.default_rng(1)

    def check():
        dev.synchronize()
        np.testing.assert_array_equal(policy.id_of_slot, dev.to_host(cache.id_of_slot))
        sfi = dev.to_host(cache.slot_for_id).reshape(LAYERS, EXPERTS)
        for layer in range(LAYERS):
            np.testing.assert_array_equal(policy.resident(layer, np.arange(EXPERTS)), sfi[layer] >= 0)

    def admit(layer, ids, count=True):
        cache.admit(layer, dev.asarray(np.asarray(ids, np.int32)), count=count)
        cache.copy_missing()
        policy.admitted(layer, ids, count=count)
        check()

    for step in range(40):
        if step in (10, 25):  # a prefill pass: every layer streamed through the two borrowed buffers
            cache.begin_prefill()
            policy.begin_prefill() if step == 10 else None
            for layer in range(LAYERS):
                cache.prefetch_layer(layer)
                if step == 25:
                    policy.prefill_layer(layer)
                cache.wait_layer(layer)
                cache.release_layer(layer)
            check()
        if step == 15:
            cache.pin(1, [2])
            policy.pin(1, [2])
            check()
        if step == 30:
            cache.pin(0, [0, 3])
            policy.pin(0, [0, 3])
            check()
        for layer in range(LAYERS):
            ids = rng.integers(0, EXPERTS, (2, 2))
            experts, counts = np.unique(ids, return_counts=True)
            on_gpu = policy.split(layer, experts, counts, StepCosts(transfer_s=2e-5, cpu_s=1e-5, gpu_s=1e-6,
                                                                     cpu_handoff_s=5e-6))
            assert on_gpu[policy.resident(layer, experts)].all()
            keep = experts[on_gpu]
            if keep.size:
                admit(layer, np.resize(keep, 4)[None])  # with duplicates, as routed pairs have
            if layer + 1 < LAYERS and step % 3 == 0:  # a prefetch of the next layer's prediction
                admit(layer + 1, rng.choice(EXPERTS, 2, replace=False)[None], count=False)
        policy.end_step()
    cache.check_invariants()


def test_miss_policy_pin_capacity_matches_the_cache(cuda_device):
    """Pins one at a time until the cache refuses: the shadow refuses the same one and agrees on every slot."""
    cache = ExpertCache(_pool(cuda_device), 2 * EXPERTS + 5, max_active=MAX_ACTIVE)
    policy = MissPolicy.for_cache(cache)
    refused = 0
    for layer, e in [(0, 0), (0, 0), (1, 2), (2, 3), (1, 0), (0, 1), (2, 2), (2, 1)]:
        outcome = []
        for target in (cache, policy):
            try:
                target.pin(layer, [e])
                outcome.append(True)
            except ValueError:
                outcome.append(False)
        assert outcome[0] == outcome[1]
        refused += not outcome[0]
        np.testing.assert_array_equal(policy.id_of_slot, cuda_device.to_host(cache.id_of_slot))
    assert refused == 2  # 5 pins fit: 13 slots keep 2E = 8 for prefill


# ------------------------------------------------------------------------------ the split: runtime = simulator


def _replay_runtime(trace, slots, costs, future_value):
    """MissPolicy driven through a trace as the q* runner would: per call split, admit the GPU share."""
    p = prepare(trace)
    tok = token_counts(trace)
    E = trace.num_experts
    policy = MissPolicy(trace.num_layers, E, slots, future_value=future_value)
    hits = np.zeros(trace.steps, np.int64)
    fetched = np.zeros(trace.steps, np.int64)
    for t in range(trace.steps):
        if p.seg_start[t]:
            policy.begin_prefill()
        for layer in range(trace.num_layers):
            n = p.counts[t, layer]
            experts = p.active[t, layer, :n] - layer * E
            resident = policy.resident(layer, experts)
            on_gpu = policy.split(layer, experts, tok[t, layer, :n], costs)
            hits[t] += resident.sum()
            fetched[t] += (on_gpu & ~resident).sum()
            policy.admitted(layer, experts[on_gpu])
        policy.end_step()
    return hits, fetched


@pytest.mark.parametrize("future_value", ["auto", "global", 0.0, 2e-5])
@pytest.mark.parametrize("tokens", [1, 3])
def test_runtime_split_equals_the_simulator(future_value, tokens):
    """MissPolicy's decisions over a trace equal the time model's qstar mode: same hits and fetches per step."""
    trace = make_trace(num_layers=3, num_experts=16, top_k=4, steps=120, segments=3, locality=0.4, seed=5,
                       tokens=tokens, record_bytes=1 << 20)
    slots = 2 * trace.num_experts + 5
    costs = StepCosts.from_bandwidths(trace.record_bytes, 15.0, 40.0)
    acc = TM.run_kernel(trace, "qstar", slots, costs, future_value=future_value, layer_s=0.0, step_s=0.0,
                        pred=None, prefill_borrow=True)
    hits, fetched = _replay_runtime(trace, slots, costs, future_value)
    fields = list(TM.FIELDS)
    np.testing.assert_array_equal(hits, acc[fields.index("hits")].astype(np.int64))
    np.testing.assert_array_equal(fetched, acc[fields.index("fetched")].astype(np.int64))
    if not isinstance(future_value, str):  # a real split: some misses fetched, some on the CPU
        assert 0 < fetched.sum() < acc[fields.index("misses")].sum()


def test_split_with_a_fixed_value_is_qstar_split():
    """On a fresh shadow (no history: every reuse score equal) the runtime split is qstar.split over the misses."""
    rng = np.random.default_rng(2)
    for _ in range(50):
        fv = float(rng.random() * 3e-5)
        policy = MissPolicy(2, 16, 40, future_value=fv)
        policy.admitted(0, rng.choice(16, 5, replace=False))
        experts = np.sort(rng.choice(16, int(rng.integers(1, 10)), replace=False))
        tokens = rng.integers(1, 4, experts.size)
        costs = StepCosts(transfer_s=float(rng.random() * 1e-4), cpu_s=float(rng.random() * 1e-4),
                          gpu_s=float(rng.random() * 1e-5), cpu_handoff_s=float(rng.random() * 3e-5))
        res = policy.resident(0, experts)
        got = policy.split(0, experts, tokens, costs)
        want = np.ones(experts.size, bool)
        miss = ~res
        if miss.any():
            # the admitted experts were routed at step 0 (reuse 0), the others never (-1): that is the tie-break
            want[miss] = qstar_split(costs, experts[miss], int(res.sum()), fv, tokens[miss],
                                     reuse=np.full(int(miss.sum()), -1.0))
        np.testing.assert_array_equal(got, want)


def test_miss_policy_arguments():
    assert DEFAULT_FUTURE_VALUE in ("auto", "global") or isinstance(DEFAULT_FUTURE_VALUE, float)
    with pytest.raises(ValueError):
        MissPolicy(2, 4, 12, future_value="sometimes")
    policy = MissPolicy(2, 4, 12)
    with pytest.raises(IndexError):
        policy.resident(2, [0])
    with pytest.raises(ValueError):
        policy.admitted(0, [4])
    small = MissPolicy(1, 4, 2, prefill_borrow=False)
    with pytest.raises(ValueError, match="no slot left"):
        small.admitted(0, [0, 1, 2])
