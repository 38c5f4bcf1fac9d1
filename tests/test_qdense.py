"""GGUF models whose non-expert matrices are Q8_0 / Q4_0 kept in their file blocks (storage, bytes, fused q/k/v)
against the same files loaded with dequantized float32 weights. The kernels themselves (cpu_kernels/qgemv.py,
dense_gemv_q8_0 / dense_gemv_q4_0 and dense_dequant_* in cuda/dense.cu) are registry cases
(tests/test_kernel_parity.py); Linear over a QuantizedMatrix is in tests/test_linear.py."""

import warnings

import numpy as np
import pytest

from freetoken.models.linear import Linear
from freetoken.testing import assert_close
from freetoken.testing.oracles import need

KINDS = ("q8_0", "q4_0")

# -------------------------------------------------------------------------------------------- GGUF end to end

need("torch")  # tiny_models builds its checkpoints with torch and transformers
need("transformers")
from tiny_models import make_checkpoint  # noqa: E402

TOKENS = np.random.default_rng(1).integers(0, 128, 12)
# mixtral: llama Q/K row permutation on block rows; qwen2_moe: q/k/v biases, a shared expert next to its f32
# sigmoid gate; qwen3_moe (tied embeddings): a dense MLP layer and the lm_head from the quantized token_embd.
MODELS = {"mixtral": {}, "qwen2_moe": {}, "qwen3_moe": {"tie_word_embeddings": True}}


@pytest.fixture(scope="module", params=[(f, o) for f in MODELS for o in KINDS], ids=lambda p: f"{p[0]}-{p[1]}")
def quantized_gguf(request, tmp_path_factory):
    from freetoken.convert import export_gguf

    family, other = request.param
    root = tmp_path_factory.mktemp(f"{family}_{other}")
    make_checkpoint(family, root / "hf", **MODELS[family])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no tokenizer.json in these checkpoints
        export_gguf(root / "hf", root / "m.gguf", experts="q4_0", other=other)
    return family, other, root / "m.gguf"


def _linears(decoder):
    """(key of _TENSORS, layer, Linear) of every dense projection of the decoder's blocks."""
    yield "lm_head", None, decoder.lm_head
    for i, lay in enumerate(decoder.layers):
        mlp = lay.mlp
        found = {"qkv": lay.attention.qkv, "o_proj": lay.attention.o_proj}
        if hasattr(mlp, "router"):  # a MoE layer
            found["router"] = mlp.router.gate
            if mlp.shared is not None:
                found.update(shared_in=mlp.shared.inp, shared_down=mlp.shared.down)
        else:
            found.update(mlp_in=mlp.gate_up, mlp_down=mlp.down)
        for key, v in found.items():
            assert isinstance(v, Linear)
            yield key, i, v


_TENSORS = {"qkv": ("attn_q", "attn_k", "attn_v"), "o_proj": ("attn_output",), "router": ("ffn_gate_inp",),
            "shared_in": ("ffn_gate_shexp", "ffn_up_shexp", "ffn_gate_inp_shexp"), "shared_down": ("ffn_down_shexp",),
            "mlp_in": ("ffn_gate", "ffn_up"), "mlp_down": ("ffn_down",)}


@pytest.mark.parametrize("dev_name", ["cpu", "emu"])
def test_gguf_quantized_non_expert_matrices(quantized_gguf, dev_name, monkeypatch):
    from freetoken.device import device_status
    from freetoken.engine.loading.load import load
    from freetoken.models.weights import GGUFWeights

    ok, why = device_status()[dev_name]
    if not ok:
        pytest.skip(f"{dev_name} unavailable: {why}")
    family, other, path = quantized_gguf
    model = load(path, device=dev_name, ctx=64)
    dec = model.decoder
    gf = dec.weights.gguf
    seen = set()
    for key, i, lin in _linears(dec):
        if key == "lm_head":
            names = ["output.weight" if gf.has("output.weight") else "token_embd.weight"]
        else:
            names = [n for t in _TENSORS[key] for s in (".weight", ".bias")
                     if gf.has(n := f"blk.{i}.{t}{s}")]
        types = [gf.info(n).type for n in names if n.endswith(".weight")]
        file_bytes = sum(gf.get_raw(n)[0].nbytes for n in names)
        if key == "router":
            assert types == ["F32"]
            continue
        seen.add(key)
        if key == "shared_in":  # the f32 sigmoid gate row rides along in its own part
            assert lin.storage.startswith(f"{other}+"), lin.storage
        else:
            assert types == [other.upper()] * len(types), (key, types)
            assert lin.storage == other, (key, lin.storage)
        if key != "shared_in" or lin.storage == f"{other}+f32":
            assert lin.nbytes == file_bytes, (key, lin.nbytes, file_bytes)
    assert {"lm_head", "qkv", "o_proj"} <= seen
    got = model.logits(TOKENS)
    monkeypatch.setattr(GGUFWeights, "get_matrix", GGUFWeights.get)
    monkeypatch.setattr(GGUFWeights, "quantized_kind", lambda self, key, layer=None: None)
    ref_model = load(path, device=dev_name, ctx=64)
    assert all(lin.storage in ("bf16", "f16", "f32") for _, _, lin in _linears(ref_model.decoder))
    want = ref_model.logits(TOKENS)
    assert_close(got, want, atol=1e-5 * float(np.abs(want).max()), name=f"{family} {other} logits")
