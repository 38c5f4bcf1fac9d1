"""Block-FP8 HF checkpoints (DeepSeek-V3 / Qwen3-FP8 style: e4m3 weights + a float32 ``weight_scale_inv`` per
128x128 block), of a Qwen3-MoE and of a DeepSeek-V3 (latent attention: its q_a/q_b/kv_a/kv_b projections are fp8
too, as in DeepSeek's release). The non-expert linears stay fp8 (``fp8_block`` rows of the dense op); the
routed experts move into fp8_block banks without re-quantization. The oracle is transformers running the
dequantized weights in fp32: since freetoken decodes exactly those values, the logits agree to float32 rounding."""

import json
import struct

import ml_dtypes
import numpy as np
import pytest
from tiny_models import make_checkpoint

from freetoken.engine.loading.load import load
from freetoken.formats import fp8_block
from freetoken.loaders import LoadError
from freetoken.testing.oracles import need

# every test reads the checkpoint transformers wrote (and the first compares with its logits)
torch = need("torch")
need("transformers")

# hidden 160 and head_dim 16: blocks of 128 do not divide the matrices (partial blocks on both axes)
SHAPE = dict(hidden_size=160, moe_intermediate_size=96, intermediate_size=192)
TOKENS = np.random.default_rng(2).integers(0, 128, 21)


def write_safetensors(path, tensors: dict[str, np.ndarray]) -> None:
    """A safetensors file with any dtype (the library's NumPy writer has no float8)."""
    names = {np.dtype(ml_dtypes.float8_e4m3fn): "F8_E4M3", np.dtype(np.float32): "F32",
             np.dtype(ml_dtypes.bfloat16): "BF16"}
    header, offset, blobs = {}, 0, []
    for name, a in tensors.items():
        a = np.ascontiguousarray(a)
        header[name] = {"dtype": names[a.dtype], "shape": list(a.shape), "data_offsets": [offset, offset + a.nbytes]}
        offset += a.nbytes
        blobs.append(a.tobytes())
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw + b"".join(blobs))


def _quantized(name: str, w: np.ndarray) -> bool:
    # embeddings, norms, routers and lm_head stay as they are (DeepSeek's kv_a_proj_with_mqa is fp8 in its release)
    return w.ndim == 2 and name.endswith(("proj.weight", "proj_with_mqa.weight"))


#: The first MoE layer of each family's tiny checkpoint (DeepSeek-V3's layer 0 is dense). Qwen3-Next (Qwen3-Next's
#: FP8 release is this layout): its Gated DeltaNet projections are fp8 too.
FIRST_MOE = {"qwen3_moe": 0, "deepseek_v3": 1, "qwen3_next": 0}
#: A full-attention layer of each (Qwen3-Next's layer 0 is a linear-attention one).
ATTENTION_LAYER = {"qwen3_moe": 0, "deepseek_v3": 1, "qwen3_next": 1}


