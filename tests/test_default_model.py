"""The bundled default model: it loads with no path, is small, and writes Python-looking text."""

import json

import numpy as np

import freetoken
from freetoken.cli import main
from freetoken.engine.decoding.sampling import SamplingParams
from freetoken.engine.loading.load import DEFAULT_MODEL


def test_bundled_files_are_small():
    total = sum(p.stat().st_size for p in DEFAULT_MODEL.iterdir() if p.is_file())
    assert total <= 20 * 2**20
    cfg = json.loads((DEFAULT_MODEL / "config.json").read_text())
    assert cfg["model_type"] == "qwen3_moe"
    assert cfg["hidden_size"] % 32 == 0 and cfg["moe_intermediate_size"] % 32 == 0


def test_greedy_generation_is_deterministic_and_code_like():
    model = freetoken.load(device="cpu")
    params = SamplingParams(temperature=0)
    a = "".join(model.generate_text("def fibonacci(n):", max_tokens=24, sampling=params))
    b = "".join(model.generate_text("def fibonacci(n):", max_tokens=24, sampling=params))
    assert a == b and len(a.strip()) > 0
    assert any(tok in a for tok in ("return", "if ", "\n", "(", "=", ":"))
    logits = model.logits(model.encode("import os\n"))
    assert np.isfinite(logits).all() and logits.shape[1] == model.config.vocab_size


def test_run_without_model_uses_the_bundled_one(capsys):
    assert main(["run", "--device", "cpu", "--max-tokens", "8", "--seed", "0", "def fibonacci(n):"]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("def fibonacci(n):") and "tok/s" in err
