"""The cpu device's dense projections (cpu_kernels/gemv.py, freetoken.models.linear) and per-token ops (RMSNorm,
RoPE, routing): against NumPy float64 / float32 references, and the decoder's logits against the plain NumPy path."""

import json

import ml_dtypes
import numpy as np
import pytest
from freetoken.cpu_kernels import gemv as G

from freetoken.device import get_device
from freetoken.models import layers
from freetoken.models.linear import Linear, exact_storage, to_storage

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
    """Each kernel at every T in 1..9 and N % 4 in 0..3 (the tiled kernel's narrower edge tiles)."""
    rng = np.random.default_rng(2)
    for n in (36, 37, 38, 39):
        w, wv = _stored(rng.standard_normal((n, 50), np.float32), kind)
        w = G.storage_view(w)
        for t in range(1, 10):
            x = rng.standard_normal((t, 50), np.float32)
            for kernel in (G._gemv_kernel, G._gemm_kernel):
                out = np.full((t, n), np.nan, np.float32)
                kernel(x, w, out)
                _check(out, x, wv)


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
            for kernel in (G._gemv_kernel, G._gemm_kernel):
                out = np.empty((t, 5), np.float32)
                kernel(x[:t], ws, out)
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


@pytest.mark.parametrize("kind", ["bf16", "f16", "f32"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_linear_picks_storage_and_matches_float32(kind, shape):
    rng = np.random.default_rng(5)
    w = _stored(rng.standard_normal(shape, np.float32), kind)[1]
    b = rng.standard_normal(shape[0], np.float32)
    lin = Linear(w, CPU, bias=b)
    assert lin.storage == kind
    assert lin.nbytes == w.size * (4 if kind == "f32" else 2) + b.nbytes
    np.testing.assert_array_equal(lin.weight, w)
    for t in (1, 3, 8, 20):
        x = rng.standard_normal((t, shape[1]), np.float32)
        got, want = lin(x), x @ w.T + b
        assert np.linalg.norm(got - want) <= 1e-6 * np.linalg.norm(want)
        got_nc = lin(np.asfortranarray(x))  # any layout in
        np.testing.assert_array_equal(got_nc, got)


def test_linear_concat_splits_exactly():
    rng = np.random.default_rng(6)
    ws = [_bf16_exact(rng.standard_normal((n, 64), np.float32)) for n in (32, 8, 8)]
    bs = [rng.standard_normal(n, np.float32) for n in (32, 8, 8)]
    fused = Linear.concat(ws, CPU, bs)
    assert fused.sizes == (32, 8, 8) and fused.storage == "bf16"
    for t in (1, 2, 4):  # the GEMV kernel: each row's dot product as in the separate matrices
        x = rng.standard_normal((t, 64), np.float32)
        for part, w, b in zip(fused.split(fused(x)), ws, bs, strict=True):
            np.testing.assert_array_equal(part, Linear(w, CPU, b)(x))
    x = rng.standard_normal((9, 64), np.float32)
    for part, w, b in zip(fused.split(fused(x)), ws, bs, strict=True):
        np.testing.assert_allclose(part, x @ w.T + b, rtol=1e-5, atol=1e-5)
    mixed = Linear.concat([ws[0], rng.standard_normal((4, 64), np.float32)], CPU)
    assert mixed.storage == "f32"  # one inexact matrix keeps the fused one in float32


def test_linear_on_the_emu_device():
    """On gpu/emu a Linear holds its exact storage on the device and runs the dense GEMV kernel (tests/test_dense.py
    covers it in depth); the float32 matrix and the bias come back unchanged."""
    from freetoken.device import device_status, get_device

    if not device_status()["emu"][0]:
        pytest.skip("emu device unavailable")
    emu = get_device("emu")
    rng = np.random.default_rng(7)
    w, b = rng.standard_normal((10, 12), np.float32), rng.standard_normal(10, np.float32)
    lin = Linear(w, emu, b)
    x = rng.standard_normal((3, 12), np.float32)
    assert lin.storage == "f32"
    np.testing.assert_allclose(lin(x), x @ w.T + b, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(lin.weight, w)


# ------------------------------------------------------------------------------------- RMSNorm, RoPE, routing

def _rms_norm_numpy(x, w, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + np.float32(eps)) * w


def _rope_numpy(x, cos, sin):
    half = x.shape[-1] // 2
    return x * cos[:, None, :] + np.concatenate([-x[..., half:], x[..., :half]], axis=-1) * sin[:, None, :]


def test_rms_norm_kernel():
    rng = np.random.default_rng(8)
    for xs, ws in [((1, 1024), (1024,)), ((3, 20, 64), (20, 64)), ((4, 6, 16), (16,))]:
        x, w = rng.standard_normal(xs, np.float32), rng.standard_normal(ws, np.float32)
        got, want = layers.rms_norm(np, x, w, 1e-6), _rms_norm_numpy(x, w, 1e-6)
        assert got.dtype == np.float32 and got.shape == want.shape
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
    x = rng.standard_normal((5, 24, 16), np.float32)[:, 2:22]  # a strided view
    w = rng.standard_normal((20, 16), np.float32)
    np.testing.assert_allclose(layers.rms_norm(np, x, w, 1e-6), _rms_norm_numpy(x, w, 1e-6), rtol=1e-6, atol=1e-7)
    x64 = x.astype(np.float64)  # not float32: the array-op path
    np.testing.assert_allclose(layers.rms_norm(np, x64, w, 1e-6), _rms_norm_numpy(x64, w, 1e-6))


def test_rope_kernel_is_bit_identical():
    rng = np.random.default_rng(9)
    cos, sin = layers.rope_tables(np, np.arange(100), 64, 1e6)
    for t, start in ((1, 37), (5, 0)):
        x = rng.standard_normal((t, 24, 64), np.float32)[:, :20]  # strided, as the decoder's q/k view
        c, s = cos[start:start + t], sin[start:start + t]
        np.testing.assert_array_equal(layers.apply_rope(np, x, c, s), _rope_numpy(x, c, s))


def _route_numpy(logits, k, renorm):
    from freetoken import ops

    z = logits - logits.max(axis=-1, keepdims=True)
    p = np.exp(z)
    p /= p.sum(axis=-1, keepdims=True)
    ids, w = ops.topk(np.ascontiguousarray(p, np.float32), k, device=CPU)
    return ids, (w / w.sum(axis=-1, keepdims=True) if renorm else w)


@pytest.mark.parametrize("renorm", [False, True])
def test_softmax_topk_kernel(renorm):
    rng = np.random.default_rng(10)
    logits = rng.standard_normal((7, 64), np.float32) * 3
    logits[1, [5, 9, 40]] = logits[1].max() + 1  # a three-way tie: lower index first
    logits[2, 3] = np.nan  # NaN: the whole row's probabilities are NaN, ids 0..k-1
    ids = np.empty((7, 8), np.int32)
    w = np.empty((7, 8), np.float32)
    G.softmax_topk_rows(logits, 8, renorm, ids, w)
    want_ids, want_w = _route_numpy(logits, 8, renorm)
    np.testing.assert_array_equal(ids, want_ids)
    assert ids[1, :3].tolist() == [5, 9, 40]
    np.testing.assert_allclose(w, want_w, rtol=2e-6, atol=1e-8)
    assert np.isnan(w[2]).all() and ids[2].tolist() == list(range(8))


# ---------------------------------------------------------------------------------------------- the decoder

@pytest.mark.parametrize("family,storage", [("qwen3_moe", "bf16"), ("qwen2_moe", "f16"), ("olmoe", "bf16"),
                                            ("mixtral", "f32")])
def test_decoder_logits_match_the_numpy_path(family, storage, tmp_path, monkeypatch):
    """The decoder on cpu (kernels) against the same decoder on the plain NumPy float32 path (matmuls, norms,
    RoPE, routing as before): logits equal up to float32 summation order, for prefill and decode steps."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from safetensors.numpy import load_file
    from tiny_models import make_checkpoint

    import freetoken.models.decoder as D
    from freetoken.models import MoeDecoder, from_hf

    make_checkpoint(family, tmp_path)
    cfg = from_hf(json.loads((tmp_path / "config.json").read_text()))
    round_ = {"bf16": _bf16_exact, "f16": _f16_exact, "f32": lambda a: a}[storage]
    tensors = {k: round_(np.asarray(v, np.float32)) for k, v in load_file(str(tmp_path / "model.safetensors")).items()}
    tokens = np.random.default_rng(11).integers(0, cfg.vocab_size, 14)

    def run():
        dec = MoeDecoder(cfg, lambda name: tensors[name], CPU, max_len=32)
        out = [dec.forward(tokens[:10])] + [dec.forward(tokens[i:i + 1]) for i in range(10, 14)]
        return dec, np.concatenate(out)

    dec, got = run()
    lins = [v for lay in dec.layers for v in lay.values() if isinstance(v, Linear)] + [dec.lm_head]
    assert {lin.storage for lin in lins} == {storage}

    def ref_route(logits, k, renorm, ids, w):
        ids[:], w[:] = _route_numpy(logits, k, renorm)

    monkeypatch.setattr(Linear, "__call__", lambda self, x: x @ self.weight.T + (0 if self.bias is None else self.bias))
    monkeypatch.setattr(D, "rms_norm", lambda xp, x, w, eps: _rms_norm_numpy(x, w, eps))
    monkeypatch.setattr(D, "apply_rope", lambda xp, x, c, s: _rope_numpy(x, c, s))
    monkeypatch.setattr(D, "softmax_topk_rows", ref_route)
    _, want = run()
    assert np.linalg.norm(got - want) <= 1e-5 * np.linalg.norm(want)
    np.testing.assert_array_equal(got.argmax(-1), want.argmax(-1))