@pytest.fixture(scope="module", params=list(FIRST_MOE))
def fp8_checkpoint(request, tmp_path_factory):
    from safetensors.numpy import load_file

    root = tmp_path_factory.mktemp("fp8")
    # fp8 blocks want K a multiple of 32
    extra = {"deepseek_v3": {"q_lora_rank": 32}, "qwen3_next": {"shared_expert_intermediate_size": 96}}.get(
        request.param, {})
    model = make_checkpoint(request.param, root / "bf16", **SHAPE, **extra)
    src = load_file(str(root / "bf16" / "model.safetensors"))
    out, dequant = {}, {}
    for name, w in src.items():
        w = np.asarray(w, np.float32)
        if _quantized(name, w):
            banks = fp8_block.FORMAT.quantize(w[None])
            out[name] = banks["w"][0].view(ml_dtypes.float8_e4m3fn)
            out[name + "_scale_inv"] = banks["s"][0]
            dequant[name] = fp8_block.FORMAT.dequantize(banks)[0]
        else:
            out[name] = w
            dequant[name] = w
    (root / "fp8").mkdir()
    write_safetensors(root / "fp8" / "model.safetensors", out)
    cfg = json.loads((root / "bf16" / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                  "weight_block_size": [128, 128], "modules_to_not_convert": ["lm_head", "gate"]}
    (root / "fp8" / "config.json").write_text(json.dumps(cfg))
    # the oracle: the dequantized weights saved as an fp32 checkpoint, loaded by transformers itself (its module
    # layout may differ from the checkpoint's names, e.g. fused experts, so from_pretrained does the mapping)
    (root / "dequant").mkdir()
    write_safetensors(root / "dequant" / "model.safetensors", dequant)
    (root / "dequant" / "config.json").write_text((root / "bf16" / "config.json").read_text())
    model = type(model).from_pretrained(root / "dequant", dtype=torch.float32).eval()
    with torch.no_grad():
        want = model(torch.from_numpy(TOKENS)[None]).logits[0].float().numpy()
    return root, want, request.param


def test_fp8_checkpoint_matches_dequantized_transformers(fp8_checkpoint, device):
    root, want, family = fp8_checkpoint
    # float32 keys and values as transformers keeps them: what is measured is the fp8 experts' path alone
    # the cpu experts' float path: what is checked is the decode of the stored codes and scales, exactly
    model = load(root / "fp8", device=device.kind, kv_dtype="f32", cpu_activations="f32")
    assert model.experts.layout.fmt.name == "fp8_block"  # experts kept in their native format
    got = model.logits(TOKENS)
    nmse = float(((got - want) ** 2).sum() / (want**2).sum())
    # cpu: float32 rounding only (measured ~1e-13); emu's 21-token prefill rounds to bf16 for the tensor cores, which
    # Qwen3-Next's recurrent state carries on to every later token (measured 6.2e-5)
    emu = 2e-4 if family == "qwen3_next" else 5e-5
    assert nmse < (1e-10 if device.kind == "cpu" else emu), nmse
    if device.kind == "cpu":  # the reduced path (bf16 tokens, bf16 dots): measured 1.0e-5, 1.1e-5, 3.4e-5
        reduced = load(root / "fp8", device="cpu", kv_dtype="f32", cpu_activations="q8").logits(TOKENS)
        assert float(((reduced - want) ** 2).sum() / (want**2).sum()) < 2e-4


def test_fp8_experts_are_the_checkpoint_bits(fp8_checkpoint):
    from freetoken.loaders import SafetensorsDir

    root, _, family = fp8_checkpoint
    model = load(root / "fp8", device="cpu")
    banks = model.experts.banks[0][0]  # MoE layer 0, its one part
    sd = SafetensorsDir(root / "fp8")
    layer = FIRST_MOE[family]
    w = sd.get(f"model.layers.{layer}.mlp.experts.5.up_proj.weight")
    np.testing.assert_array_equal(banks["up.w"][5], w.view(np.uint8))
    np.testing.assert_array_equal(banks["up.s"][5],
                                  sd.get(f"model.layers.{layer}.mlp.experts.5.up_proj.weight_scale_inv"))


def test_fp8_linears_stay_fp8(fp8_checkpoint):
    """Every block-FP8 projection outside the experts is held as fp8_block rows (1 + 4/128 bytes per weight, not 4):
    the codes of the checkpoint, each row led by its tile's scales; rope row reordering (DeepSeek's kv_a / q_b)
    moves whole rows."""
    from freetoken.loaders import SafetensorsDir

    root, _, family = fp8_checkpoint
    model = load(root / "fp8", device="cpu")
    sd = SafetensorsDir(root / "fp8")
    at = ATTENTION_LAYER[family]
    att = model.decoder.layers[at].attention
    linears = {"o_proj": att.o_proj}
    if family == "qwen3_next":  # the q projection's output-gate rows, and the linear layer's output projection
        linears.update(out_gate=att.out_gate, out_proj=model.decoder.layers[0].attention.out)
    if family == "deepseek_v3":
        linears.update(q_a_proj=att.q_a, q_b_proj=att.q_b, kv_a_proj_with_mqa=att.kv_a)
        # kv_b_proj's absorbed halves: W_uk^T rows [H * R, nope] and W_uv rows [H * v, R], fp8 with their scales
        h, nope, v, r = att.heads, att.nope, att.v_dim, att.rank
        assert att.w_uk is None and att.w_uv_t is None
        assert att.uk_rows.shape == (h * r, nope + 4 * -(-nope // 128))
        assert att.uv_rows.shape == (h * v, r + 4 * -(-r // 128))
    else:
        linears["qkv"] = att.qkv
    for name, lin in linears.items():
        assert lin.storage == "fp8_block", (name, lin.storage)
        assert lin.nbytes == lin.out_features * (lin.in_features + 4 * -(-lin.in_features // 128)), name
    o = att.o_proj
    w = sd.get(f"model.layers.{at}.self_attn.o_proj.weight").view(np.uint8)
    s = sd.get(f"model.layers.{at}.self_attn.o_proj.weight_scale_inv")
    nkb = s.shape[1]
    np.testing.assert_array_equal(o._w[:, 4 * nkb:], w)
    np.testing.assert_array_equal(o._w[:, :4 * nkb].copy().view(np.float32), np.repeat(s, 128, axis=0)[:w.shape[0]])


def test_bad_scale_shape_is_named(fp8_checkpoint, tmp_path):
    from freetoken.loaders import SafetensorsDir

    root, _, _ = fp8_checkpoint
    sd = SafetensorsDir(root / "fp8")
    tensors = {n: np.asarray(sd.get(n)) for n in sd.names()}
    tensors["model.layers.1.self_attn.o_proj.weight_scale_inv"] = np.ones((3, 3), np.float32)
    (tmp_path / "m").mkdir()
    write_safetensors(tmp_path / "m" / "model.safetensors", tensors)
    (tmp_path / "m" / "config.json").write_text((root / "fp8" / "config.json").read_text())
    with pytest.raises(LoadError, match=r"o_proj\.weight_scale_inv.*expected a weight_scale_inv of shape \[2, 1\]"):
        load(tmp_path / "m", device="cpu")
