"""RoPE variants (default, linear, YaRN, llama3) against transformers: the frequencies and attention factor,
and a tiny Qwen3-MoE with YaRN scaling end to end (logits over a prompt that runs past the original context)."""

import json

import numpy as np
import pytest
from tiny_models import make_checkpoint

from freetoken.models import ConfigError, from_hf
from freetoken.models.rope import rope_frequencies
from freetoken.testing.oracles import need

VARIANTS = {
    "default": {"rope_type": "default"},
    "linear": {"rope_type": "linear", "factor": 4.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    "yarn_betas": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 128, "beta_fast": 16,
                   "beta_slow": 2, "attention_factor": 1.3},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64},
}


@pytest.mark.parametrize("name", list(VARIANTS))
def test_frequencies_match_transformers(name):
    torch, transformers = need("torch"), need("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = {"rope_theta": 10000.0, **VARIANTS[name]}
    cfg = transformers.Qwen3MoeConfig(hidden_size=64, num_attention_heads=4, head_dim=32, max_position_embeddings=256,
                                      rope_parameters=params)
    want_inv, want_attn = (ROPE_INIT_FUNCTIONS[params["rope_type"]](cfg, "cpu") if name != "default" else
                           (1.0 / 10000.0 ** (torch.arange(0, 32, 2, dtype=torch.float32) / 32), 1.0))
    got_inv, got_attn = rope_frequencies(32, 10000.0, None if name == "default" else params, 256)
    np.testing.assert_allclose(got_inv, want_inv.numpy(), rtol=2e-6)
    assert got_attn == pytest.approx(float(want_attn), rel=1e-9)


def test_yarn_model_matches_transformers(tmp_path):
    torch = need("torch")
    from safetensors.numpy import load_file

    from freetoken.device import get_device
    from freetoken.engine.loading.build import build_decoder
    from freetoken.engine.options import LoadOptions

    scaling = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "rope_theta": 10000.0}
    model = make_checkpoint("qwen3_moe", tmp_path, rope_parameters=scaling, max_position_embeddings=64)
    cfg = from_hf(json.loads((tmp_path / "config.json").read_text()))
    assert cfg.rope_scaling["rope_type"] == "yarn"
    tokens = np.random.default_rng(4).integers(0, 128, 40)  # 40 positions, 2.5x the original context
    with torch.no_grad():
        want = model(torch.from_numpy(tokens)[None]).logits[0].float().numpy()
    tensors = load_file(str(tmp_path / "model.safetensors"))
    dec = build_decoder(cfg, lambda n: tensors[n], get_device("cpu"), LoadOptions(ctx=64))
    got = np.concatenate([dec.forward(tokens[:32]), *(dec.forward(tokens[i:i + 1]) for i in range(32, 40))])
    nmse = float(((got - want) ** 2).sum() / (want**2).sum())
    assert nmse < 5e-5, nmse  # bf16 experts, as in test_model_parity


def test_unsupported_scaling_is_named():
    base = dict(model_type="qwen3_moe", hidden_size=64, num_hidden_layers=1, num_attention_heads=4, num_experts=4,
                num_experts_per_tok=2, moe_intermediate_size=32, vocab_size=16)
    with pytest.raises(ConfigError, match="rope scaling 'dynamic' is not supported"):
        from_hf({**base, "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}})
    with pytest.raises(ConfigError, match="rope scaling 'yarn' without factor"):
        from_hf({**base, "rope_scaling": {"rope_type": "yarn"}})
