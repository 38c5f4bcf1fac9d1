"""GGUF models: our exporter (freetoken.convert) and loader (freetoken.load on a .gguf file) for every family.

An F32 export must load to exactly the logits of the HF directory it came from (names, metadata, Mixtral's
Q/K permutation, shared experts, tied embeddings all round-trip); a Q4_0 export runs its experts in q4_0 banks
moved bit for bit, equal to the HF model run with q4_0 experts. Bad files fail before any long work, naming the
file and the tensor."""

import shutil
import warnings

import numpy as np
import pytest
from tiny_models import FAMILIES, GGUF_OVERRIDES, make_checkpoint

from freetoken.convert import export_gguf
from freetoken.engine.loading.load import load
from freetoken.loaders import LoadError
from freetoken.models import ConfigError
from freetoken.testing.oracles import need

# every test reads a checkpoint that transformers wrote
need("torch")
need("transformers")

TOKENS = np.random.default_rng(1).integers(0, 128, 24)


@pytest.fixture(scope="module", params=list(FAMILIES))
def exported(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    make_checkpoint(request.param, root / "hf", **GGUF_OVERRIDES.get(request.param, {}))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no tokenizer.json in these checkpoints
        export_gguf(root / "hf", root / "f32.gguf", experts="f32", other="f32")
        export_gguf(root / "hf", root / "q4.gguf", experts="q4_0", other="f32")
    return request.param, root


def test_f32_export_round_trips_exactly(exported):
    family, root = exported
    want = load(root / "hf", device="cpu").logits(TOKENS)
    model = load(root / "f32.gguf", device="cpu")
    assert model.config.family == family
    np.testing.assert_array_equal(model.logits(TOKENS), want)


def test_q4_0_experts_are_moved_not_requantized(exported, device):
    _, root = exported
    want = load(root / "hf", device=device.kind, expert_format="q4_0").logits(TOKENS)
    model = load(root / "q4.gguf", device=device.kind)
    assert model.experts.layout.fmt.name == "q4_0"
    got = model.logits(TOKENS)
    np.testing.assert_array_equal(got, want)


#: Per family, the bounds of test_quantized_non_expert_weights that differ: (per-token NMSE, argmax agreement) by type.
#: The Gated DeltaNet layers carry a rounding through their recurrent state (the decay and write strength come out of
#: sigmoid / softplus / exp of projections), so the same weight rounding moves these tiny models' logits ~10-100x more
#: than the attention-only families' (measured: f16 4e-7 .. 7e-5, q8_0 5e-4 .. 7e-2 per token; argmax 19 of 24 with
#: q8_0, qwen3_next); test_f16_matrices_are_the_checkpoint_rounded shows the file holds exactly the rounded values.
HYBRID_BOUNDS = {"f16": (1e-4, 0.9), "q8_0": (1e-1, 0.75)}
QUANTIZED_BOUNDS = {"qwen3_next": HYBRID_BOUNDS, "qwen3_5_moe": HYBRID_BOUNDS}


@pytest.mark.parametrize("other, bound", [("f16", 1e-5), ("q8_0", 2e-2)])
def test_quantized_non_expert_weights(exported, tmp_path, other, bound):
    family, root = exported
    bound, agree = QUANTIZED_BOUNDS.get(family, {}).get(other, (bound, 0.9 if other == "f16" else 0.8))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        export_gguf(root / "hf", tmp_path / "m.gguf", experts="q4_0", other=other)
    # float32 expert inputs on both sides: what is measured is the non-expert weights' rounding alone (8-bit
    # activations would add rounding-boundary flips that any small input change triggers)
    # and float32 keys and values (a bf16 cache would round small differences across its rounding boundaries)
    want = load(root / "hf", device="cpu", expert_format="q4_0", cpu_activations="f32", kv_dtype="f32").logits(TOKENS)
    got = load(tmp_path / "m.gguf", device="cpu", cpu_activations="f32", kv_dtype="f32").logits(TOKENS)
    per_token = ((got - want) ** 2).sum(-1) / (want**2).sum(-1)
    # measured on these checkpoints: f16 4e-7 .. 7e-7; q8_0 2e-4 .. 6e-3 (top-k routing amplifies small changes).
    # A router near-tie that the rounding flips moves one token's logits far (deepseek_v3: 0.84 at one token of 24,
    # where a whole expert group changed; glm4_moe 0.1): the bound holds for all but such a token
    assert (per_token < bound).mean() >= 0.9, per_token
    # the tiny models' logits are flat: after such a flip (it changes the KV rows of the tokens after it) q8_0 moves
    # a few more argmaxes (deepseek_v3: 21 of 24 agree)
    assert (got.argmax(-1) == want.argmax(-1)).mean() >= agree


#: The HF tensors an export keeps in float32 whatever ``other`` says (routers, the shared expert's gate, norms and
#: other vectors, the linear layers' convolution) or writes as experts.
_KEPT_F32 = (".gate.weight", "mlp.router.weight", "shared_expert_gate.weight", ".experts.")


def test_f16_matrices_are_the_checkpoint_rounded(exported, tmp_path):
    """An export with f16 non-expert matrices loads to exactly the logits of the HF checkpoint with those matrices
    rounded to float16 (and the same q4_0 experts): every row move and split the file format makes is exact, so what
    test_quantized_non_expert_weights measures is the rounding alone."""
    from safetensors.numpy import load_file, save_file

    _, root = exported
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        export_gguf(root / "hf", tmp_path / "m.gguf", experts="q4_0", other="f16")
    shutil.copytree(root / "hf", tmp_path / "hf16")
    for f in (tmp_path / "hf16").glob("*.safetensors"):
        t = load_file(str(f))
        save_file({k: v.astype(np.float16).astype(v.dtype) if v.ndim == 2 and not any(x in k for x in _KEPT_F32)
                   else v for k, v in t.items()}, str(f))
    want = load(tmp_path / "hf16", device="cpu", expert_format="q4_0").logits(TOKENS)
    np.testing.assert_array_equal(load(tmp_path / "m.gguf", device="cpu").logits(TOKENS), want)


def test_q8_activations_against_the_float_path(exported):
    """The cpu int8 path (8-bit expert inputs) against float32 inputs on the same q4_0 experts: the one rounding
    llama.cpp's q8_0 dots make too. Measured on these checkpoints: NMSE 1e-5 .. 6e-5 (the bundled model's q4_0 export:
    see bench/q8_logits.py); bounded at 1e-3, with the greedy tokens mostly unchanged."""
    from freetoken.device.simd import simd_level

    _, root = exported
    f32 = load(root / "q4.gguf", device="cpu", cpu_activations="f32").logits(TOKENS)
    q8 = load(root / "q4.gguf", device="cpu", cpu_activations="q8").logits(TOKENS)
    auto = load(root / "q4.gguf", device="cpu").logits(TOKENS)
    np.testing.assert_array_equal(auto, q8 if simd_level() != "none" else f32)
    nmse = ((q8 - f32) ** 2).sum() / (f32**2).sum()
    assert 0 < nmse < 1e-3, nmse
    assert (q8.argmax(-1) == f32.argmax(-1)).mean() >= 0.9


# ---- bad input -------------------------------------------------------------------------------------------------


def _rewrite(src, dst, drop=(), reshape=None, arch=None, rename=None, meta=None, negate=None):
    """Copy a GGUF file with tensors dropped / one tensor replaced by a differently shaped one / tensors renamed
    (``rename``: old -> new name) / metadata values replaced (``meta``: key -> value) / one float tensor's values
    negated (``negate``: its name)."""
    import gguf

    from freetoken.loaders.gguf_file import field_value

    r = gguf.GGUFReader(src)
    w = gguf.GGUFWriter(dst, arch or r.fields["general.architecture"].contents())
    for name, f in r.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        v = field_value(f) if name not in (meta or {}) else meta[name]
        t = f.types[0]
        if t == gguf.GGUFValueType.ARRAY:
            w.add_array(name, v.tolist() if isinstance(v, np.ndarray) else list(v))
        else:
            w.add_key_value(name, v, t)
    for t in r.tensors:
        if t.name in drop:
            continue
        data = np.asarray(t.data)
        if reshape and t.name == reshape:
            data = np.zeros((3, 5), np.float32)
        if negate and t.name == negate:
            data = -data
        w.add_tensor((rename or {}).get(t.name, t.name), data,
                     raw_dtype=t.tensor_type if data.dtype == np.uint8 else None)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _f32_export(root, family: str):
    """``family``'s tiny checkpoint in ``root / "hf"`` and its F32 export ``root / "ok.gguf"``; returns the file."""
    make_checkpoint(family, root / "hf")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return export_gguf(root / "hf", root / "ok.gguf", experts="f32", other="f32")


@pytest.fixture(scope="module")
def qwen3_gguf(tmp_path_factory):
    root = tmp_path_factory.mktemp("bad")
    _f32_export(root, "qwen3_moe")
    return root


def test_missing_tensor_is_named(qwen3_gguf, tmp_path):
    _rewrite(qwen3_gguf / "ok.gguf", tmp_path / "m.gguf", drop=("blk.1.attn_k.weight",))
    with pytest.raises(LoadError, match=r"m\.gguf.*blk\.1\.attn_k\.weight.*missing"):
        load(tmp_path / "m.gguf", device="cpu")


def test_wrong_shape_is_named(qwen3_gguf, tmp_path):
    _rewrite(qwen3_gguf / "ok.gguf", tmp_path / "m.gguf", reshape="blk.0.attn_v.weight")
    with pytest.raises(LoadError, match=r"blk\.0\.attn_v\.weight.*expected shape \[32, 64\], got \[3, 5\]"):
        load(tmp_path / "m.gguf", device="cpu")


def test_unsupported_architecture(qwen3_gguf, tmp_path):
    _rewrite(qwen3_gguf / "ok.gguf", tmp_path / "m.gguf", arch="gemma")
    with pytest.raises(LoadError, match="architecture 'gemma' is not supported"):
        load(tmp_path / "m.gguf", device="cpu")


def test_dense_llama_is_refused(qwen3_gguf, tmp_path):
    _rewrite(qwen3_gguf / "ok.gguf", tmp_path / "m.gguf", arch="llama")  # qwen3moe.* keys -> no llama.expert_count
    with pytest.raises(ConfigError, match="missing metadata key .llama.block_count.|without experts"):
        load(tmp_path / "m.gguf", device="cpu")


def test_truncated_file(qwen3_gguf, tmp_path):
    data = (qwen3_gguf / "ok.gguf").read_bytes()
    (tmp_path / "t.gguf").write_bytes(data[: len(data) - 1000])
    with pytest.raises(LoadError, match="truncated"):
        load(tmp_path / "t.gguf", device="cpu")


def test_failed_export_leaves_nothing(qwen3_gguf, tmp_path):
    shutil.copytree(qwen3_gguf / "hf", tmp_path / "hf")
    (tmp_path / "hf" / "model.safetensors").write_bytes(b"garbage")
    with pytest.raises(LoadError):
        export_gguf(tmp_path / "hf", tmp_path / "out.gguf")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]


