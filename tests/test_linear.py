"""The cpu device's dense kernels (cpu_kernels/gemv.py) against NumPy float64, Linear's matrix bookkeeping (storage
choice, concatenation and splitting, quantized matrices) on every device, and the decoder's logits against the plain
NumPy path."""

import json
from importlib import import_module

import ml_dtypes
import numpy as np
import pytest
from freetoken.cpu_kernels import fp8_dense, qgemv
from freetoken.cpu_kernels import gemv as G

from freetoken.device import get_device
from freetoken.models.linear import Linear, exact_storage, to_storage
from freetoken.models.qmatrix import QuantizedMatrix
from freetoken.ops.dense import row_bytes
from freetoken.testing import assert_close
from freetoken.testing.cases.dense import quantized_blocks
from freetoken.testing.oracles import need
from freetoken.testing.reference.dense import blocks_dequantized, dense_reference

CPU = get_device("cpu")
SHAPES = [(37, 50), (1024, 1024), (6, 33)]


def _bf16_exact(a):
    return a.astype(ml_dtypes.bfloat16).astype(np.float32)


def _f16_exact(a):
    return a.astype(np.float16).astype(np.float32)


def _stored(w32, kind):
    """(kernel weights, their exact float32 values) of ``w32`` rounded to ``kind``."""
    if kind == "bf16":
        v = _bf16_exact(w32)
        return (v.view(np.uint32) >> 16).astype(np.uint16), v
    if kind == "bf16_ml":
        v = _bf16_exact(w32)
        return v.astype(ml_dtypes.bfloat16), v
    if kind == "f16":
        v = _f16_exact(w32)
        return v.astype(np.float16), v
    return w32, w32


def _check(got, x, wv):
    want = x.astype(np.float64) @ wv.astype(np.float64).T
    bound = 1e-5 * (np.abs(x).astype(np.float64) @ np.abs(wv).astype(np.float64).T) + 1e-30
    assert got.dtype == np.float32 and got.shape == want.shape
    assert (np.abs(got - want) <= bound).all(), float((np.abs(got - want) / bound).max())


