"""gpt-oss beyond the shared parity tests (test_model_parity, test_gguf_model, the llama.cpp modules): the release
checkpoints' MXFP4 experts, and the config fields the kernels fix."""

import json

import numpy as np
import pytest
from tiny_models import GGUF_OVERRIDES, make_checkpoint, to_gpt_oss_mxfp4

from freetoken.engine.loading.load import load
from freetoken.models import ConfigError
from freetoken.models.config import from_hf
from freetoken.testing.oracles import need

TOKENS = np.random.default_rng(0).integers(0, 128, 24)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpt_oss")
    make_checkpoint("gpt_oss", root / "hf", **GGUF_OVERRIDES["gpt_oss"])  # YaRN as GGUF keeps it: exact round trips
    return root / "hf", to_gpt_oss_mxfp4(root / "hf", root / "mxfp4")


def test_mxfp4_checkpoint_matches_transformers(checkpoints, device):
    """transformers reads the MXFP4 checkpoint (dequantized to bf16 on a CPU); we run its experts as mxfp4 banks
    moved bit for bit: gate and up de-interleaved from gate_up_proj's rows, nibbles and e8m0 scales as stored."""
    torch, transformers = need("torch"), need("transformers")
    need("accelerate", "transformers loads MXFP4 checkpoints through it")
    _, mx = checkpoints
    hf = transformers.GptOssForCausalLM.from_pretrained(mx, dtype=torch.float32).eval()
    with torch.no_grad():
        want = hf(torch.tensor(TOKENS)[None]).logits[0].float().numpy()
    # float32 expert inputs on the cpu: the 8-bit path's own rounding (measured apart, test_gguf_model) would add
    # 7e-5 here
    model = load(mx, device=device.kind, cpu_activations="f32")
    assert model.experts.layout.fmt.name == "mxfp4" and model.experts.layout.act == "gpt_oss"
    got = model.logits(TOKENS)
    nmse = float(((got - want) ** 2).sum() / (want**2).sum())
    assert nmse < 5e-5, nmse  # measured 7e-6 on cpu
    assert (got.argmax(-1) == want.argmax(-1)).mean() > 0.9


def test_mxfp4_banks_are_the_stored_bits(checkpoints):
    """Loading the MXFP4 directory equals loading the bf16 one quantized to mxfp4 by the same rounding, exactly:
    nothing was re-quantized on the way in."""
    hf, mx = checkpoints
    kw = dict(device="cpu", cpu_activations="f32")
    np.testing.assert_array_equal(load(mx, **kw).logits(TOKENS), load(hf, expert_format="mxfp4", **kw).logits(TOKENS))


def test_mxfp4_checkpoint_to_another_format(checkpoints):
    """Asked for q4_0 experts, the MXFP4 blocks are decoded and re-quantized (a lossy step, but a working load)."""
    hf, mx = checkpoints
    got = load(mx, device="cpu", expert_format="q4_0").logits(TOKENS)
    want = load(mx, device="cpu").logits(TOKENS)
    assert float(((got - want) ** 2).sum() / (want**2).sum()) < 0.05


@pytest.mark.parametrize("field, value, match", [
    ("swiglu_limit", 8.0, "'swiglu_limit' = 8.0: expected 7"),
    ("swiglu_alpha", 1.5, "'swiglu_alpha' = 1.5: expected 1.702"),
    ("layer_types", ["full_attention"], "'layer_types'"),
    ("layer_types", ["sliding_attention", "global"], "'layer_types'"),
])
def test_config_fields_the_kernels_fix(checkpoints, field, value, match):
    hf, _ = checkpoints
    cfg = json.loads((hf / "config.json").read_text())
    cfg[field] = value
    with pytest.raises(ConfigError, match=match):
        from_hf(cfg)


def test_windows_follow_layer_types(checkpoints):
    hf, _ = checkpoints
    cfg = json.loads((hf / "config.json").read_text())
    assert from_hf(cfg).sliding_windows == (6, 0)  # transformers' default: even layers windowed
    cfg["layer_types"] = ["full_attention", "sliding_attention"]
    assert from_hf(cfg).sliding_windows == (0, 6)


def test_mxfp4_checkpoint_exports_to_gguf(checkpoints, tmp_path):
    """freetoken convert on the release format: the MXFP4 experts decoded (exact in float32) and written out; the
    file loads to the MXFP4 directory's logits exactly (the same values re-quantized to mxfp4 decode the same)."""
    import warnings

    from freetoken.convert import export_gguf

    _, mx = checkpoints
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no tokenizer in the test checkpoint
        export_gguf(mx, tmp_path / "mx.gguf", experts="f32", other="f32")
    got = load(tmp_path / "mx.gguf", device="cpu", expert_format="mxfp4", cpu_activations="f32").logits(TOKENS)
    np.testing.assert_array_equal(got, load(mx, device="cpu", cpu_activations="f32").logits(TOKENS))
