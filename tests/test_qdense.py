"""GGUF Q8_0 / Q4_0 non-expert matrices kept in their file blocks: the kernels (cpu_kernels/qgemv.py,
dense_gemv_q8_0 / dense_gemv_q4_0 and dense_dequant_* in cuda/dense.cu) against gguf-py's dequantization in
float64, Linear from a QuantizedMatrix (storage, bytes, fused q/k/v, the chunked product), and GGUF models whose
non-expert matrices are Q8_0 / Q4_0 against the same files loaded with dequantized float32 weights."""

import warnings

import numpy as np
import pytest
from freetoken.cpu_kernels import qgemv
from test_dense import check_dense, check_every_token_count

import freetoken.models.linear as L
from freetoken.models.linear import Linear
from freetoken.models.qmatrix import BLOCK_BYTES, QuantizedMatrix
from freetoken.ops.cases import gguf_dequantized, quantized_blocks
from freetoken.ops.dense import MAX_TOKENS, dense_dequant, dense_gemv
from freetoken.testing import assert_close

KINDS = ("q8_0", "q4_0")
SHAPES = [(37, 32), (130, 96), (16, 256)]  # odd N; K a multiple of 32


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_qdense_gemv_matches_gguf_float64(device, kind, shape):
    n, k = shape
    w = quantized_blocks(kind, n, k, seed=n + k)
    w32 = gguf_dequantized(w, kind)
    dw = check_every_token_count(device, w, w32, kind)
    np.testing.assert_array_equal(device.to_host(dense_dequant(dw, kind, k, device=device)), w32)


def test_qdense_odd_base_and_special_scales(device):
    """Blocks whose base is odd (an offset view: the byte-load path) give the same results; inf / NaN scales
    propagate."""
    rng = np.random.default_rng(3)
    n, k = 5, 64
    for kind in KINDS:
        w = quantized_blocks(kind, n, k, seed=1)
        row = w.shape[1]
        flat = device.asarray(np.concatenate([np.zeros(1, np.uint8), w.reshape(-1)]))
        dw = flat[1:].reshape(n, row)
        x = rng.standard_normal((3, k), dtype=np.float32)
        got = device.to_host(dense_gemv(device.asarray(x), dw, kind, device=device))
        check_dense(got, x, gguf_dequantized(w, kind), None)
        np.testing.assert_array_equal(device.to_host(dense_dequant(dw, kind, k, device=device)),
                                      gguf_dequantized(w, kind))
        ws = w.copy()
        ws[1, :2] = np.array([np.inf], "<f2").view(np.uint8)
        ws[2, :2] = np.array([np.nan], "<f2").view(np.uint8)
        ones = device.asarray(np.ones((2, k), np.float32))
        got = device.to_host(dense_gemv(ones, device.asarray(ws), kind, device=device))
        assert np.isnan(got[:, 2]).all() and not np.isfinite(got[:, 1]).any() and np.isfinite(got[:, [0, 3, 4]]).all()


def test_qdense_errors(device):
    x = device.asarray(np.ones((2, 64), np.float32))
    with pytest.raises(ValueError, match="q8_0 w has 36 bytes per row but x has 64 columns"):
        dense_gemv(x, device.asarray(np.zeros((3, 36), np.uint8)), "q8_0", device=device)
    with pytest.raises(ValueError, match="q4_0 w has 18 bytes per row but x has 40 columns"):
        dense_gemv(device.asarray(np.ones((2, 40), np.float32)), device.asarray(np.zeros((3, 18), np.uint8)),
                   "q4_0", device=device)
    with pytest.raises(TypeError, match="w must be uint8 for storage 'q8_0'"):
        dense_gemv(x, device.asarray(np.zeros((3, 68), np.uint16)), "q8_0", device=device)
    with pytest.raises(ValueError, match="unknown quantized storage 'bf16'"):
        dense_dequant(device.asarray(np.zeros((3, 68), np.uint8)), "bf16", 64, device=device)
    with pytest.raises(ValueError, match="must be whole blocks of 32"):
        QuantizedMatrix("q8_0", np.zeros((3, 34), np.uint8), (3, 40))
    with pytest.raises(ValueError, match="unknown quantized kind"):
        QuantizedMatrix("q5_0", np.zeros((3, 34), np.uint8), (3, 32))


# ---------------------------------------------------------------------------------------------------- Linear

def _qmat(kind, n, k, seed):
    w = quantized_blocks(kind, n, k, seed=seed)
    return QuantizedMatrix(kind, w, (n, k)), gguf_dequantized(w, kind)


