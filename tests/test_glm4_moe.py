"""GLM-4.5 (glm4_moe) beyond the shared parity tests: multi-token-prediction layers in the checkpoint are skipped
(and said so), and the config fields the decoder refuses by name."""

import json

import numpy as np
import pytest
from tiny_models import make_checkpoint

from freetoken.engine.loading.load import load
from freetoken.loaders import LoadError
from freetoken.models import ConfigError
from freetoken.models.config import from_hf
from freetoken.testing.oracles import need

TOKENS = np.random.default_rng(2).integers(0, 128, 20)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    need("torch")
    need("transformers")
    path = tmp_path_factory.mktemp("glm") / "hf"
    make_checkpoint("glm4_moe", path)
    return path


def _with_mtp_layer(src, dst, layer: int):
    """``src`` plus a layer ``layer``'s worth of multi-token-prediction tensors (GLM-4.5's names), as the release
    checkpoints store them after the decoder's layers."""
    from safetensors.numpy import load_file, save_file

    dst.mkdir()
    tensors = load_file(str(src / "model.safetensors"))
    h = 64
    extra = {"eh_proj.weight": (h, 2 * h), "enorm.weight": (h,), "hnorm.weight": (h,),
             "shared_head.norm.weight": (h,), "input_layernorm.weight": (h,), "mlp.gate.weight": (8, h),
             "mlp.experts.0.gate_proj.weight": (32, h), "self_attn.q_proj.weight": (64, h)}
    for name, shape in extra.items():
        tensors[f"model.layers.{layer}.{name}"] = np.ones(shape, np.float32)
    save_file(tensors, str(dst / "model.safetensors"))
    (dst / "config.json").write_text((src / "config.json").read_text())
    return dst


def test_mtp_layers_are_skipped_with_a_note(checkpoint, tmp_path):
    cfg = json.loads((checkpoint / "config.json").read_text())
    assert cfg["num_nextn_predict_layers"] == 1 and cfg["num_hidden_layers"] == 3
    mtp = _with_mtp_layer(checkpoint, tmp_path / "mtp", 3)
    got = load(mtp, device="cpu")
    assert got.config.mtp_layers == 1
    assert any("multi-token-prediction" in n and "layer 3" in n for n in got.config.notes())
    np.testing.assert_array_equal(got.logits(TOKENS), load(checkpoint, device="cpu").logits(TOKENS))


def test_a_layer_past_the_mtp_layers_is_still_refused(checkpoint, tmp_path):
    bad = _with_mtp_layer(checkpoint, tmp_path / "bad", 4)
    with pytest.raises(LoadError, match="layer 4 is beyond num_hidden_layers"):
        load(bad, device="cpu")


@pytest.mark.parametrize("edit, match", [
    (dict(n_group=3), "expert groups: 8 experts do not split into 3 equal groups"),
    (dict(n_group=2, topk_group=3), "topk_group=3 must be in"),
    (dict(n_group=8), "equal groups of at least 2"),
    (dict(partial_rotary_factor=0.05, rope_parameters=None), "'partial_rotary_factor' = 0.05"),
    (dict(routed_scaling_factor=-1.0), "'routed_scaling_factor' = -1.0"),
])
def test_config_refusals(checkpoint, edit, match):
    cfg = json.loads((checkpoint / "config.json").read_text())
    cfg.update(edit)
    if cfg.get("rope_parameters") is None:
        cfg.pop("rope_parameters")
    with pytest.raises(ConfigError, match=match):
        from_hf(cfg)


def test_defaults_as_transformers_has_them(checkpoint):
    """A config that names no partial_rotary_factor or n_shared_experts gets transformers' Glm4MoeConfig defaults
    (0.5, 1), not full rotary and no shared expert."""
    cfg = json.loads((checkpoint / "config.json").read_text())
    cfg["rope_parameters"].pop("partial_rotary_factor")
    cfg.pop("n_shared_experts")
    got = from_hf(cfg)
    assert got.rotary_dim == 8 and got.shared_inter == 32