@pytest.mark.parametrize("kind", ["bf16", "bf16_ml", "f16", "f32"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_gemv_matches_float64(kind, shape):
    rng = np.random.default_rng(1)
    n, k = shape
    w, wv = _stored(rng.standard_normal((n, k), np.float32), kind)
    for t in [*range(1, 9), 13]:  # the GEMV kernel up to GEMV_MAX_TOKENS, the tiled one beyond
        x = rng.standard_normal((t, k), np.float32)
        _check(G.gemv(x, w), x, wv)


@pytest.mark.parametrize("kind", ["bf16", "f16", "f32"])
def test_both_kernels_every_remainder(kind):
    """Each kernel at every T in 1..9 and 25 (token tiles of 4, 6 or 12 and a short last one), partial 16-row
    panels (N = 36..39, 47) and a K that is not a multiple of 16 (the panel widening's column tail)."""
    rng = np.random.default_rng(2)
    for n in (36, 37, 38, 39, 47):
        w, wv = _stored(rng.standard_normal((n, 50), np.float32), kind)
        w = G.storage_view(w)
        for t in (*range(1, 10), 25):
            x = rng.standard_normal((t, 50), np.float32)
            out = np.full((t, n), np.nan, np.float32)
            G._gemv_kernel(x, w, out)
            _check(out, x, wv)
            out = np.full((t, n), np.nan, np.float32)
            G._gemm_kernel(x, w, out, 2)
            _check(out, x, wv)


@pytest.mark.parametrize("kind", ["bf16", "f16", "f32"])
def test_lane_kernel_every_remainder_and_special_values(kind):
    """The explicit-vector GEMV (K a multiple of 16): groups of 8 rows and the N % 8 rows after them (N = 1, 7, 8,
    36..39, 47), an odd and an even count of 16-value chunks (K = 48, 64), T = 1..4, on the calling thread and in
    parallel; inf and NaN weights propagate."""
    rng = np.random.default_rng(5)
    for k in (48, 64):
        for n in (1, 7, 8, 36, 37, 38, 39, 47):
            w, wv = _stored(rng.standard_normal((n, k), np.float32), kind)
            w = G.storage_view(w)
            for t in range(1, 5):
                x = rng.standard_normal((t, k), np.float32)
                for kernel in (G._gemv16_kernel, G._gemv16_serial):
                    out = np.full((t, n), np.nan, np.float32)
                    kernel(x, w, out)
                    _check(out, x, wv)
    w = np.ones((9, 32), np.float32)
    w[1, 3], w[2, 0], w[3, 31], w[8, 17] = np.inf, np.nan, -np.inf, np.nan
    ws = G.storage_view(to_storage(w, kind))
    for t in (1, 2):
        out = np.empty((t, 9), np.float32)
        G._gemv16_kernel(np.ones((t, 32), np.float32), ws, out)
        np.testing.assert_array_equal(out, np.broadcast_to([32.0, np.inf, np.nan, -np.inf] + [32.0] * 4 + [np.nan],
                                                           (t, 9)))


def test_gemv_token_panels_and_arguments():
    rng = np.random.default_rng(3)
    w = rng.standard_normal((40, 300), np.float32).astype(np.float16)
    x = rng.standard_normal((G.PANEL_BYTES // (4 * 300) * 2 + 5, 300), np.float32)  # > 2 panels of tokens
    out = np.empty((x.shape[0], 40), np.float32)
    assert G.gemv(x, w, out) is out
    _check(out, x, w.astype(np.float32))
    _check(G.gemv(x[0], w), x[:1], w.astype(np.float32))  # a vector is one token
    assert G.gemv(np.zeros((0, 300), np.float32), w).shape == (0, 40)
    with pytest.raises(ValueError, match="columns"):
        G.gemv(x[:, :299], w)
    with pytest.raises(ValueError, match="out must be"):
        G.gemv(x, w, np.empty((x.shape[0], 41), np.float32))
    with pytest.raises(TypeError, match="float32, float16 or bf16"):
        G.gemv(x, w.astype(np.float64))


def test_special_values_propagate():
    w = np.ones((5, 8), np.float32)
    w[1, 3], w[2, 0], w[3, 7] = np.inf, np.nan, -np.inf
    x = np.ones((2, 8), np.float32)
    for kind in ("bf16", "f16", "f32"):
        ws = G.storage_view(to_storage(w, kind))
        for t in (1, 2):
            for gemm in (False, True):
                out = np.empty((t, 5), np.float32)
                G._gemm_kernel(x[:t], ws, out, 2) if gemm else G._gemv_kernel(x[:t], ws, out)
                np.testing.assert_array_equal(out, np.broadcast_to([8.0, np.inf, np.nan, -np.inf, 8.0], (t, 5)))


def test_exact_storage_detection():
    rng = np.random.default_rng(4)
    w = rng.standard_normal((64, 48), np.float32)
    assert exact_storage(w) == "f32"
    assert exact_storage(_bf16_exact(w)) == "bf16"
    assert exact_storage(_f16_exact(w)) == "f16"  # f16 values: mostly more mantissa than bf16 holds
    special = np.array([[0.0, -0.0, np.inf, -np.inf, 2.0**-24, 65280.0, -3.5, 1.0]], np.float32)
    assert exact_storage(special) == "bf16"
    special[0, 7] = 1.0 + 2.0**-10  # 10 mantissa bits: f16, not bf16
    assert exact_storage(special) == "f16"
    special[0, 5] = 65504.0  # f16's largest
    assert exact_storage(special) == "f16"
    assert exact_storage(np.array([[1.0 + 2.0**-10, 70000.0]], np.float32)) == "f32"  # out of f16's range
    assert exact_storage(np.array([[1.0 + 2.0**-10, 2.0**-26]], np.float32)) == "f32"  # below f16's subnormals
    for kind in ("bf16", "f16", "f32"):  # the stored values are the originals, bit for bit
        v = {"bf16": _bf16_exact, "f16": _f16_exact, "f32": lambda a: a}[kind](w)
        np.testing.assert_array_equal(G.widen(G.storage_view(to_storage(v, kind))).view(np.uint32), v.view(np.uint32))


# ------------------------------------------------------------------ Linear: matrix bookkeeping on every device
# (the product itself is ops.dense, checked by the registry cases and tests/test_kernel_parity.py)

def _dense_module():
    return import_module("freetoken.ops.dense")  # the module: freetoken.ops.dense is the op function


@pytest.mark.parametrize("kind", ["bf16", "f16", "f32"])
def test_linear_picks_storage_and_matches_float32(device, kind, monkeypatch):
    rng = np.random.default_rng(5)
    n, k = 45, 40
    w = _stored(rng.standard_normal((n, k), np.float32), kind)[1]
    b = rng.standard_normal(n, np.float32)
    lin = Linear(w, device, bias=b)
    assert lin.storage == kind
    assert lin.nbytes == w.size * (4 if kind == "f32" else 2) + b.nbytes
    np.testing.assert_array_equal(device.to_host(lin.weight), w)
    monkeypatch.setattr(_dense_module(), "CHUNK_ELEMENTS", 8 * k)  # gpu/emu T > 8: 6 chunks, the last of 5 rows
    for t in (1, 2, 3, 8, 20):
        x = rng.standard_normal((t, k), np.float32)
        got, want = device.to_host(lin(device.asarray(x))), x @ w.T + b
        assert got.dtype == np.float32 and got.shape == (t, n)
        assert np.linalg.norm(got - want) <= 1e-6 * np.linalg.norm(want)
        got_nc = device.to_host(lin(device.asarray(np.asfortranarray(x))))  # any layout in
        np.testing.assert_array_equal(got_nc, got)
    assert device.to_host(lin(device.asarray(np.zeros((0, k), np.float32)))).shape == (0, n)
    with pytest.raises(ValueError, match=r"x must be \[T, 40\]"):
        lin(device.asarray(np.zeros((2, 41), np.float32)))


def test_linear_detects_checkpoint_storage(device):
    rng = np.random.default_rng(11)
    w = rng.standard_normal((16, 24), dtype=np.float32)
    bf = (w.view(np.uint32) & np.uint32(0xFFFF0000)).view(np.float32)  # a bf16 checkpoint's values
    assert Linear(bf, device).storage == "bf16"
    assert Linear(w.astype(np.float16).astype(np.float32), device).storage == "f16"
    assert Linear(w, device).storage == "f32"
    assert Linear(bf, device).nbytes == 16 * 24 * 2 and Linear(w, device).nbytes == 16 * 24 * 4


def test_linear_concat_splits_exactly(device):
    rng = np.random.default_rng(6)
    ws = [_bf16_exact(rng.standard_normal((n, 64), np.float32)) for n in (32, 8, 8)]
    bs = [rng.standard_normal(n, np.float32) for n in (32, 8, 8)]
    fused = Linear.concat(ws, device, bs)
    assert fused.sizes == (32, 8, 8) and fused.storage == "bf16" and fused.nbytes == 48 * 64 * 2 + 48 * 4
    for t in (1, 2, 4, 8):  # the GEMV kernels: each row's dot product as in the separate matrices
        x = device.asarray(rng.standard_normal((t, 64), np.float32))
        for part, w, b in zip(fused.split(fused(x)), ws, bs, strict=True):
            assert part.shape == (t, w.shape[0])
            np.testing.assert_array_equal(device.to_host(part), device.to_host(Linear(w, device, b)(x)))
    x = rng.standard_normal((12, 64), np.float32)
    for part, w, b in zip(fused.split(fused(device.asarray(x))), ws, bs, strict=True):
        np.testing.assert_allclose(device.to_host(part), x @ w.T + b, rtol=1e-5, atol=1e-5)
    mixed = Linear.concat([ws[0], rng.standard_normal((4, 64), np.float32)], device)
    assert mixed.storage == "f32"  # one inexact matrix keeps the fused one in float32


def _qmat(kind, n, k, seed):
    w = quantized_blocks(kind, n, k, seed=seed)
    return QuantizedMatrix(kind, w, (n, k)), blocks_dequantized(w, kind, k)


def _check_dense(got, x, w32, bias):
    ref = dense_reference(x, w32, bias)
    assert got.dtype == np.float32 and got.shape == ref.shape
    assert_close(got, ref, atol=1e-5 * float(np.abs(ref).max()), name="y")


@pytest.mark.parametrize("kind", ["q8_0", "q4_0", "fp8_block"])
def test_linear_quantized(device, kind, monkeypatch):
    rng = np.random.default_rng(5)
    n, k = 45, 96
    q, w32 = _qmat(kind, n, k, seed=6)
    b = rng.standard_normal(n, dtype=np.float32)
    lin = Linear(q, device, bias=b)
    assert lin.storage == kind and lin.sizes == (n,)
    assert lin.nbytes == n * row_bytes(kind, k) + b.nbytes == q.blocks.nbytes + b.nbytes
    np.testing.assert_array_equal(device.to_host(lin.weight), w32)
    np.testing.assert_array_equal(q.dequantize(), w32)
    monkeypatch.setattr(_dense_module(), "CHUNK_ELEMENTS", 8 * k)  # gpu/emu T > 8: 6 chunks, the last of 5 rows
    for module in (qgemv, fp8_dense):
        monkeypatch.setattr(module, "PANEL_BYTES", 8 * 4 * k)  # cpu T > 4: panels of 8 tokens, the last of 4
    for t in (1, 2, 3, 5, 8, 20):
        x = rng.standard_normal((t, k), dtype=np.float32)
        _check_dense(device.to_host(lin(device.asarray(x))), x, w32, b)
    assert device.to_host(lin(device.asarray(np.zeros((0, k), np.float32)))).shape == (0, n)
    with pytest.raises(ValueError, match=r"x must be \[T, 96\]"):
        lin(device.asarray(np.zeros((2, 95), np.float32)))


@pytest.mark.parametrize("kind", ["q8_0", "q4_0", "fp8_block"])
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
    for t in (1, 3, 8, 12):
        x = device.asarray(rng.standard_normal((t, k), dtype=np.float32))
        for part, q, w, b in zip(fused.split(fused(x)), qs, ws, bs, strict=True):
            assert part.shape == (t, q.shape[0])
            if t <= 8:
                np.testing.assert_array_equal(device.to_host(part), device.to_host(Linear(q, device, b)(x)))
            _check_dense(device.to_host(part), device.to_host(x), w, b)
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
        _check_dense(device.to_host(y), x, wm, None)


# ------------------------------------------------------------------------- reference forms of the per-token ops

def _rms_norm_numpy(x, w, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + np.float32(eps)) * w


def _rope_numpy(x, cos, sin):
    half = x.shape[-1] // 2
    return x * cos[:, None, :] + np.concatenate([-x[..., half:], x[..., :half]], axis=-1) * sin[:, None, :]


def _into(out, y):
    if out is None:
        return y
    out[...] = y
    return out


def _add_rms_norm_numpy(x, y, w, eps, out=None, **_):
    x += y
    return _into(out, _rms_norm_numpy(x, w, eps))


def _rope_qkv_cache_numpy(qkv, norm, eps, cos, sin, k_cache, v_cache, start, out=None, **_):
    t, (kv_heads, d) = qkv.shape[0], k_cache.shape[1:]
    x = qkv.reshape(t, -1, d)
    heads = x.shape[1] - 2 * kv_heads
    qk = x[:, :heads + kv_heads]
    qk = _rope_numpy(qk if norm is None else _rms_norm_numpy(qk, norm, eps), cos, sin)
    k_cache[start:start + t] = qk[:, heads:]
    v_cache[start:start + t] = x[:, heads + kv_heads:]
    return _into(out, qk[:, :heads])


def _route_numpy(logits, k, renorm):
    from freetoken import ops

    z = logits - logits.max(axis=-1, keepdims=True)
    p = np.exp(z)
    p /= p.sum(axis=-1, keepdims=True)
    ids, w = ops.topk(np.ascontiguousarray(p, np.float32), k, device=CPU)
    return ids, (w / w.sum(axis=-1, keepdims=True) if renorm else w)


# ---------------------------------------------------------------------------------------------- the decoder

@pytest.mark.parametrize("family,storage", [("qwen3_moe", "bf16"), ("qwen2_moe", "f16"), ("olmoe", "bf16"),
                                            ("mixtral", "f32")])
def test_decoder_logits_match_the_numpy_path(family, storage, tmp_path, monkeypatch):
    """The decoder on cpu (kernels) against the same decoder on the plain NumPy float32 path (matmuls, norms,
    RoPE, routing as before): logits equal up to float32 summation order, for prefill and decode steps."""
    need("torch")
    need("transformers")
    from safetensors.numpy import load_file
    from tiny_models import make_checkpoint

    from freetoken import ops
    from freetoken.engine.loading.build import build_decoder
    from freetoken.engine.options import LoadOptions
    from freetoken.models import from_hf

    make_checkpoint(family, tmp_path)
    cfg = from_hf(json.loads((tmp_path / "config.json").read_text()))
    round_ = {"bf16": _bf16_exact, "f16": _f16_exact, "f32": lambda a: a}[storage]
    tensors = {k: round_(np.asarray(v, np.float32)) for k, v in load_file(str(tmp_path / "model.safetensors")).items()}
    tokens = np.random.default_rng(11).integers(0, cfg.vocab_size, 14)

    def run():
        dec = build_decoder(cfg, lambda name: tensors[name], CPU, LoadOptions(ctx=32), warm_up=False)
        out = [dec.forward(tokens[:10])] + [dec.forward(tokens[i:i + 1]) for i in range(10, 14)]
        return dec, np.concatenate(out)

    dec, got = run()
    def linears(obj, depth=0):
        if isinstance(obj, Linear):
            return [obj]
        if depth > 3 or not hasattr(obj, "__dict__"):
            return []
        return [lin for v in vars(obj).values() for lin in linears(v, depth + 1)]

    lins = [lin for lay in dec.layers for lin in linears(lay)] + [dec.lm_head]
    assert {lin.storage for lin in lins} == {storage}

    monkeypatch.setattr(Linear, "__call__", lambda self, x: x @ self.weight.T + (0 if self.bias is None else self.bias))
    monkeypatch.setattr(ops, "rms_norm", lambda x, w, eps, out=None, **_: _into(out, _rms_norm_numpy(x, w, eps)))
    monkeypatch.setattr(ops, "add_rms_norm", _add_rms_norm_numpy)
    monkeypatch.setattr(ops, "rope", lambda x, c, s, device=None: _rope_numpy(x, c, s))
    monkeypatch.setattr(ops, "rope_qkv_cache", _rope_qkv_cache_numpy)
    monkeypatch.setattr(ops, "route_softmax_topk", lambda z, k, renorm, **_: _route_numpy(z, k, renorm))
    _, want = run()
    assert np.linalg.norm(got - want) <= 1e-5 * np.linalg.norm(want)
    np.testing.assert_array_equal(got.argmax(-1), want.argmax(-1))


def test_fp8_transposed_is_exact_or_refused():
    """Rows of an HF block-FP8 matrix transposed into fp8_block rows: the same values when the rows start on a
    128-row tile (DeepSeek's kv_b_proj heads), None when they straddle tiles of different scales."""
    from freetoken.formats import fp8_block
    from freetoken.models.qmatrix import fp8_transposed, from_hf_fp8

    rng = np.random.default_rng(8)
    w = rng.standard_normal((512, 400), dtype=np.float32) * rng.uniform(0.1, 10, (512, 1)).astype(np.float32)
    banks = fp8_block.FORMAT.quantize(w[:, :384][None])  # K 384: three column tiles
    q = from_hf_fp8(banks["w"][0], banks["s"][0])
    full = q.dequantize()
    for row0, rows in ((0, 128), (256, 256), (128, 48), (384, 128)):
        t = fp8_transposed(q, row0, rows)
        assert t.shape == (384, rows)
        np.testing.assert_array_equal(t.dequantize(), full[row0:row0 + rows].T)
    assert fp8_transposed(q, 64, 128) is None  # rows 64..191: two tiles' scales in one new block
    assert fp8_transposed(q, 0, 40) is None  # K 40 is not a multiple of 16
