"""Llama 4's attention temperature: each query at position p scaled by 1 + s ln(1 + floor((p + 1) / floor_scale)).

The bundled model carries it (scale 0.06 from position 1023 on: its held-out loss then stops rising with position).
Checked here: the factor against transformers' Llama 4 expression; a tiny Qwen3-MoE with the temperature switched on
early (floor 8) against transformers' Qwen3-MoE patched to apply it (``scripts/hf_attn_temperature.py``: transformers
ignores the keys for this family), prompt in chunks that straddle the floor and decode after it, on every device;
the keys through HF, GGUF and FTW files; bad values refused by name; DeepSeek-V3's latent attention against the
same model with the softmax scale raised by the factor."""

import json
import sys
from pathlib import Path

import numpy as np
import pytest
from tiny_models import make_checkpoint

from freetoken.engine.loading.build import build_decoder
from freetoken.engine.options import LoadOptions
from freetoken.models import ConfigError, from_hf
from freetoken.models.rope import query_temperature
from freetoken.testing.oracles import need

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

FLOOR, SCALE = 8, 0.4
PROMPT, STEPS = 13, 14


def _nmse(got, want):
    return float(((got - want) ** 2).sum() / (want**2).sum())


def test_factor_is_llama4s():
    torch = need("torch")
    got = query_temperature(np.arange(100), 8, 0.5)
    assert (got[:7] == 1).all() and got[7] > 1  # 1 until p + 1 reaches the floor
    assert got[7] == got[14] and got[15] > got[14]  # a step every floor positions
    # transformers' Llama4TextAttention computes the factor so
    want = torch.log1p(torch.floor((torch.arange(100).float() + 1.0) / 8)) * 0.5 + 1.0
    np.testing.assert_allclose(got, want.numpy(), rtol=1e-6)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    torch = need("torch")
    from hf_attn_temperature import patch, set_temperature

    patch()  # acts only on configs with attn_temperature_tuning: the other tests' models are untouched
    path = tmp_path_factory.mktemp("temperature")
    model = make_checkpoint("qwen3_moe", path)
    set_temperature(model.config, FLOOR, SCALE)
    model.config.save_pretrained(path)
    tokens = torch.randint(0, 128, (1, PROMPT + STEPS), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        want = model(tokens).logits[0].float().numpy()
        plain = model.config.attn_temperature_tuning = False
        plain = model(tokens).logits[0].float().numpy()
    return path, tokens[0].numpy(), want, plain


def _run(cfg, path, tokens, device, chunk):
    from safetensors.numpy import load_file

    tensors = load_file(str(path / "model.safetensors"))
    model = build_decoder(cfg, lambda name: tensors[name], device, LoadOptions(ctx=64, prefill_chunk=chunk))
    got = [model.forward(tokens[:PROMPT])]
    for t in range(STEPS):
        got.append(model.forward(tokens[PROMPT + t:PROMPT + t + 1]))
    return np.concatenate(got)


def test_matches_patched_transformers(checkpoint, device):
    path, tokens, want, plain = checkpoint
    cfg = from_hf(json.loads((path / "config.json").read_text()))
    assert (cfg.attn_temperature_scale, cfg.attn_temperature_floor) == (SCALE, FLOOR)
    got = _run(cfg, path, tokens, device, chunk=5)  # chunks 0-4, 5-9, 10-12: the floor (p = 7) inside the second
    # without the temperature the same tokens are far off: the check has teeth
    assert _nmse(plain[FLOOR:], want[FLOOR:]) > 1e-3
    bound = 5e-5  # bf16 experts, and on emu bf16 tensor-core prefill inputs (as tests/test_model_parity.py)
    assert _nmse(got[:PROMPT], want[:PROMPT]) < bound and _nmse(got[PROMPT:], want[PROMPT:]) < bound, \
        (_nmse(got[:PROMPT], want[:PROMPT]), _nmse(got[PROMPT:], want[PROMPT:]))


def test_config_keys_round_trip_through_gguf_and_ftw(checkpoint, tmp_path):
    from freetoken.convert.ftw_export import write_ftw
    from freetoken.convert.gguf_export import export_gguf
    from freetoken.engine.loading.sources import open_source

    path = checkpoint[0]
    export_gguf(path, tmp_path / "m.gguf")
    write_ftw(open_source(tmp_path / "m.gguf"), tmp_path / "m.ftw")
    for f in (tmp_path / "m.gguf", tmp_path / "m.ftw"):
        cfg = open_source(f).cfg
        # GGUF stores the scale as float32
        assert cfg.attn_temperature_scale == pytest.approx(SCALE, rel=1e-7) and cfg.attn_temperature_floor == FLOOR, f


@pytest.mark.parametrize("field, value", [("attn_scale", -0.1), ("attn_scale", "big"), ("attn_scale", 11.0),
                                          ("floor_scale", 0), ("floor_scale", 2.5)])
def test_bad_values_are_refused_by_name(checkpoint, field, value):
    raw = json.loads((checkpoint[0] / "config.json").read_text())
    raw[field] = value
    with pytest.raises(ConfigError, match=field):
        from_hf(raw)


def test_off_unless_the_config_turns_it_on(checkpoint):
    raw = json.loads((checkpoint[0] / "config.json").read_text())
    raw["attn_temperature_tuning"] = False
    assert from_hf(raw).attn_temperature_scale == 0


def test_latent_attention_scales_its_queries(tmp_path, device):
    """DeepSeek-V3 (no oracle applies the factor to it): decoding token by token with the temperature equals the
    same model without it whose latent attention's softmax scale is multiplied by the factor at each position."""
    import dataclasses

    from safetensors.numpy import load_file

    make_checkpoint("deepseek_v3", tmp_path)
    base = from_hf(json.loads((tmp_path / "config.json").read_text()))
    warm = dataclasses.replace(base, attn_temperature_scale=SCALE, attn_temperature_floor=FLOOR)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    tokens = np.random.default_rng(5).integers(0, 128, 20)
    a = build_decoder(warm, lambda n: tensors[n], device, LoadOptions(ctx=32))
    b = build_decoder(base, lambda n: tensors[n], device, LoadOptions(ctx=32))
    blocks = [layer.attention for layer in b.layers]
    scales = [blk.scale for blk in blocks]
    factor = query_temperature(np.arange(len(tokens)), FLOOR, SCALE)
    got, want = [], []
    for p, tok in enumerate(tokens):
        got.append(a.forward([tok]))
        for blk, s in zip(blocks, scales, strict=True):
            blk.scale = s * float(factor[p])
        want.append(b.forward([tok]))
    got, want = np.concatenate(got), np.concatenate(want)
    # on emu the latent kernel reads q in bf16: the factor applied before that rounding or in the scale after it
    assert _nmse(got, want) < (1e-9 if device.kind == "cpu" else 2e-5)
    plain = build_decoder(base, lambda n: tensors[n], device, LoadOptions(ctx=32)).forward(tokens)
    assert _nmse(plain[FLOOR:], got[FLOOR:]) > 1e-4  # the factor does change the far tokens