def test_fused_gate_up_experts_are_refused(qwen3_gguf, tmp_path):
    _rewrite(qwen3_gguf / "ok.gguf", tmp_path / "m.gguf", rename={"blk.0.ffn_gate_exps.weight":
                                                                 "blk.0.ffn_gate_up_exps.weight"})
    with pytest.raises(ConfigError, match=r"m\.gguf: blk\.0\.ffn_gate_up_exps\.weight: experts with gate and up fused"):
        load(tmp_path / "m.gguf", device="cpu")


@pytest.fixture(scope="module")
def next_gguf(tmp_path_factory):
    """A Qwen3-Next export (linear, full, linear, full layers)."""
    return _f32_export(tmp_path_factory.mktemp("next"), "qwen3_next")


def test_layer_kinds_must_match_the_tensors(next_gguf, tmp_path):
    _rewrite(next_gguf, tmp_path / "m.gguf", meta={"qwen3next.attention.recurrent_layers": [True] * 4})
    with pytest.raises(ConfigError, match=r"m\.gguf: qwen3next\.attention\.recurrent_layers makes layer 1 a "
                                          r"linear-attention \(Gated DeltaNet\) layer, but the file lacks "
                                          r"blk\.1\.ssm_a"):
        load(tmp_path / "m.gguf", device="cpu")
    _rewrite(next_gguf, tmp_path / "n.gguf", meta={"qwen3next.attention.recurrent_layers": [True] * 3})
    with pytest.raises(ConfigError, match=r"recurrent_layers has 3 entries for 4 blocks"):
        load(tmp_path / "n.gguf", device="cpu")