@pytest.mark.parametrize("kind", KINDS)
def test_linear_quantized(device, kind, monkeypatch):
    rng = np.random.default_rng(5)
    n, k = 45, 96
    q, w32 = _qmat(kind, n, k, seed=6)
    b = rng.standard_normal(n, dtype=np.float32)
    lin = Linear(q, device, bias=b)
    assert lin.storage == kind and lin.sizes == (n,)
    assert lin.nbytes == n * k // 32 * BLOCK_BYTES[kind] + b.nbytes == q.blocks.nbytes + b.nbytes
    np.testing.assert_array_equal(device.to_host(lin.weight), w32)
    np.testing.assert_array_equal(q.dequantize(), w32)
    monkeypatch.setattr(L, "CHUNK_ELEMENTS", 8 * k)  # gpu/emu T > 8: 6 chunks, the last one of 5 rows
    monkeypatch.setattr(qgemv, "QCHUNK_ELEMENTS", 8 * k)  # cpu T > 4: the same
    for t in (1, 2, 3, 5, 8, 20):
        x = rng.standard_normal((t, k), dtype=np.float32)
        got = device.to_host(lin(device.asarray(x)))
        check_dense(got, x, w32, b)
    assert device.to_host(lin(device.asarray(np.zeros((0, k), np.float32)))).shape == (0, n)
    with pytest.raises(ValueError, match=r"x must be \[T, 96\]"):
        lin(device.asarray(np.zeros((2, 95), np.float32)))


@pytest.mark.parametrize("kind", KINDS)
def test_linear_quantized_concat(device, kind):
    """Fused q/k/v: block rows stacked, every row the same dot product as in the separate matrices (T <= 8);
    mixed storages: one Linear per run, outputs concatenated, nothing dequantized."""
    rng = np.random.default_rng(13)
    k = 64
    parts = [_qmat(kind, n, k, seed=n) for n in (32, 8, 8)]
    qs, ws = [p[0] for p in parts], [p[1] for p in parts]
    bs = [rng.standard_normal(n, dtype=np.float32) for n in (32, 8, 8)]
    fused = Linear.concat(qs, device, bs)
    assert fused.sizes == (32, 8, 8) and fused.storage == kind
    assert fused.nbytes == sum(q.nbytes for q in qs) + 48 * 4
    np.testing.assert_array_equal(device.to_host(fused.weight), np.concatenate(ws))
    for t in (1, 3, MAX_TOKENS, 12):
        x = device.asarray(rng.standard_normal((t, k), dtype=np.float32))
        for part, q, w, b in zip(fused.split(fused(x)), qs, ws, bs, strict=True):
            assert part.shape == (t, q.shape[0])
            if t <= MAX_TOKENS:
                np.testing.assert_array_equal(device.to_host(part), device.to_host(Linear(q, device, b)(x)))
            check_dense(device.to_host(part), device.to_host(x), w, b)
    other = "q4_0" if kind == "q8_0" else "q8_0"
    sig = rng.standard_normal((1, k), dtype=np.float32)
    q2, w2 = _qmat(other, 8, k, seed=99)
    mixed = Linear.concat([qs[0], qs[1], q2, sig], device)
    assert mixed.storage == f"{kind}+{other}+f32" and mixed.sizes == (32, 8, 8, 1)
    assert mixed.nbytes == qs[0].nbytes + qs[1].nbytes + q2.nbytes + sig.nbytes
    wm = np.concatenate([ws[0], ws[1], w2, sig])
    np.testing.assert_array_equal(device.to_host(mixed.weight), wm)
    for t in (2, 12):
        x = rng.standard_normal((t, k), dtype=np.float32)
        y = mixed(device.asarray(x))
        assert [p.shape for p in mixed.split(y)] == [(t, 32), (t, 8), (t, 8), (t, 1)]
        check_dense(device.to_host(y), x, wm, None)


# -------------------------------------------------------------------------------------------- GGUF end to end

pytest.importorskip("torch")
pytest.importorskip("transformers")
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
    yield "lm_head", None, decoder.lm_head
    for i, lay in enumerate(decoder.layers):
        for key, v in lay.items():
            if isinstance(v, Linear):
                yield key, i, v


_TENSORS = {"qkv": ("attn_q", "attn_k", "attn_v"), "o_proj": ("attn_output",), "router": ("ffn_gate_inp",),
            "shared_in": ("ffn_gate_shexp", "ffn_up_shexp", "ffn_gate_inp_shexp"), "shared_down": ("ffn_down_shexp",),
            "mlp_in": ("ffn_gate", "ffn_up"), "mlp_down": ("ffn_down",)}


@pytest.mark.parametrize("dev_name", ["cpu", "emu"])
def test_gguf_quantized_non_expert_matrices(quantized_gguf, dev_name, monkeypatch):
    from freetoken.device import device_status
    from freetoken.engine.load import load
    from freetoken.models.weights import GGUFWeights

    ok, why = device_status()[dev_name]
    if not ok:
        pytest.skip(f"{dev_name} unavailable: {why}")
    family, other, path = quantized_gguf
    model = load(path, device=dev_name, max_len=64)
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
    ref_model = load(path, device=dev_name, max_len=64)
    assert all(lin.storage in ("bf16", "f16", "f32") for _, _, lin in _linears(ref_model.decoder))
    want = ref_model.logits(TOKENS)
    assert_close(got, want, atol=1e-5 * float(np.abs(want).max()), name=f"{family} {other} logits")
