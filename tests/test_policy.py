"""The q* runtime: the bandwidth oracle, stored profiles, hot-expert pinning, next-layer prefetch, and the hybrid
executor (misses split between PCIe copies and the CPU), whose output must equal the all-GPU path on emu."""

import numpy as np
import pytest

from freetoken.policy.oracle import GB, BandwidthOracle, RollingRate
from freetoken.policy.pinning import counts_from_routing, hottest, max_pins, pin_hot
from freetoken.policy.profile import Profile, load_profile, recommend_mode, save_profile
from freetoken.testing.oracles import need

# ---- the oracle ------------------------------------------------------------------------------------------------


class FakeClock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_rate_is_the_window_median_and_ignores_outliers():
    clock = FakeClock()
    r = RollingRate(prior=10 * GB, clock=clock)
    assert r.rate() == 10 * GB  # the prior until samples exist
    for i in range(40):
        clock.t = i * 0.002
        r.add(20e6 if i % 10 else 20e9, 1e-3)  # 20 GB/s, every 10th sample an absurd 20 TB/s
    assert r.rate() == pytest.approx(20 * GB)


def test_sustained_drop_is_detected_within_300_ms():
    """A decode loop feeding one sample per layer (every 1 ms); PCIe falls from 24 to 6 GB/s at t = 1 s."""
    clock = FakeClock()
    o = BandwidthOracle(pcie_gbps=24, clock=clock)
    t_change, detected_at, followed_at = 1.0, None, None
    for i in range(2000):
        clock.t = i * 1e-3
        bw = 24e9 if clock.t < t_change else 6e9
        jitter = 1.0 + 0.1 * np.sin(i)  # +-10% noise
        o.add_copy(bw * 1e-4 * jitter, 1e-4)
        if clock.t >= t_change and detected_at is None and o.changes():
            detected_at = clock.t
        if clock.t >= t_change and followed_at is None and o.pcie_gbps() < 8:
            followed_at = clock.t
    assert detected_at is not None and detected_at - t_change <= 0.3, detected_at
    assert followed_at is not None and followed_at - t_change <= 0.3, followed_at
    what, _, old, new = o.changes()[-1]
    assert what == "pcie" and old > 20 and new < 8


def test_injected_figures_are_never_replaced():
    o = BandwidthOracle()
    o.inject(pcie_gbps=12.5, cpu_gbps=3.0)
    o.add_copy(1e9, 1e-3)
    o.add_cpu("q4_0", 1e9, 1e-3)
    assert o.pcie_gbps() == 12.5 and o.cpu_gbps("q4_0") == 3.0 and o.cpu_gbps("bf16") == 3.0


# ---- profiles --------------------------------------------------------------------------------------------------


def test_profile_is_keyed_by_hardware(tmp_path):
    p = Profile(gpu="RTX 4090", cpu="Ryzen 9 7950X x32", fmt="q4_0", pcie_gbps=24.0, cpu_gbps=40.0,
                record_bytes=4718592, measured_at=0.0)
    save_profile(p, tmp_path)
    assert load_profile("RTX 4090", "Ryzen 9 7950X x32", "q4_0", tmp_path) == p
    assert load_profile("RTX 3090", "Ryzen 9 7950X x32", "q4_0", tmp_path) is None  # other hardware: ignored
    assert load_profile("RTX 4090", "Ryzen 9 7950X x32", "bf16", tmp_path) is None
    (tmp_path / "bandwidth_profiles.json").write_text("{not json")
    assert load_profile("RTX 4090", "Ryzen 9 7950X x32", "q4_0", tmp_path) is None  # corrupt: re-measure


def test_recommended_mode():
    def prof(pcie, cpu):
        return Profile("g", "c", "q4_0", pcie, cpu, 1, 0.0)

    assert recommend_mode(None) == "gpu"
    assert recommend_mode(prof(50, 5)) == "gpu"
    assert recommend_mode(prof(5, 50)) == "cpu"
    assert recommend_mode(prof(20, 30)) == "hybrid"


# ---- pinning ---------------------------------------------------------------------------------------------------


def test_hottest_experts():
    counts = np.array([[5, 0, 9], [9, 1, 0]])
    assert hottest(counts, 3) == [(0, 2), (1, 0), (0, 0)]
    assert hottest(counts, 10) == [(0, 2), (1, 0), (0, 0), (1, 1)]  # never-routed experts are not pinned
    routing = [np.array([[0, 2], [2, 1]]), np.array([[1, 1]])]
    np.testing.assert_array_equal(counts_from_routing(routing, 3), [[1, 1, 2], [0, 2, 0]])


# ---- the executor and prefetch on emu ---------------------------------------------------------------------------

from tiny_models import make_checkpoint  # noqa: E402