def test_older_fused_ssm_in_is_refused(next_gguf, tmp_path):
    _rewrite(next_gguf, tmp_path / "m.gguf", rename={"blk.0.attn_qkv.weight": "blk.0.ssm_in.weight"})
    with pytest.raises(ConfigError, match=r"m\.gguf: blk\.0\.ssm_in\.weight: the fused q\|k\|v\|z projection"):
        load(tmp_path / "m.gguf", device="cpu")


def test_missing_linear_attention_tensor_is_named(next_gguf, tmp_path):
    _rewrite(next_gguf, tmp_path / "m.gguf", drop=("blk.2.ssm_conv1d.weight",))
    with pytest.raises(LoadError, match=r"m\.gguf.*blk\.2\.ssm_conv1d\.weight.*missing"):
        load(tmp_path / "m.gguf", device="cpu")
    _rewrite(next_gguf, tmp_path / "n.gguf", meta={"qwen3next.ssm.inner_size": 66})
    with pytest.raises(ConfigError, match=r"qwen3next\.ssm\.inner_size 66 is not a whole number of value heads"):
        load(tmp_path / "n.gguf", device="cpu")


def test_positive_ssm_a_is_refused(next_gguf, tmp_path):
    _rewrite(next_gguf, tmp_path / "a.gguf", negate="blk.0.ssm_a")
    with pytest.raises(LoadError, match=r"blk\.0\.ssm_a.*expected -exp\(A_log\)"):
        load(tmp_path / "a.gguf", device="cpu")



