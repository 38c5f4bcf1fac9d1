"""The expert cache on the emu (and gpu) device against the NumPy state machine."""

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from freetoken import formats
from freetoken.cache import CacheError, ExpertCache, HostPool
from freetoken.formats import RecordLayout
from freetoken.ops.moe_experts import moe_experts
from freetoken.testing import assert_close
from freetoken.testing.reference.cache import CacheModel
from freetoken.testing.reference.moe_experts import moe_forward_reference

LAYERS, EXPERTS, SLOTS, MAX_ACTIVE = 3, 4, 11, 6
LAYOUT = RecordLayout(formats.get("q4_0"), 64, 32)


def _pool(device, seed=0):
    rng = np.random.default_rng(seed)
    pool = HostPool(device, LAYOUT, LAYERS, EXPERTS)
    weights = {}
    for layer in range(LAYERS):
        gate, up = (rng.standard_normal((EXPERTS, 32, 64), np.float32) * 0.2 for _ in range(2))
        down = rng.standard_normal((EXPERTS, 64, 32), np.float32) * 0.2
        banks = LAYOUT.quantize(gate, up, down)
        pool.write_layer(layer, banks)
        weights[layer] = LAYOUT.dequantize(banks)
    return pool, weights


@pytest.fixture
def pool(cuda_device):
    return _pool(cuda_device)


def test_refuses_sizes_that_cannot_work(pool):
    p, _ = pool
    with pytest.raises(ValueError, match="prefill overlap needs 2 x 4 experts = 8 slots"):
        ExpertCache(p, 7, max_active=4)
    with pytest.raises(ValueError, match="one step can route 4 distinct experts"):  # 9 pairs, but E = 4
        ExpertCache(p, 3, max_active=9, prefill_overlap=False)
    cache = ExpertCache(p, 10, max_active=2)
    cache.pin(0, [0])
    with pytest.raises(ValueError, match="cannot pin more than 2 experts"):
        cache.pin(0, [1, 2])


def test_decode_hits_misses_and_rewrite(pool):
    p, _ = pool
    dev = p.device
    cache = ExpertCache(p, SLOTS, max_active=MAX_ACTIVE)
    ids = dev.asarray(np.array([[1, 3], [3, 1]], np.int32))
    cache.admit(0, ids)
    cache.copy_missing()
    assert dev.to_host(ids).tolist() == [[0, 1], [1, 0]]  # misses in id order take empty slots 0, 1
    ids2 = dev.asarray(np.array([[3, 2]], np.int32))
    cache.admit(0, ids2)
    cache.copy_missing()
    assert dev.to_host(ids2).tolist() == [[1, 2]]
    s = cache.stats()
    assert (s["hits"], s["misses"]) == (1, 3)
    assert s["bytes_copied"] == 3 * LAYOUT.record_bytes
    cache.check_invariants()


def test_out_of_range_id_is_reported(pool):
    p, _ = pool
    cache = ExpertCache(p, SLOTS, max_active=MAX_ACTIVE)
    cache.admit(0, p.device.asarray(np.array([[EXPERTS]], np.int32)))
    with pytest.raises(CacheError, match="out of range"):
        cache.check_errors()


def test_hostile_prefill_then_decode_reloads_the_right_bytes(pool):
    """Decode layer 0; prefill borrows every buffer slot; decode layer 0 again must miss and read layer 0."""
    p, weights = pool
    dev = p.device
    cache = ExpertCache(p, 2 * EXPERTS, max_active=4)
    rng = np.random.default_rng(3)
    x = rng.standard_normal((1, 64)).astype(np.float32)
    w = np.array([[0.6, 0.4]], np.float32)

    def decode_layer0(experts):
        ids = dev.asarray(np.array([experts], np.int32))
        cache.admit(0, ids)
        cache.copy_missing()
        y = moe_experts(dev.asarray(x), ids, dev.asarray(w), cache.slot_banks, LAYOUT, mode="decode", device=dev)
        want = moe_forward_reference(x, np.array([experts]), w, weights[0])
        assert_close(dev.to_host(y), want, atol=1e-5, rtol=1e-5)

    decode_layer0([0, 1])
    assert cache.stats()["misses"] == 2
    cache.begin_prefill()
    cache.prefetch_layer(0)
    for layer in range(LAYERS):
        if layer + 1 < LAYERS:
            cache.prefetch_layer(layer + 1)
        first = cache.wait_layer(layer)
        ids = dev.asarray(np.array([[0, 3]], np.int32) + first)
        y = moe_experts(dev.asarray(x), ids, dev.asarray(w), cache.slot_banks, LAYOUT, mode="prefill", device=dev)
        want = moe_forward_reference(x, np.array([[0, 3]]), w, weights[layer])
        assert_close(dev.to_host(y), want, atol=2e-2, rtol=2e-2)  # prefill: bf16 inputs
        cache.release_layer(layer)
    dev.synchronize()
    cache.check_invariants()
    decode_layer0([0, 1])  # the borrowed slots lost layer 0: both miss and reload from the host pool
    assert cache.stats()["misses"] == 4 and cache.stats()["hits"] == 0
    cache.check_invariants()