PROMPT, STEPS = 12, 10


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    need("torch")
    need("transformers")
    path = tmp_path_factory.mktemp("policy")
    make_checkpoint("qwen3_moe", path, num_hidden_layers=3, mlp_only_layers=[])
    return path


def _decode(path, device, **kw):
    """The tiny model's prompt and decode logits; the CPU computes its misses on the float path unless ``kw`` says
    otherwise (the split is compared with the all-device run to float32 rounding)."""
    import json

    from safetensors.numpy import load_file

    from freetoken.engine.loading.build import build_decoder
    from freetoken.engine.options import ExpertOptions, LoadOptions
    from freetoken.models import from_hf

    cfg = from_hf(json.loads((path / "config.json").read_text()))
    tensors = load_file(str(path / "model.safetensors"))
    kw.setdefault("cpu_activations", "f32")
    dec = build_decoder(cfg, lambda n: tensors[n], device,
                        LoadOptions(ctx=64, experts=ExpertOptions(max_decode_tokens=4, **kw)))
    tokens = np.random.default_rng(5).integers(0, 128, PROMPT + STEPS)
    out = [dec.forward(tokens[:PROMPT])]
    out += [dec.forward(tokens[i:i + 1]) for i in range(PROMPT, PROMPT + STEPS)]
    return np.concatenate(out), dec


@pytest.mark.parametrize("mode, pcie, cpu", [("cpu", 1, 1), ("hybrid", 1, 1),
                                             pytest.param("hybrid", 100, 1, marks=pytest.mark.slow),
                                             pytest.param("hybrid", 1, 100, marks=pytest.mark.slow)])
def test_split_output_equals_all_gpu(checkpoint, cuda_device, mode, pcie, cpu):
    """The LRU split (next_use's: test_hybrid_next_use_places_bypassed_misses_by_qstar)."""
    want, ref = _decode(checkpoint, cuda_device, cache_slots=16)
    got, dec = _decode(checkpoint, cuda_device, cache_slots=16, mode=mode, pcie_gbps=pcie, cpu_gbps=cpu,
                       cache_policy="lru")
    st = dec.experts.split.stats
    if mode == "cpu" or cpu > pcie:
        assert st["cpu"] > 0  # the CPU really computed some misses
    if mode == "hybrid" and pcie > cpu:
        assert st["cpu"] == 0 and st["fetched"] > 0  # PCIe much faster: everything fetched
    # decode and CPU kernels differ only in summation order
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())
    assert (got.argmax(-1) == want.argmax(-1)).all()
    dec.experts.cache.check_invariants()
    dec.experts.close()


def test_cpu_mode_leaves_residency_unchanged(checkpoint, cuda_device):
    """A CPU-computed miss reads the host pool and leaves the cache as it was: only prefill borrows and hits."""
    _, dec = _decode(checkpoint, cuda_device, cache_slots=16, mode="cpu")
    assert dec.experts.cache.stats()["misses"] == 0  # decode never copied anything in
    assert dec.experts.split.stats["fetched"] == 0 and dec.experts.split.stats["cpu"] > 0
    dec.experts.close()


def test_prefetch_keeps_output_and_scores_the_predictor(checkpoint, cuda_device):
    want, _ = _decode(checkpoint, cuda_device, cache_slots=24)
    got, dec = _decode(checkpoint, cuda_device, cache_slots=24, prefetch=True)
    np.testing.assert_array_equal(got, want)  # prefetch changes residency, never results
    ps = dec.experts.prefetch.stats
    assert ps["predicted"] > 0 and 0 <= ps["correct"] <= min(ps["predicted"], ps["actual"])
    dec.experts.cache.check_invariants()


def test_pinned_hot_experts_are_never_evicted(checkpoint, cuda_device):
    _, dec = _decode(checkpoint, cuda_device, cache_slots=20)
    cache = dec.experts.cache
    counts = np.zeros((cache.num_layers, cache.num_experts), np.int64)
    counts[0, 3], counts[2, 5], counts[1, 0] = 9, 7, 5
    assert max_pins(cache) == 20 - 16
    pinned = pin_hot(cache, counts, 3)
    assert pinned == [(0, 3), (2, 5), (1, 0)]
    tokens = np.random.default_rng(9).integers(0, 128, 30)
    for t in tokens:  # 30 decode steps of admissions and evictions through 20 slots
        dec.forward(np.array([t]))
    slot_for_id = dec.dev.to_host(cache.slot_for_id)
    for layer, e in pinned:
        assert slot_for_id[layer * cache.num_experts + e] >= 0
    cache.check_invariants()


