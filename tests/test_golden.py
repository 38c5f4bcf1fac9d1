"""Behaviour pinned across refactors: the bundled model's logits, greedy tokens, decode routing and expert counters
on every device and expert mode, and the simulator's tables, against files written from the code before (see
tests/golden/behaviour.py). The cpu device must match bit for bit on a machine of the golden run's SIMD level (the
file records it; on another level the sums run in other orders, so NMSE 1e-9 as for emu); emu runs within NMSE 1e-9
(a rewritten kernel may sum in another order); tokens, routing and counters identical everywhere."""

import json
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "golden"))
import behaviour  # noqa: E402

from freetoken.device import device_status  # noqa: E402


# the emu runs take 15-25 s each on 2 cores: slow (CI runs them; the quick tier keeps the cpu run)
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if run[0] == "emu" else n
                                  for n, run in behaviour.MODEL_RUNS.items()])
def test_model_matches_golden(name):
    device = behaviour.MODEL_RUNS[name][0]
    ok, why = device_status()[device]
    if not ok:
        pytest.skip(f"{device} device unavailable: {why}")
    want = dict(np.load(behaviour.HERE / f"model_{name}.npz"))
    got = behaviour.run_model(name)
    np.testing.assert_array_equal(got["prompt_ids"], want["prompt_ids"])
    if device == "cpu" and str(got["simd"]) == str(want["simd"]):
        np.testing.assert_array_equal(got["logits"], want["logits"])
    else:  # emu, or cpu kernels built for another SIMD level than the golden run's (other summation orders)
        err = float(((got["logits"] - want["logits"]) ** 2).mean() / (want["logits"] ** 2).mean())
        assert err <= 1e-9, f"logits NMSE {err:.3g} against the golden run"
    np.testing.assert_array_equal(got["tokens"], want["tokens"])
    np.testing.assert_array_equal(got["decode_routing"], want["decode_routing"])
    if name not in behaviour.TIMING_DEPENDENT:
        stats = {k: int(v) for k, v in got.items() if k.startswith("stat_")}
        assert stats == {k: int(v) for k, v in want.items() if k.startswith("stat_")}


@pytest.fixture(scope="module")
def synthetic_trace(tmp_path_factory):
    path = tmp_path_factory.mktemp("golden") / "t.npz"
    behaviour.make_trace(path)
    return path


@pytest.mark.parametrize("name", list(behaviour.SIMULATIONS))
def test_simulator_tables_match_golden(synthetic_trace, name):
    want = json.loads((behaviour.HERE / "simulations.json").read_text())[name]
    assert behaviour.run_simulation(synthetic_trace, name) == want
