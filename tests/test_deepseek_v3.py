"""DeepSeek-V3 beyond the shared parity tests (test_model_parity, test_gguf_model, the llama.cpp modules): the latent
KV cache's size, the attention variants a checkpoint may pick, prefix reuse over a keys-only pool, and what is
refused by name; DeepSeek-V2's routers."""

import json

import numpy as np
import pytest
from reuse_checks import assert_reuse_close, prefill_logits
from tiny_models import FAMILIES, make_checkpoint

from freetoken.engine.loading.load import load
from freetoken.models import ConfigError
from freetoken.models.config import from_hf
from freetoken.models.kv import kv_token_bytes
from freetoken.testing.oracles import need

#: DeepSeek-V3's own config.json (the fields the decoder reads; weights are not needed to size its cache).
DEEPSEEK_V3 = {
    "model_type": "deepseek_v3", "vocab_size": 129280, "hidden_size": 7168, "intermediate_size": 18432,
    "moe_intermediate_size": 2048, "num_hidden_layers": 61, "num_attention_heads": 128, "num_key_value_heads": 128,
    "n_shared_experts": 1, "n_routed_experts": 256, "routed_scaling_factor": 2.5, "kv_lora_rank": 512,
    "q_lora_rank": 1536, "qk_rope_head_dim": 64, "v_head_dim": 128, "qk_nope_head_dim": 128, "topk_method": "noaux_tc",
    "n_group": 8, "topk_group": 4, "num_experts_per_tok": 8, "first_k_dense_replace": 3, "norm_topk_prob": True,
    "scoring_func": "sigmoid", "max_position_embeddings": 163840, "rms_norm_eps": 1e-6, "rope_theta": 10000,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "num_nextn_predict_layers": 1, "tie_word_embeddings": False,
}


def test_latent_cache_bytes_per_token():
    """One row of kv_lora_rank + qk_rope_head_dim = 576 values per token and layer: 70,272 bytes a token in bf16 over
    61 layers, where expanded keys and values (128 heads x (192 + 128)) would take 71x that."""
    cfg = from_hf(DEEPSEEK_V3)
    assert (cfg.kv_cache_heads, cfg.kv_cache_dim, cfg.kv_cache_values) == (1, 576, False)
    got = kv_token_bytes(cfg.num_layers, cfg.kv_cache_heads, cfg.kv_cache_dim, "bf16", values=cfg.kv_cache_values)
    assert got == 61 * 576 * 2 == 70272
    expanded = 61 * 128 * (192 + 128) * 2
    assert expanded // got == 71
    assert kv_token_bytes(61, 1, 576, "fp8", values=False) == 61 * (576 + 4)  # a scale per row
    # the softmax scale: 1/sqrt(192) times YaRN's mscale_all_dim factor squared, (0.1 ln 40 + 1)^2
    assert cfg.attention_scale == pytest.approx(192 ** -0.5 * (0.1 * np.log(40) + 1) ** 2)
    assert cfg.mtp_layers == 1 and cfg.moe_layers[:4] == (False, False, False, True)


def _nmse(got, want):
    return float(((got - want) ** 2).sum() / (want**2).sum())


@pytest.mark.parametrize("overrides", [
    dict(q_lora_rank=None),  # a plain q_proj (DeepSeek-V2-Lite's shape)
    dict(rope_interleave=False),  # rope dims already in rotate-half order
    dict(rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),  # no YaRN
], ids=["plain_q", "rope_not_interleaved", "no_yarn"])
def test_attention_variants_match_transformers(overrides, tmp_path):
    torch = need("torch")
    model = make_checkpoint("deepseek_v3", tmp_path / "hf", **overrides)
    tokens = np.random.default_rng(4).integers(0, 128, 24)
    with torch.no_grad():
        want = model(torch.tensor(tokens)[None]).logits[0].float().numpy()
    got = load(tmp_path / "hf", device="cpu").logits(tokens)
    assert _nmse(got, want) < 5e-5  # as the shared parity test's bound (bf16 experts and KV cache)


@pytest.mark.parametrize("overrides", [dict(topk_method="greedy", n_group=None, topk_group=None),
                                       dict(q_lora_rank=24)], ids=["greedy", "q_lora"])
def test_deepseek_v2_variants_match_transformers(overrides, tmp_path):
    """DeepSeek-V2's other router (plain greedy top-k of the softmax) and a low-rank query; the shared parity test
    runs its group-limited greedy with a plain q_proj."""
    torch = need("torch")
    model = make_checkpoint("deepseek_v2", tmp_path / "hf", **overrides)
    tokens = np.random.default_rng(4).integers(0, 128, 24)
    with torch.no_grad():
        want = model(torch.tensor(tokens)[None]).logits[0].float().numpy()
    got = load(tmp_path / "hf", device="cpu").logits(tokens)
    assert _nmse(got, want) < 5e-5


