"""The miss policy from the command line: `freetoken run --moe-mode ...` on emu, `freetoken bench bw` writing a
profile that `--moe-mode auto` then reuses, pinning and prefetch reports."""

import json

import pytest

from freetoken.cli import main
from freetoken.engine.loading.load import DEFAULT_MODEL

PROMPT = "def fibonacci(n):"
RUN = ["run", "--device", "emu", "--max-tokens", "12", "--temperature", "0", "--cache-slots", "40"]
# Each run of the bundled model on emu takes ~2-6 s on 2 cores: the quick tier (-m "not slow") keeps the bench bw ->
# auto round trip and the flag check; the modes, prefetch and pinning are also covered on tiny models (test_policy).


@pytest.fixture()
def cache_home(tmp_path, monkeypatch):
    monkeypatch.setenv("FREETOKEN_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _run(capsys, *extra):
    assert main([*RUN, *extra, PROMPT]) == 0
    out = capsys.readouterr()
    return out.out, out.err


@pytest.mark.slow
def test_hybrid_and_cpu_modes_write_the_gpu_modes_text(capsys, cache_home):
    want, _ = _run(capsys)
    for extra in (["--moe-mode", "hybrid", "--pcie-gbps", "1", "--cpu-gbps", "1"], ["--moe-mode", "cpu"]):
        got, err = _run(capsys, *extra)
        assert got == want
        assert f"moe mode {extra[1]}" in err and "on the CPU" in err


def test_bench_bw_profile_is_reused_by_auto(capsys, cache_home):
    assert main(["bench", "bw", "--device", "emu", "--model", str(DEFAULT_MODEL), "--records", "8", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["format"] == "bf16" and out["record_bytes"] == 3 * 192 * 96 * 2  # the bundled model's records
    assert out["pcie_gbps"] > 0 and out["cpu_gbps"] > 0 and out["recommended_mode"] in ("gpu", "cpu", "hybrid")
    stored = json.loads((cache_home / "bandwidth_profiles.json").read_text())
    assert len(stored) == 1 and next(iter(stored.values()))["gpu"] == "emu"
    _, err = _run(capsys, "--moe-mode", "auto")
    assert f"auto -> {out['recommended_mode']} (profile: PCIe" in err


@pytest.mark.slow
def test_auto_without_profile_falls_back_to_gpu(capsys, cache_home):
    _, err = _run(capsys, "--moe-mode", "auto")
    assert "auto -> gpu (no bandwidth profile" in err


@pytest.mark.slow
def test_prefetch_predicts_the_next_layer(capsys, cache_home):
    _, err = _run(capsys, "--prefetch")
    precision = float(err.split("prefetch precision ")[1].split("%")[0])
    assert precision > 50  # the next layer's router on this layer's input: ~78% on the bundled model; random 25%


@pytest.mark.slow
def test_pin_hot_from_a_warm_up(capsys, cache_home):
    _, err = _run(capsys, "--pin-hot", "4")
    assert "pinned 4 hot experts (asked 4) from a warm-up pass over the prompt" in err


def test_bad_policy_flags(capsys, cache_home):
    assert main([*RUN, "--pcie-gbps", "0", PROMPT]) == 2
    assert "argument --pcie-gbps: must be a finite number > 0, got 0" in capsys.readouterr().err
