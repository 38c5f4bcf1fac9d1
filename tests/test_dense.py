"""The dense decode GEMV (cuda/dense.cu, freetoken.ops.dense) on every device, and Linear on gpu/emu: 16-bit storage,
the GEMV kernel for a few tokens and the chunked product beyond."""

import numpy as np
import pytest

import freetoken.models.linear as L
from freetoken.models.linear import Linear
from freetoken.ops.cases import dense_reference, dense_weights
from freetoken.ops.dense import MAX_TOKENS, dense_gemv
from freetoken.testing import assert_close, poison

STORAGES = ("bf16", "f16", "f32")
# vector path for every storage (64x96, 5x8, 256x1024) or the scalar one (37x50: 16-bit; 130x33: all), odd N
SHAPES = [(37, 50), (64, 96), (5, 8), (130, 33), (256, 1024)]


def check_dense(got, x, w32, bias):
    """``got`` equals x . w32^T (+ bias) in float64 within 1e-5 of the largest output (also tests/test_qdense.py)."""
    ref = dense_reference(x, w32, bias)
    assert got.dtype == np.float32 and got.shape == ref.shape
    assert_close(got, ref, atol=1e-5 * float(np.abs(ref).max()), name="y")


@pytest.mark.parametrize("storage", STORAGES)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_dense_gemv_matches_float64(device, storage, shape):
    n, k = shape
    w, w32 = dense_weights(storage, n, k, seed=n * 1000 + k)
    check_every_token_count(device, w, w32, storage)


def check_every_token_count(device, w, w32, storage: str):
    """dense_gemv of stored ``w`` (float32 values ``w32`` [N, K]) for T = 1..MAX_TOKENS, with and without bias,
    into poisoned outputs, against the float64 reference (also used by tests/test_qdense.py)."""
    n, k = w32.shape
    rng = np.random.default_rng(k)
    bias = rng.standard_normal(n, dtype=np.float32)
    dw, db = device.asarray(w), device.asarray(bias)
    for t in range(1, MAX_TOKENS + 1):
        x = rng.standard_normal((t, k), dtype=np.float32)
        dx = device.asarray(x)
        for b in (None, bias):
            out = device.asarray(poison((t, n), np.float32))
            got = dense_gemv(dx, dw, storage, bias=None if b is None else db, out=out, device=device)
            assert got is out
            check_dense(device.to_host(got), x, w32, b)
    return dw


def test_dense_gemv_misaligned_views_and_special_values(device):
    """Weights or x whose base is not 16-byte aligned (offset views) take the scalar path, with the same results;
    inf and NaN weights propagate."""
    rng = np.random.default_rng(4)
    n, k = 7, 64
    for storage in STORAGES:
        w, w32 = dense_weights(storage, n + 1, k, seed=3)
        x_host = rng.standard_normal(2 * k + 1, dtype=np.float32)
        for w_off, x_off in ((1, 0), (0, 1), (1, 1)):
            dw = device.asarray(w.reshape(-1))[w_off:w_off + n * k].reshape(n, k)
            dx = device.asarray(x_host)[x_off:x_off + 2 * k].reshape(2, k)
            want_w = w32.reshape(-1)[w_off:w_off + n * k].reshape(n, k)
            check_dense(device.to_host(dense_gemv(dx, dw, storage, device=device)), device.to_host(dx), want_w, None)
    wf = np.ones((4, 8), np.float32)
    wf[1, 3], wf[2, 0] = np.inf, np.nan
    for storage, w in (("bf16", (wf.view(np.uint32) >> 16).astype(np.uint16)), ("f16", wf.astype(np.float16)),
                       ("f32", wf)):
        got = device.to_host(dense_gemv(device.asarray(np.ones((2, 8), np.float32)), device.asarray(w), storage,
                                        device=device))
        np.testing.assert_array_equal(got, np.broadcast_to([8.0, np.inf, np.nan, 8.0], (2, 4)))


def test_dense_gemv_empty_and_errors(device):
    w = device.asarray(np.zeros((3, 4), np.uint16))
    x = device.asarray(np.ones((2, 4), np.float32))
    assert device.to_host(dense_gemv(device.asarray(np.zeros((0, 4), np.float32)), w, "bf16", device=device)).shape \
        == (0, 3)
    with pytest.raises(ValueError, match="unknown storage 'bf8'"):
        dense_gemv(x, w, "bf8", device=device)
    with pytest.raises(TypeError, match=r"w must be uint16 \(bf16 bits\) for storage 'bf16', got float16"):
        dense_gemv(x, device.asarray(np.zeros((3, 4), np.float16)), "bf16", device=device)
    with pytest.raises(TypeError, match="w must be float16 for storage 'f16', got uint16"):
        dense_gemv(x, w, "f16", device=device)
    with pytest.raises(TypeError, match="x must be float32, got float64"):
        dense_gemv(device.asarray(np.ones((2, 4))), w, "bf16", device=device)
    with pytest.raises(ValueError, match="x must have 2 dimensions"):
        dense_gemv(device.asarray(np.ones(4, np.float32)), w, "bf16", device=device)
    with pytest.raises(ValueError, match="w has 4 columns but x has 5"):
        dense_gemv(device.asarray(np.ones((2, 5), np.float32)), w, "bf16", device=device)
    with pytest.raises(ValueError, match="T=9 tokens exceed dense_gemv's 8"):
        dense_gemv(device.asarray(np.ones((9, 4), np.float32)), w, "bf16", device=device)
    with pytest.raises(ValueError, match="bias must have 3 elements"):
        dense_gemv(x, w, "bf16", bias=device.asarray(np.ones(4, np.float32)), device=device)
    with pytest.raises(ValueError, match=r"out must be float32 of shape \(2, 3\)"):
        dense_gemv(x, w, "bf16", out=device.asarray(np.ones((2, 4), np.float32)), device=device)


