"""One LRU, three implementations: the trace simulator, the NumPy cache model and the device admission kernel
(emu, and gpu when present) must agree step by step on the same routing, prefill borrows included."""

import numpy as np
import pytest

from freetoken import formats
from freetoken.cache import ExpertCache, HostPool
from freetoken.formats import RecordLayout
from freetoken.sim.policies import lru_replay
from freetoken.testing.reference.cache import CacheModel
from freetoken.trace.synthetic import make_trace

LAYERS, EXPERTS, TOP_K = 3, 8, 2


def _trace(steps):
    return make_trace(num_layers=LAYERS, num_experts=EXPERTS, top_k=TOP_K, steps=steps, segments=3, locality=0.6,
                      seed=11, record_bytes=1, tokens=2, prefill_tokens=16)


def _replay(admit, borrow, trace):
    """Drive ``admit(layer, ids) -> misses`` over the trace, calling ``borrow()`` at each segment start."""
    misses = np.zeros(trace.steps, np.int64)
    prev = None
    for step in range(trace.steps):
        seg = trace.step_segment[step]
        if seg != prev:
            borrow()
            prev = seg
        for layer in range(LAYERS):
            misses[step] += admit(layer, trace.decode_ids[step, layer].astype(np.int32))
    return misses


@pytest.mark.parametrize("slots", [16, 21, 30])
def test_model_matches_simulator(slots):
    trace = _trace(60)
    model = CacheModel(LAYERS, EXPERTS, slots)

    def admit(layer, ids):
        return len(model.admit(layer, ids)[1])

    def borrow():
        model.borrow(0, 0)
        model.borrow(1, EXPERTS)

    got = _replay(admit, borrow, trace)
    want, owners = lru_replay(trace, slots, prefill_borrow=True)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(model.id_of_slot, owners)


@pytest.mark.parametrize("slots", [16, 21])
def test_device_kernel_matches_simulator(cuda_device, slots):
    trace = _trace(25)
    layout = RecordLayout(formats.get("bf16"), 32, 32)
    pool = HostPool(cuda_device, layout, LAYERS, EXPERTS)
    cache = ExpertCache(pool, slots, max_active=2 * TOP_K)

    def admit(layer, ids):
        before = int(cuda_device.to_host(cache.misses).sum())
        cache.admit(layer, cuda_device.asarray(ids))
        cache.copy_missing()
        return int(cuda_device.to_host(cache.misses).sum()) - before

    def borrow():
        cache.begin_prefill()
        for layer in range(2):  # both buffers, as a prefill pass over the layers does
            cache.prefetch_layer(layer)
            cache.wait_layer(layer)
            cache.release_layer(layer)
        cuda_device.synchronize()

    got = _replay(admit, borrow, trace)
    want, owners = lru_replay(trace, slots, prefill_borrow=True)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(cuda_device.to_host(cache.id_of_slot), owners)
    cache.check_invariants()
