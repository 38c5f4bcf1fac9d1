"""``freetoken perplexity``: llama.cpp's measure (chunks of --chunk tokens, the second half of each scored), checked
against the log-likelihoods computed directly from the model's logits; bad input is one clear line."""

import math

import numpy as np
import pytest

from freetoken.cli import main
from freetoken.engine.generation.perplexity import perplexity, token_nll
from freetoken.engine.loading.load import load

TEXT = "import os\nimport sys\n\n\ndef main(argv):\n    return len(argv)\n\n" * 12


@pytest.fixture(scope="module")
def model():
    return load(None, device="cpu", ctx=128)


def test_token_nll_is_minus_log_softmax():
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((5, 11)).astype(np.float32) * 4
    targets = rng.integers(0, 11, 5)
    p = np.exp(logits.astype(np.float64))
    p /= p.sum(1, keepdims=True)
    np.testing.assert_allclose(token_nll(logits, targets), -np.log(p[np.arange(5), targets]), rtol=1e-12)


def test_perplexity_scores_the_second_half_of_each_chunk(model):
    ids = model.encode(TEXT)
    ctx = 32
    got = perplexity(model, ids, ctx=ctx)
    chunks = len(ids) // ctx
    nll = []
    for c in range(chunks):
        chunk = np.asarray(ids[c * ctx:(c + 1) * ctx])
        logp = model.logits(chunk).astype(np.float64)
        logp -= np.log(np.exp(logp - logp.max(1, keepdims=True)).sum(1, keepdims=True)) + logp.max(1, keepdims=True)
        nll += [-logp[t - 1, chunk[t]] for t in range(ctx // 2, ctx)]
    assert got.chunks == chunks and got.tokens == chunks * ctx // 2
    assert got.nll == pytest.approx(float(np.mean(nll)), rel=1e-9)
    assert got.ppl == pytest.approx(math.exp(np.mean(nll)), rel=1e-9)
    assert perplexity(model, ids, ctx=ctx, max_chunks=2).chunks == 2


def test_bad_input_is_refused(model):
    with pytest.raises(ValueError, match="shorter than one chunk"):
        perplexity(model, model.encode("x = 1"), ctx=64)
    with pytest.raises(ValueError, match="longer than the model's context"):
        perplexity(model, model.encode(TEXT), ctx=1 << 20)


def test_cli(tmp_path, capsys):
    f = tmp_path / "t.py"
    f.write_text(TEXT)
    assert main(["perplexity", str(f), "--device", "cpu", "--chunk", "32", "--max-chunks", "3"]) == 0
    out = capsys.readouterr().out
    assert "3 chunks of 32, scoring the second half" in out and "perplexity" in out
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    assert main(["perplexity", str(empty), "--device", "cpu"]) != 0
    assert "empty" in capsys.readouterr().err
    assert main(["perplexity", str(tmp_path / "missing.txt"), "--device", "cpu"]) != 0
    assert "missing.txt" in capsys.readouterr().err