# ------------------------------------------------------------------------------------------- Linear on gpu/emu

@pytest.mark.parametrize("storage", STORAGES)
def test_linear_storage_kernel_and_chunks(cuda_device, storage, monkeypatch):
    dev = cuda_device
    rng = np.random.default_rng(7)
    n, k = 45, 40
    w = dense_weights(storage, n, k, seed=8)[1]
    if storage == "f32":
        w = rng.standard_normal((n, k), dtype=np.float32)
    b = rng.standard_normal(n, dtype=np.float32)
    lin = Linear(w, dev, bias=b)
    assert lin.storage == storage
    assert lin.nbytes == w.size * (4 if storage == "f32" else 2) + b.nbytes
    np.testing.assert_array_equal(dev.to_host(lin.weight), w)
    monkeypatch.setattr(L, "CHUNK_ELEMENTS", 8 * k)  # 8 rows per chunk: 6 chunks, the last one of 5 rows
    for t in (1, 2, 3, 20):
        x = rng.standard_normal((t, k), dtype=np.float32)
        got, want = dev.to_host(lin(dev.asarray(x))), x @ w.T + b
        assert got.dtype == np.float32 and got.shape == (t, n)
        assert np.linalg.norm(got - want) <= 1e-6 * np.linalg.norm(want)
        xs = dev.asarray(np.asfortranarray(x))  # any layout in
        np.testing.assert_array_equal(dev.to_host(lin(xs)), got)
    assert dev.to_host(lin(dev.asarray(np.zeros((0, k), np.float32)))).shape == (0, n)
    with pytest.raises(ValueError, match=r"x must be \[T, 40\]"):
        lin(dev.asarray(np.zeros((2, 41), np.float32)))


def test_linear_chunked_matches_the_kernel_rows(cuda_device, monkeypatch):
    """The chunked product covers every row exactly once, whatever the chunk size (one row, uneven, whole)."""
    dev = cuda_device
    rng = np.random.default_rng(9)
    w = dense_weights("bf16", 13, 24, seed=10)[1]
    lin = Linear(w, dev)
    x = rng.standard_normal((MAX_TOKENS + 1, 24), dtype=np.float32)
    want = x @ w.T
    for chunk in (1, 24 * 5, 1 << 23):
        monkeypatch.setattr(L, "CHUNK_ELEMENTS", chunk)
        got = dev.to_host(lin(dev.asarray(x)))
        assert np.linalg.norm(got - want) <= 1e-6 * np.linalg.norm(want)


def test_linear_detects_checkpoint_storage(cuda_device):
    dev = cuda_device
    rng = np.random.default_rng(11)
    w = rng.standard_normal((16, 24), dtype=np.float32)
    bf = (w.view(np.uint32) & np.uint32(0xFFFF0000)).view(np.float32)  # a bf16 checkpoint's values
    assert Linear(bf, dev).storage == "bf16"
    assert Linear(w.astype(np.float16).astype(np.float32), dev).storage == "f16"
    assert Linear(w, dev).storage == "f32"
    assert Linear(bf, dev).nbytes == 16 * 24 * 2 and Linear(w, dev).nbytes == 16 * 24 * 4


def test_linear_concat_split_on_device(cuda_device):
    dev = cuda_device
    rng = np.random.default_rng(12)
    ws = [dense_weights("bf16", n, 64, seed=n)[1] for n in (32, 8, 8)]
    bs = [rng.standard_normal(n, dtype=np.float32) for n in (32, 8, 8)]
    fused = Linear.concat(ws, dev, bs)
    assert fused.sizes == (32, 8, 8) and fused.storage == "bf16" and fused.nbytes == 48 * 64 * 2 + 48 * 4
    for t in (1, 3, 12):  # kernel rows are the same dot products as in the separate matrices
        x = dev.asarray(rng.standard_normal((t, 64), dtype=np.float32))
        for part, w, b in zip(fused.split(fused(x)), ws, bs, strict=True):
            assert part.shape == (t, w.shape[0])
            if t <= MAX_TOKENS:
                np.testing.assert_array_equal(dev.to_host(part), dev.to_host(Linear(w, dev, b)(x)))
            np.testing.assert_allclose(dev.to_host(part), dev.to_host(x) @ w.T + b, rtol=1e-5, atol=1e-5)
    mixed = Linear.concat([ws[0], rng.standard_normal((4, 64), dtype=np.float32)], dev)
    assert mixed.storage == "f32"