@pytest.mark.slow
def test_qstar_never_loses_on_a_real_trace_of_the_bundled_model(tmp_path):
    """The issue's criterion, on a routing trace the bundled model really produced (4 prompts x 48 tokens): at
    every PCIe/CPU ratio of the sweep q* is as fast as the better of fetch-all and cpu-all, and faster where the
    two are close. Exact per call (tests/test_qstar.py); across a trace the cache contents diverge between modes
    and the future-value term is an estimate, so a near-tie can go either way: measured worst 0.9998 here, 1.0000
    on the 1140-step trace of bench/qstar_sweep.py."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    from qstar_sweep import record

    from freetoken.sim.timing import sweep
    from freetoken.trace.format import load_trace

    record(tmp_path / "t.npz", prompts=4, tokens=48, seed=0)
    trace = load_trace(tmp_path / "t.npz")
    for slots in (24, 56):
        by_ratio: dict = {}
        for r in sweep(trace, slots, 50.0, future_value="global", window="all"):
            by_ratio.setdefault(r["ratio"], {})[r["mode"]] = r["tokens_per_s"]
        gains = [v["qstar"] / max(v["fetch_all"], v["cpu_all"]) for v in by_ratio.values()]
        assert min(gains) > 0.995, (slots, gains)
        assert max(gains) > 1.05, (slots, gains)  # at low PCIe/CPU ratios the split beats both extremes


def test_prefetch_stays_only_where_it_pays(checkpoint, cuda_device, monkeypatch):
    """A layer whose predictions stay below PREFETCH_MIN_PRECISION stops being prefetched; the output never
    changes."""
    import freetoken.engine.experts.prefetch as prefetch_mod

    monkeypatch.setattr(prefetch_mod, "MIN_SAMPLES", 4)
    monkeypatch.setattr(prefetch_mod, "MIN_PRECISION", 1.01)  # nothing is precise enough
    want, _ = _decode(checkpoint, cuda_device, cache_slots=24)
    got, dec = _decode(checkpoint, cuda_device, cache_slots=24, prefetch=True)
    np.testing.assert_array_equal(got, want)
    pf = dec.experts.prefetch
    assert sorted(pf.off) == [1, 2]  # every predicted layer, once it has 4 predictions
    predicted_after = pf.stats["predicted"]
    dec.forward(np.array([3]))
    assert pf.stats["predicted"] == predicted_after  # no more predictions, no more prefetch copies


# ---- the runtime's cache policy (next_use by default on gpu/emu) --------------------------------------------------
def _forward_chunks(path, device, chunks, prompt=40, **kw):
    """The checkpoint's decoder fed a ``prompt``-token prompt (streamed when it has more pairs than one admission),
    then ``chunks`` (token counts) of decode forwards; (the logits of every pass, the decoder, the next_use return
    counts right after the prompt). CPU misses on the float path unless ``kw`` says otherwise."""
    import json

    from safetensors.numpy import load_file

    from freetoken.engine.loading.build import build_decoder
    from freetoken.engine.options import ExpertOptions, LoadOptions
    from freetoken.models import from_hf

    cfg = from_hf(json.loads((path / "config.json").read_text()))
    tensors = load_file(str(path / "model.safetensors"))
    dec = build_decoder(cfg, lambda n: tensors[n], device,
                        LoadOptions(ctx=256, experts=ExpertOptions(**{"max_decode_tokens": 4, "cpu_activations": "f32",
                                                                      **kw})))
    tokens = np.random.default_rng(11).integers(0, 128, prompt + sum(chunks))
    out, at = [dec.forward(tokens[:prompt])], prompt
    prior = dec.dev.to_host(dec.experts.cache.c1).copy() if dec.experts.cache.policy == "default" else None
    for n in chunks:
        out.append(dec.forward(tokens[at:at + n]))
        at += n
    return np.concatenate(out), dec, prior


def test_next_use_is_the_default_and_changes_residency_never_results(checkpoint, cuda_device):
    """16 slots for 3 x 8 experts: auto picks next_use. After a 40-token prompt (streamed), steps of 16 tokens route
    more experts than the slots keep, so the policy bypasses misses (at most top-k = 2 per call, streamed through
    scratch slots); single-token steps follow. The logits equal LRU's bit for bit (residency decides where a record
    is read, never what), the streamed prompt's routing seeded the statistics (the prefill prior), and the cache's
    maps stay exact."""
    chunks = [16] * 8 + [1] * 6
    kw = {"cache_slots": 16, "max_decode_tokens": 16}
    want, ref, _ = _forward_chunks(checkpoint, cuda_device, chunks, cache_policy="lru", **kw)
    got, dec, prior = _forward_chunks(checkpoint, cuda_device, chunks, **kw)
    np.testing.assert_array_equal(got, want)
    runner = dec.experts
    assert runner.cache_policy == "next_use" and runner.cache.policy == "default" and runner.cache.scratch == 2
    assert ref.experts.cache_policy == "lru" and ref.experts.cache.scratch == 0
    assert (prior > 0).sum() >= 3  # every layer's routed experts got a return count from the prompt
    stats = runner.cache.stats()
    assert stats["bypassed"] > 0 and runner.counters()["cache_bypassed"] == stats["bypassed"]
    assert "streamed past the cache" in runner.summary() and "cache policy next_use" in runner.report()
    assert stats["hits"] + stats["misses"] == ref.experts.cache.stats()["hits"] + ref.experts.cache.stats()["misses"]
    runner.cache.check_invariants()
    runner.cache.check_errors()


def test_cache_policy_choice_and_conflicts(checkpoint, cuda_device):
    from freetoken.engine.options import ExpertOptions
    from freetoken.policy.runtime import resolve_cache_policy

    assert resolve_cache_policy("auto", "gpu", False, 16, 24) == ("next_use", "")
    policy, note = resolve_cache_policy("auto", "hybrid", False, 16, 24)  # q* splits every miss: LRU by default
    assert policy == "lru" and "--cache-policy next_use" in note
    assert resolve_cache_policy("next_use", "hybrid", False, 16, 24) == ("next_use", "")
    assert resolve_cache_policy("auto", "gpu", False, 24, 24)[0] == "lru"  # room for all: nothing is evicted
    policy, note = resolve_cache_policy("auto", "cpu", False, 16, 24)
    assert policy == "lru" and "caches none" in note
    policy, note = resolve_cache_policy("auto", "hybrid", False, 16, 24, mixed=True)
    assert policy == "lru" and "LRU shadow" in note
    with pytest.raises(ValueError, match="LRU shadow"):
        resolve_cache_policy("next_use", "hybrid", False, 16, 24, mixed=True)
    assert resolve_cache_policy("auto", "gpu", False, 16, 24, mixed=True)[0] == "next_use"
    assert resolve_cache_policy("auto", "gpu", True, 16, 24)[0] == "lru"
    assert resolve_cache_policy("lru", "gpu", False, 16, 24) == ("lru", "")
    with pytest.raises(ValueError, match="--moe-mode cpu"):
        resolve_cache_policy("next_use", "cpu", False, 16, 24)
    with pytest.raises(ValueError, match="--prefetch"):
        resolve_cache_policy("next_use", "gpu", True, 16, 24)
    with pytest.raises(ValueError, match="cache policy 'fifo'"):
        ExpertOptions(cache_policy="fifo")
    with pytest.raises(ValueError, match="--moe-mode cpu"):  # the runner refuses it by name
        _decode(checkpoint, cuda_device, cache_slots=16, mode="cpu", cache_policy="next_use")
    _, dec = _decode(checkpoint, cuda_device, cache_slots=16, mode="cpu")
    assert dec.experts.cache_policy == "lru" and "caches none" in dec.experts.report()
    dec.experts.close()


@pytest.mark.parametrize("pcie, cpu", [(1, 1000), (1000, 1)])
def test_hybrid_next_use_places_bypassed_misses_by_qstar(checkpoint, cuda_device, pcie, cpu):
    """Hybrid under next_use: the policy decides what is cached, q* where each bypassed miss runs. With the CPU far
    faster bypassed misses run there (not copied), with PCIe far faster every one is streamed; either way
    the logits are the all-GPU LRU run's up to summation order, and the statistics add up."""
    chunks = [16] * 4 + [1] * 6
    kw = {"cache_slots": 16, "max_decode_tokens": 16}
    want, _, _ = _forward_chunks(checkpoint, cuda_device, chunks, cache_policy="lru", **kw)
    got, dec, _ = _forward_chunks(checkpoint, cuda_device, chunks, mode="hybrid", pcie_gbps=pcie, cpu_gbps=cpu,
                                  cache_policy="next_use", **kw)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())
    runner = dec.experts
    assert runner.cache_policy == "next_use" and runner.split.shadow is None
    cs, st = runner.cache.stats(), runner.split.stats
    assert cs["bypassed"] > 0
    on_cpu = int(runner.cache.served_elsewhere.sum())
    assert on_cpu == st["cpu"]
    if cpu > pcie:  # (a lone bypassed miss may still be streamed: the CPU's hand-off costs more than its copy)
        assert on_cpu > 0
    else:
        assert on_cpu == 0 and "streamed past the cache" in runner.summary()
    assert st["fetched"] == cs["misses"] - on_cpu
    assert cs["bytes_copied"] == (cs["misses"] - on_cpu) * runner.cache.record_bytes
    runner.cache.check_invariants()
    runner.cache.check_errors()
    runner.close()
