"""The expert runners without a model: random expert records, routed ids drawn per call, every mode's output equal
to the routed-expert op over the layer's whole banks; counters, pinning, prefetch and its scoring. Every runner test
runs on records of one layout and on layers of different layouts (one cache's slots hold them all)."""

import numpy as np
import pytest

from freetoken import formats, ops
from freetoken.engine.experts import CachedExperts, HostExperts, make_runner
from freetoken.engine.experts.prefetch import NextLayerPrefetch
from freetoken.engine.options import ExpertOptions
from freetoken.formats import RecordLayout
from freetoken.testing import random_record

LAYERS, EXPERTS, TOP_K, HIDDEN, INTER = 3, 8, 2, 64, 32


#: Per-layer record formats: (gate/up, down) of each layer. "mixed": as a GGUF Q4_K_M file has them, a down matrix
#: in another format than gate/up in some layers, and layers of different record sizes sharing the slots.
LAYER_FORMATS = {"uniform": [("q4_0", "q4_0")] * LAYERS,
                 "mixed": [("q4_0", "mxfp4"), ("q4_0", "q4_0"), ("mxfp4", "bf16")]}


@pytest.fixture(scope="module", params=sorted(LAYER_FORMATS))
def records(request):
    layouts = [RecordLayout(formats.get(up), HIDDEN, INTER, down_fmt=formats.get(down))
               for up, down in LAYER_FORMATS[request.param]]
    return layouts, [random_record(lay, EXPERTS, seed=layer) for layer, lay in enumerate(layouts)]


def _calls(seed=0, steps=6, tokens=1):
    """(layer, h, ids, weights) of ``steps`` decode steps over every layer: each token's top-k distinct."""
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        for layer in range(LAYERS):
            ids = np.stack([rng.permutation(EXPERTS)[:TOP_K] for _ in range(tokens)]).astype(np.int32)
            yield (layer, rng.standard_normal((tokens, HIDDEN)).astype(np.float32), ids,
                   rng.random((tokens, TOP_K)).astype(np.float32))


def _runner(device, records, **opts):
    """float32 activations on the CPU too (unless ``opts`` say otherwise): the op on gpu/emu reads float inputs, so a
    CPU share computing misses must as well for the outputs to agree to float rounding."""
    layouts, banks = records
    opts.setdefault("cpu_activations", "f32")
    runner = make_runner(device, layouts, LAYERS, EXPERTS, TOP_K, ExpertOptions(max_decode_tokens=2, **opts))
    for layer, b in enumerate(banks):
        runner.load_layer(layer, b)
    return runner


def _check_against_op(device, runner, records, calls, rtol=1e-5):
    layouts, banks = records
    host = [{k: device.asarray(v) for k, v in b.items()} for b in banks]
    for layer, h, ids, w in calls:
        runner.begin(h.shape[0])
        got = device.to_host(runner.run(layer, device.asarray(h), device.asarray(ids), device.asarray(w)))
        runner.end()
        want = device.to_host(ops.moe_experts(device.asarray(h), device.asarray(ids), device.asarray(w), host[layer],
                                              layouts[layer], device=device, activations="f32"))
        np.testing.assert_allclose(got, want, rtol=rtol, atol=rtol * np.abs(want).max())


def test_host_runner_is_the_op(records):
    from freetoken.device import get_device

    dev = get_device("cpu")
    runner = _runner(dev, records)
    assert isinstance(runner, HostExperts) and runner.counters() == {}
    _check_against_op(dev, runner, records, _calls())


@pytest.mark.parametrize("mode", ["gpu", "cpu", "hybrid"])
def test_cached_runner_equals_the_op(cuda_device, records, mode):
    """12 slots for 24 records: decode admissions hit and miss; cpu/hybrid compute misses on the CPU."""
    runner = _runner(cuda_device, records, cache_slots=16, mode=mode, pcie_gbps=1.0, cpu_gbps=100.0)  # CPU wins
    assert isinstance(runner, CachedExperts) and runner.mode == mode
    _check_against_op(cuda_device, runner, records, _calls(tokens=2))
    c = runner.counters()
    if mode == "gpu":
        assert c["cache_misses"] > 0 and c["cache_hits"] > 0 and "split_cpu" not in c
    else:
        assert c["split_cpu"] > 0
        assert mode != "cpu" or c["split_fetched"] == 0 == c["cache_misses"]  # cpu: nothing becomes resident
    runner.cache.check_invariants()
    if runner.split is not None:  # the split's host shadow of the cache never read the device, yet agrees with it
        np.testing.assert_array_equal(runner.split.shadow.id_of_slot, cuda_device.to_host(runner.cache.id_of_slot))
    runner.reset()  # as freshly loaded
    assert all(v == 0 for v in runner.counters().values())
    runner.close()


def test_a_prompt_streams_whole_layers(cuda_device, records):
    runner = _runner(cuda_device, records, cache_slots=16)
    calls = [c for c in _calls(tokens=5, steps=1)]  # 5 tokens x top-2 > 2 x 2 pairs: streamed
    layouts, banks = records
    runner.begin(5)
    assert runner.streaming
    for layer, h, ids, w in calls:
        got = cuda_device.to_host(runner.run(layer, cuda_device.asarray(h), cuda_device.asarray(ids),
                                             cuda_device.asarray(w)))
        want = ops.moe_experts(h, ids, w, banks[layer], layouts[layer], device="cpu")
        np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-2 * np.abs(want).max())  # bf16 prefill inputs
    runner.end()
    assert runner.cache.prefill_bytes == EXPERTS * sum(lay.record_bytes for lay in layouts)
    assert [np.asarray(cuda_device.to_host(r)).tolist() for r in runner.last_routing] == \
        [ids.tolist() for _, _, ids, _ in calls]