def test_tiled_value_heads_read_back_in_blocks(tmp_path):
    """qwen35moe stores the value heads in llama.cpp's tiled order: quantized rows move whole, and ssm_out's columns
    (heads of Dv = 32: whole Q8_0 blocks) move block by block, giving exactly the float reads of the same file."""
    from freetoken.loaders import GGUFFile, SafetensorsDir
    from freetoken.models.config import from_gguf, from_hf
    from freetoken.models.qmatrix import QuantizedMatrix
    from freetoken.models.weights import GGUFWeights, HFWeights

    make_checkpoint("qwen3_5_moe", tmp_path / "hf", linear_value_head_dim=32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        export_gguf(tmp_path / "hf", tmp_path / "m.gguf", experts="q4_0", other="q8_0")
    gf = GGUFFile(tmp_path / "m.gguf")
    w = GGUFWeights(from_gguf(gf), gf)
    sd = SafetensorsDir(tmp_path / "hf")
    hf = HFWeights(from_hf(sd.config), sd.get, sd.has)
    for key in ("lin_qkv", "lin_z", "lin_b", "lin_a", "lin_out"):
        m = w.get_matrix(key, 0)
        assert isinstance(m, QuantizedMatrix) and m.kind == "q8_0", key
        np.testing.assert_array_equal(m.dequantize(), w.get(key, 0))
        want = hf.get(key, 0)  # Q8_0's rounding only (a row or column out of place: NMSE ~2)
        assert ((m.dequantize() - want) ** 2).sum() / (want**2).sum() < 1e-4, key