def test_pinned_experts_are_never_evicted(pool):
    p, _ = pool
    dev = p.device
    cache = ExpertCache(p, SLOTS, max_active=MAX_ACTIVE)
    cache.pin(2, [3])
    pinned_slot = SLOTS - 1
    rng = np.random.default_rng(0)
    for _ in range(30):
        layer = int(rng.integers(LAYERS))
        ids = dev.asarray(rng.integers(0, EXPERTS, (3, 2)).astype(np.int32))
        cache.admit(layer, ids)
        cache.copy_missing()
    assert int(dev.to_host(cache.id_of_slot)[pinned_slot]) == 2 * EXPERTS + 3
    cache.check_invariants()


# ---- random sequences against the reference --------------------------------------------------------------
OPS = st.one_of(
    st.tuples(st.just("admit"), st.integers(0, LAYERS - 1),
              st.lists(st.lists(st.integers(0, EXPERTS - 1), min_size=2, max_size=2), min_size=1, max_size=3)),
    st.tuples(st.just("prefill"), st.integers(1, LAYERS)),
    st.tuples(st.just("pin"), st.integers(0, LAYERS - 1), st.integers(0, EXPERTS - 1)),
    st.tuples(st.just("reset")),
)


def _compare(cache, model):
    dev = cache.device
    np.testing.assert_array_equal(dev.to_host(cache.slot_for_id), model.slot_for_id)
    np.testing.assert_array_equal(dev.to_host(cache.id_of_slot), model.id_of_slot)
    np.testing.assert_array_equal(dev.to_host(cache.recency), model.recency)
    np.testing.assert_array_equal(dev.to_host(cache.pinned).astype(bool), model.pinned)
    np.testing.assert_array_equal(dev.to_host(cache.hits), model.hits)
    np.testing.assert_array_equal(dev.to_host(cache.misses), model.misses)
    for name, bank in cache.slot_banks.items():
        rows = dev.to_host(bank)
        for s in np.nonzero(model.content >= 0)[0]:
            assert np.array_equal(rows[s], cache.pool.host(name)[model.content[s]]), f"slot {s} bank {name}"
    cache.check_invariants()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=st.lists(OPS, min_size=1, max_size=20))
def test_random_sequences_match_the_reference(cuda_device, ops):
    pool, _ = _pool(cuda_device, seed=7)
    dev = pool.device
    cache = ExpertCache(pool, SLOTS, max_active=MAX_ACTIVE)
    model = CacheModel(LAYERS, EXPERTS, SLOTS)
    for op in ops:
        if op[0] == "admit":
            _, layer, rows = op
            ids = np.array(rows, np.int32)
            want_ids, want_work = model.admit(layer, ids)
            d_ids = dev.asarray(ids)
            cache.admit(layer, d_ids)
            cache.copy_missing()
            np.testing.assert_array_equal(dev.to_host(d_ids), want_ids)
            n = int(dev.to_host(cache.n_work)[0])
            assert dev.to_host(cache.worklist)[:2 * n].reshape(-1, 2).tolist() == [list(w) for w in want_work]
        elif op[0] == "prefill":
            cache.begin_prefill()
            for layer in range(op[1]):
                first = cache.prefetch_layer(layer)
                model.borrow(layer, first)
                cache.wait_layer(layer)
                cache.release_layer(layer)
            dev.synchronize()
        elif op[0] == "pin":
            _, layer, e = op
            f = layer * EXPERTS + e
            if model.slot_for_id[f] >= 0 and model.pinned[model.slot_for_id[f]]:
                cache.pin(layer, [e])  # already pinned: nothing changes
            elif model.pinned.sum() >= 3:  # slots 8..10: the first 2E = 8 slots belong to prefill
                with pytest.raises(ValueError, match="cannot pin more than 3 experts"):
                    cache.pin(layer, [e])
            else:
                cache.pin(layer, [e])
                model.pin(f, SLOTS - 1 - int(model.pinned.sum()))
        else:
            cache.reset()
            model.reset()
            model.content[:] = -1
        _compare(cache, model)