def test_prefix_reuse_over_the_latent_cache(tmp_path):
    """The keys-only pool goes through the prefix cache as any other: a second prompt that extends the first reuses
    its latent rows and gives the logits of a fresh run."""
    need("torch")
    make_checkpoint("deepseek_v3", tmp_path / "hf")
    model = load(tmp_path / "hf", device="cpu")
    assert model.decoder.pool.v is None
    rng = np.random.default_rng(6)
    first = rng.integers(0, 128, 70).tolist()  # more than one 64-token block
    second = first + rng.integers(0, 128, 9).tolist()
    prefill_logits(model, first, reuse_cache=True)
    got, st = prefill_logits(model, second, reuse_cache=True)
    assert st.cached_tokens >= 64
    fresh = load(tmp_path / "hf", device="cpu")
    assert_reuse_close(got, prefill_logits(fresh, second)[0])


@pytest.mark.parametrize("edit, match", [
    (dict(topk_method="group_limited_greedy"), "'topk_method' = 'group_limited_greedy'"),
    (dict(model_type="deepseek_v2", topk_method="noaux_tc"), "'topk_method' = 'noaux_tc'"),
    (dict(scoring_func="softmax"), "'scoring_func' = 'softmax'"),
    (dict(attention_bias=True), "'attention_bias' = True"),
    (dict(qk_rope_head_dim=7), "qk_rope_head_dim 7 must be even"),
    (dict(kv_lora_rank=2000), "at most 1024"),
])
def test_refused_by_name(edit, match):
    with pytest.raises(ConfigError, match=match):
        from_hf({**DEEPSEEK_V3, **edit})


def test_tiny_checkpoint_config_is_what_the_tests_think(tmp_path):
    need("torch")
    make_checkpoint("deepseek_v3", tmp_path / "hf")
    cfg = from_hf(json.loads((tmp_path / "hf" / "config.json").read_text()))
    extra = FAMILIES["deepseek_v3"][2]
    assert cfg.mla and cfg.q_lora_rank == extra["q_lora_rank"] and cfg.rope_interleave
    assert cfg.head_dim == extra["qk_nope_head_dim"] + extra["qk_rope_head_dim"]


def test_gguf_with_a_whole_kv_b_loads_alike(tmp_path):
    """Files from llama.cpp's converter before it split ``kv_b_proj`` hold one ``attn_kv_b`` [H * (nope + v), R]
    instead of ``attn_k_b`` / ``attn_v_b``: such a file (ours, rewritten that way) loads to the same logits."""
    import warnings

    import gguf

    from freetoken.convert import export_gguf
    from freetoken.loaders import GGUFFile
    from freetoken.models.config import from_gguf
    from freetoken.models.weights import GGUFWeights

    need("torch")
    make_checkpoint("deepseek_v3", tmp_path / "hf")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no tokenizer
        split = export_gguf(tmp_path / "hf", tmp_path / "split.gguf", experts="f32", other="f32")
    gf = GGUFFile(split)
    weights = GGUFWeights(from_gguf(gf), gf)
    reader = gguf.GGUFReader(split)
    writer = gguf.GGUFWriter(tmp_path / "whole.gguf", reader.fields["general.architecture"].contents())
    for field in reader.fields.values():
        if field.name == "general.architecture" or field.name.startswith("GGUF."):
            continue
        sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), field.types[0], sub_type=sub)
    for t in reader.tensors:
        if t.name.endswith(("attn_k_b.weight", "attn_v_b.weight")):
            if t.name.endswith("attn_k_b.weight"):
                layer = int(t.name.split(".")[1])
                writer.add_tensor(f"blk.{layer}.attn_kv_b.weight", weights.get("kv_b_proj", layer))
            continue
        assert t.tensor_type == gguf.GGMLQuantizationType.F32, t.name
        writer.add_tensor(t.name, np.asarray(t.data).reshape(tuple(int(d) for d in reversed(t.shape))))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert GGUFFile(tmp_path / "whole.gguf").has("blk.0.attn_kv_b.weight")
    tokens = np.random.default_rng(8).integers(0, 128, 20)
    np.testing.assert_array_equal(load(tmp_path / "whole.gguf", device="cpu").logits(tokens),
                                  load(split, device="cpu").logits(tokens))
