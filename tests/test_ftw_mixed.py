"""An FTW file whose MoE layers mix expert formats (a quarter of each layer's experts in fp8_block, the rest in mxfp4)
runs through the whole stack: the host pool keeps each part exactly sized, the cache copies each part with its own
table, the kernels run once per part with the other parts' pairs skipped (NO_ROUTE), on cpu and on emu with a small
cache (evictions across parts), prompt streamed through the prefill buffers and decode steps admitted, also with the
miss split (--moe-mode cpu|hybrid: the CPU share per part) and the next-layer prefetch."""

import numpy as np
import pytest

from freetoken.convert.expert_plan import hot_cold_plan
from freetoken.convert.ftw_export import write_ftw
from freetoken.engine.loading.load import DEFAULT_MODEL, load
from freetoken.engine.loading.sources import open_source

PROMPT = np.random.default_rng(7).integers(2, 4000, 40)
STEPS = 6


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("mixed")
    src = open_source(DEFAULT_MODEL)
    counts = np.random.default_rng(3).random((6, 16))  # which experts are "hot": any choice must work
    plan = hot_cold_plan(counts, "fp8_block", "mxfp4", 0.25)
    return {"mixed": write_ftw(src, d / "mixed.ftw", expert_plan=plan),
            "mxfp4": write_ftw(open_source(DEFAULT_MODEL), d / "mxfp4.ftw", expert_format="mxfp4")}


def _logits(path, device, **kw):
    model = load(path, device=device, **kw)
    dec = model.decoder
    dec.reset()
    out = [dec.forward(PROMPT)]
    for t in range(STEPS):
        out.append(dec.forward(PROMPT[t:t + 1]))
    return model, np.concatenate(out)


def _nmse(a, b):
    return float(((a - b) ** 2).sum() / (b ** 2).sum())


def test_mixed_layers_load_as_parts(files):
    model, _ = _logits(files["mixed"], "cpu")
    parts = model.experts.parts
    assert all(p.mixed for p in parts)
    assert all(sorted(lay.name for lay in p.layouts) == ["fp8_block", "mxfp4"] for p in parts)
    assert all(sorted(x.size for x in p.experts) == [4, 12] for p in parts)
    assert " x4" in model.experts.summary() and " x12" in model.experts.summary()


@pytest.mark.parametrize("prefetch", [False, True])
def test_mixed_file_on_cpu_and_emu_with_a_small_cache(files, prefetch):
    _, cpu = _logits(files["mixed"], "cpu")
    model, emu = _logits(files["mixed"], "emu", cache_slots=40, prefetch=prefetch)
    assert model.experts.mode == "gpu"
    if prefetch:  # the next layer's predicted experts admitted part by part
        assert model.experts.prefetch.stats["predicted"] > 0
    model.experts.cache.check_invariants()  # every slot's bytes equal its record in its own layout
    assert model.experts.cache.stats()["misses"] > 0
    # emu's prompt runs bf16 tensor-core inputs: measured ~1e-6; a record read through the wrong layout is ~1
    assert _nmse(emu, cpu) < 1e-4, _nmse(emu, cpu)
    assert (emu.argmax(-1) == cpu.argmax(-1)).mean() > 0.9


def test_mixed_file_is_closer_to_bf16_than_uniform_mxfp4(files):
    _, bf16 = _logits(DEFAULT_MODEL, "cpu")
    _, mixed = _logits(files["mixed"], "cpu")
    _, mx = _logits(files["mxfp4"], "cpu")
    # the fp8 quarter is near-exact: the mixed file's error is below the all-mxfp4 file's (a wrong expert mapping
    # would be far worse than either)
    assert _nmse(mixed, bf16) < _nmse(mx, bf16)


def _shadow_in_step(model):
    runner = model.experts
    np.testing.assert_array_equal(runner.split.shadow.id_of_slot, runner.dev.to_host(runner.cache.id_of_slot))


@pytest.mark.parametrize("mode", ["cpu", "hybrid"])
def test_split_modes_run_mixed_layers(files, mode):
    """The miss split on mixed layers: the CPU share runs each part's kernel over its pairs, the GPU share admits
    part by part, and the split's host shadow stays slot for slot equal to the device cache. Hybrid's rates are
    pinned so that both sides get misses; the next-layer prefetch admits into mixed layers too."""
    _, cpu = _logits(files["mixed"], "cpu")
    model, emu = _logits(files["mixed"], "emu", cache_slots=40, moe_mode=mode, pcie_gbps=2.0, cpu_gbps=2.0,
                         prefetch=True)
    runner = model.experts
    assert runner.mode == mode
    st = runner.split.stats
    assert st["cpu"] > 0
    if mode == "hybrid":  # (cpu mode admits only hits, so it seldom prefetches)
        assert st["fetched"] > 0
        assert runner.prefetch.stats["predicted"] > 0
    _shadow_in_step(model)
    runner.cache.check_invariants()
    assert _nmse(emu, cpu) < 1e-4, _nmse(emu, cpu)
    assert (emu.argmax(-1) == cpu.argmax(-1)).mean() > 0.9


def test_auto_mode_may_split_mixed_layers(files):
    model, _ = _logits(files["mixed"], "emu", cache_slots=40, moe_mode="auto")
    assert model.experts.mode in ("gpu", "cpu", "hybrid")
    assert "several" not in model.experts.report()