def test_prefetch_with_a_perfect_predictor_turns_misses_into_hits(cuda_device, records):
    calls = list(_calls(seed=3, steps=4))
    next_ids = {}  # (step, layer) -> ids: the predictor knows the next call's routing

    def predict(layer, h):
        return cuda_device.asarray(next_ids[layer]), None

    runner = _runner(cuda_device, records, cache_slots=16, prefetch=True)
    runner.set_predictor(predict)
    for i, (layer, h, ids, w) in enumerate(calls):
        if i + 1 < len(calls) and calls[i + 1][0] == layer + 1:
            next_ids[layer + 1] = calls[i + 1][2]
        if layer == 0:
            runner.begin(1)
        runner.run(layer, cuda_device.asarray(h), cuda_device.asarray(ids), cuda_device.asarray(w))
    st = runner.prefetch.stats
    assert st["predicted"] == st["correct"] > 0  # every prediction right
    c = runner.counters()
    assert c["cache_misses"] <= EXPERTS  # only layer 0's admissions can miss... within what fits
    runner.cache.check_invariants()


def test_split_shadow_follows_prefill_prefetch_and_pins(cuda_device, records):
    """hybrid with prefetch and pinned experts, prompts streamed between decode steps: after every call the split's
    shadow owns the slots the device cache owns."""
    runner = _runner(cuda_device, records, cache_slots=20, mode="hybrid", pcie_gbps=0.01, cpu_gbps=100.0,
                     prefetch=True)
    runner.set_predictor(lambda layer, h: (cuda_device.asarray(np.array([[layer, layer + 1]], np.int32)), None))
    counts = np.zeros((LAYERS, EXPERTS), np.int64)
    counts[1, 3], counts[2, 6] = 5, 4
    assert runner.pin_hot(counts, 2) == [(1, 3), (2, 6)]
    shadow = runner.split.shadow
    for step, (layer, h, ids, w) in enumerate(_calls(seed=5, steps=8)):
        if layer == 0:
            runner.end()
            if step % 9 == 0:  # a prompt now and then: whole layers borrow the prefill buffers
                runner.begin(5)
                for lay, hp, idp, wp in _calls(seed=step, steps=1, tokens=5):
                    runner.run(lay, cuda_device.asarray(hp), cuda_device.asarray(idp), cuda_device.asarray(wp))
                runner.end()
            runner.begin(1)
        runner.run(layer, cuda_device.asarray(h), cuda_device.asarray(ids), cuda_device.asarray(w))
        cuda_device.synchronize()
        np.testing.assert_array_equal(shadow.id_of_slot, cuda_device.to_host(runner.cache.id_of_slot))
    c = runner.counters()
    assert c["split_cpu"] > 0 and c["split_hits"] > 0 and runner.prefetch.stats["predicted"] > 0, c
    runner.close()


def test_prefetch_scoring_and_turn_off():
    from freetoken.device import get_device

    dev = get_device("cpu")
    pf = NextLayerPrefetch(dev, 3, lambda layer, h: (np.array([[0, 1]], np.int32), None))
    assert pf.predict(2, None) is None  # no layer after the last
    for _ in range(40):
        assert pf.predict(0, None) is not None
        pf.score(1, np.array([[1, 5]], np.int32))  # one of two right
    assert pf.stats == {"predicted": 80, "correct": 40, "actual": 80}
    assert pf.off == []  # 50% >= MIN_PRECISION
    for _ in range(64):
        if pf.predict(0, None) is None:
            break
        pf.score(1, np.array([[6, 7]], np.int32))
    assert pf.off == [1] and pf.predict(0, None) is None
    assert "turned off for MoE layers [1]" in pf.report()


def test_options_are_checked():
    with pytest.raises(ValueError, match="moe mode 'fast'"):
        ExpertOptions(mode="fast")
    with pytest.raises(ValueError, match="cache_slots must be > 0"):
        ExpertOptions(cache_slots=0)
    with pytest.raises(ValueError, match="pcie_gbps must be > 0"):
        ExpertOptions(pcie_gbps=float("nan"))
    with pytest.raises(ValueError, match="future_value"):
        ExpertOptions(future_value=-1.0)


def test_layers_of_different_layouts_share_slots_of_the_largest(cuda_device, records):
    """One slot array per bank, as long as the largest layer's bank: the slots cost the largest record, not the sum
    of the layouts'; the host pool holds each layer's records exactly sized; every slot's bytes equal its host
    record whichever layer's it is."""
    layouts, _ = records
    runner = _runner(cuda_device, records, cache_slots=16)
    _check_against_op(cuda_device, runner, records, _calls(seed=2, tokens=2))
    runner.cache.check_invariants()
    largest = max(lay.record_bytes for lay in layouts)
    assert runner.layout.record_bytes == largest
    mem = runner.memory()
    rows = 16 + runner.cache.scratch  # the slots, and next_use's scratch slots for bypassed misses
    if len(set(layouts)) == 1:
        assert mem["expert slots"] == rows * sum(s.nbytes for s in layouts[0].bank_specs())
    else:  # each bank name's slot row as long as its longest (16-byte rounded) over the layouts
        longest: dict[str, int] = {}
        for s in (s for lay in layouts for s in lay.bank_specs()):
            longest[s.name] = max(longest.get(s.name, 0), -(-s.nbytes // 16) * 16)
        assert mem["expert slots"] == rows * sum(longest.values())
    assert mem["expert banks (host pool)"] == EXPERTS * sum(s.nbytes for lay in layouts for s in lay.bank_specs())
    if len(set(layouts)) > 1:
        assert mem["expert slots"] < rows * sum(lay.record_bytes for lay in set(layouts))
    runner.close()
