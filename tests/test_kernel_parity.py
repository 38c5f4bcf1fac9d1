"""Every op against its NumPy reference on every device present: the registry's cases (``freetoken.testing.cases``,
one per op and kernel family, awkward shapes, poisoned outputs), then per op what a case cannot check (shape sweeps,
offset views, special values, dispatch, determinism, misuse errors)."""

from importlib import import_module

import ml_dtypes
import numpy as np
import pytest

from freetoken import formats, ops
from freetoken.device.constants import DECODE_MAX_TOKENS, LINEAR_CHUNKED_MIN_TOKENS
from freetoken.formats import RecordLayout
from freetoken.models.qmatrix import QuantizedMatrix
from freetoken.ops.dense import MAX_TOKENS, dense_dequant, dense_gemv
from freetoken.testing import assert_close, poison, random_record
from freetoken.testing.cases import CASES
from freetoken.testing.cases.dense import dense_weights, quantized_blocks
from freetoken.testing.reference.dense import blocks_dequantized, dense_reference
from freetoken.testing.reference.linear_attention import gated_delta_rule_reference
from freetoken.testing.reference.moe_experts import moe_forward_reference
from freetoken.testing.reference.paged_attention import KV_DTYPES, paged_attention_reference
from freetoken.testing.reference.rms_norm import rms_norm_reference
from freetoken.testing.reference.rope import rope_reference
from freetoken.testing.reference.routing import route_softmax_topk_reference
from freetoken.testing.reference.topk import topk_reference


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_case_matches_reference(case, device):
    if case.cuda_only and device.kind == "cpu":
        pytest.skip(f"{case.name} checks what only the CUDA kernels compute")
    if case.cpu_only and device.kind != "cpu":
        pytest.skip(f"{case.name} checks what only the cpu kernels compute")
    rng = np.random.default_rng(1234)
    inputs = case.make(rng, "small")
    case.check(case.run(device, inputs), case.reference(inputs))


@pytest.mark.parametrize("rows,cols", [(1, 1), (1, 33), (5, 31), (3, 2049)])
# ---- row_sum, topk, transpose, histogram ----------------------------------------------------------------------
def test_row_sum_shapes(device, rows, cols):
    x = np.random.default_rng(rows * 100 + cols).standard_normal((rows, cols)).astype(np.float32)
    got = device.to_host(ops.row_sum(device.asarray(x), device=device))
    assert_close(got, x.astype(np.float64).sum(1), atol=1e-4, rtol=1e-5)


def test_row_sum_nan_propagates(device):
    x = np.ones((3, 40), np.float32)
    x[1, 7] = np.nan
    got = device.to_host(ops.row_sum(device.asarray(x), device=device))
    assert np.isnan(got[1]) and np.all(got[[0, 2]] == 40)


@pytest.mark.parametrize("rows,n,k", [(1, 1, 1), (3, 7, 7), (5, 33, 1), (6, 64, 32), (2, 300, 8)])
def test_topk_shapes(device, rows, n, k):
    x = np.random.default_rng(n).standard_normal((rows, n)).astype(np.float32)
    idx, val = ops.topk(device.asarray(x), k, device=device)
    want_idx, want_val = topk_reference(x, k)
    np.testing.assert_array_equal(device.to_host(idx), want_idx)
    np.testing.assert_array_equal(device.to_host(val), want_val)


def test_topk_rejects_bad_k(device):
    x = np.zeros((2, 4), np.float32)
    with pytest.raises(ValueError, match="k=5"):
        ops.topk(x, 5, device=device)


@pytest.mark.parametrize("dtype", [np.uint8, np.float16, np.float32, np.int64])
@pytest.mark.parametrize("rows,cols", [(1, 1), (33, 1), (31, 65)])
def test_transpose_dtypes(device, dtype, rows, cols):
    x = (np.arange(rows * cols) % 251).astype(dtype).reshape(rows, cols)
    got = device.to_host(ops.transpose(device.asarray(x), device=device))
    np.testing.assert_array_equal(got, x.T)


def test_histogram_empty_and_out_of_range(device):
    got = device.to_host(ops.histogram(device.asarray(np.array([], np.int32)), 4, device=device))
    np.testing.assert_array_equal(got, np.zeros(4, np.int32))
    got = device.to_host(ops.histogram(device.asarray(np.array([-1, 4, 0, 3, 3], np.int32)), 4, device=device))
    np.testing.assert_array_equal(got, [1, 0, 0, 2])


def test_out_shape_is_checked(device):
    with pytest.raises(ValueError, match="out must be float32 of shape"):
        ops.row_sum(np.zeros((3, 4), np.float32), out=device.asarray(np.zeros(4, np.float32)), device=device)


def test_wrong_dtype_is_refused(device):
    with pytest.raises(TypeError, match="x must be float32"):
        ops.row_sum(np.zeros((3, 4), np.float64), device=device)


# ---- dense_gemv / dense (tests/test_linear.py: Linear's bookkeeping on top) ---------------------------------------
STORAGES = ("bf16", "f16", "f32")
QKINDS = ("q8_0", "q4_0", "fp8_block")


def check_dense(got, x, w32, bias=None):
    """``got`` equals x . w32^T (+ bias) in float64 within 1e-5 of the largest output."""
    ref = dense_reference(x, w32, bias)
    assert got.dtype == np.float32 and got.shape == ref.shape
    assert_close(got, ref, atol=1e-5 * float(np.abs(ref).max()), name="y")


def gemv_every_token_count(device, w, w32, storage: str, rng) -> object:
    """``dense_gemv`` of ``w`` (decoding to ``w32`` [N, K]) at T = 1..MAX_TOKENS (each a code path of the kernel),
    with and without bias, into poisoned outputs, each checked by :func:`check_dense`; returns ``w`` on the device."""
    n, k = w32.shape
    bias = rng.standard_normal(n, dtype=np.float32)
    dw, db = device.asarray(w), device.asarray(bias)
    for t in range(1, MAX_TOKENS + 1):
        x = rng.standard_normal((t, k), dtype=np.float32)
        for b in (None, bias):
            out = device.asarray(poison((t, n), np.float32))
            got = dense_gemv(device.asarray(x), dw, storage, bias=None if b is None else db, out=out, device=device)
            assert got is out
            check_dense(device.to_host(got), x, w32, b)
    return dw


@pytest.mark.parametrize("storage", STORAGES + QKINDS)
def test_dense_gemv_every_token_count(device, storage):
    """T = 1..8 (each a code path of the kernel), with and without bias, into poisoned outputs."""
    n, k = 37, 96
    if storage in QKINDS:
        w = quantized_blocks(storage, n, k, seed=n + k)
        w32 = blocks_dequantized(w, storage, k)
    else:
        w, w32 = dense_weights(storage, n, k, seed=n * 1000 + k)
    dw = gemv_every_token_count(device, w, w32, storage, np.random.default_rng(k))
    if storage in QKINDS:
        np.testing.assert_array_equal(device.to_host(dense_dequant(dw, storage, k, device=device)), w32)


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


def test_qdense_odd_base_and_special_scales(device):
    """Blocks whose base is odd (an offset view: the byte-load path) give the same results; inf / NaN scales
    propagate."""
    rng = np.random.default_rng(3)
    n, k = 5, 64
    for kind in QKINDS:
        w = quantized_blocks(kind, n, k, seed=1)
        row = w.shape[1]
        flat = device.asarray(np.concatenate([np.zeros(1, np.uint8), w.reshape(-1)]))
        dw = flat[1:].reshape(n, row)
        x = rng.standard_normal((3, k), dtype=np.float32)
        got = device.to_host(dense_gemv(device.asarray(x), dw, kind, device=device))
        check_dense(got, x, blocks_dequantized(w, kind, k), None)
        # x 4 bytes past an allocation (not 16-byte aligned: scalar x loads) gives the same sums bit for bit
        xbuf = device.asarray(np.concatenate([np.zeros(1, np.float32), x.reshape(-1)]))
        aligned = device.to_host(dense_gemv(device.asarray(x), device.asarray(w), kind, device=device))
        np.testing.assert_array_equal(
            device.to_host(dense_gemv(xbuf[1:].reshape(x.shape), device.asarray(w), kind, device=device)), aligned)
        np.testing.assert_array_equal(device.to_host(dense_dequant(dw, kind, k, device=device)),
                                      blocks_dequantized(w, kind, k))
        ws = w.copy()
        scale = "<f4" if kind == "fp8_block" else "<f2"  # a row's first scale
        ws[1, :np.dtype(scale).itemsize] = np.array([np.inf], scale).view(np.uint8)
        ws[2, :np.dtype(scale).itemsize] = np.array([np.nan], scale).view(np.uint8)
        ones = device.asarray(np.ones((2, k), np.float32))
        got = device.to_host(dense_gemv(ones, device.asarray(ws), kind, device=device))
        assert np.isnan(got[:, 2]).all() and not np.isfinite(got[:, 1]).any() and np.isfinite(got[:, [0, 3, 4]]).all()
    w = quantized_blocks("fp8_block", n, k, seed=2)  # e4m3fn's NaN codes (0x7F, 0xFF) give NaN
    w[3, 4 + 17], w[4, 4 + 63] = 0x7F, 0xFF
    got = device.to_host(dense_gemv(device.asarray(np.ones((2, k), np.float32)), device.asarray(w), "fp8_block",
                                    device=device))
    assert np.isnan(got[:, 3:]).all() and np.isfinite(got[:, :3]).all()


@pytest.mark.parametrize("storage", STORAGES + QKINDS)
def test_dense_chunked_product_covers_every_row(device, storage, monkeypatch):
    """ops.dense beyond 8 tokens: every row exactly once whatever the chunk size (gpu/emu: one row, uneven, whole;
    cpu: the register-tiled kernel)."""
    D = import_module("freetoken.ops.dense")  # the module (freetoken.ops.dense is the op function)

    n, k = 13, 64
    if storage in QKINDS:
        w = quantized_blocks(storage, n, k, seed=10)
        w32 = blocks_dequantized(w, storage, k)
    else:
        w, w32 = dense_weights(storage, n, k, seed=10)
    x = np.random.default_rng(9).standard_normal((MAX_TOKENS + 1, k), dtype=np.float32)
    for chunk in (1, k * 5, 1 << 23):
        monkeypatch.setattr(D, "CHUNK_ELEMENTS", chunk)
        check_dense(device.to_host(ops.dense(device.asarray(x), device.asarray(w), storage, device=device)), x, w32,
                    None)


def test_dense_empty_and_errors(device):
    w = device.asarray(np.zeros((3, 4), np.uint16))
    x = device.asarray(np.ones((2, 4), np.float32))
    for fn in (dense_gemv, ops.dense):
        assert device.to_host(fn(device.asarray(np.zeros((0, 4), np.float32)), w, "bf16", device=device)).shape \
            == (0, 3)
        with pytest.raises(ValueError, match="unknown storage 'bf8'"):
            fn(x, w, "bf8", device=device)
        with pytest.raises(TypeError, match=r"w must be uint16 \(bf16 bits\) for storage 'bf16', got float16"):
            fn(x, device.asarray(np.zeros((3, 4), np.float16)), "bf16", device=device)
        with pytest.raises(TypeError, match="w must be float16 for storage 'f16', got uint16"):
            fn(x, w, "f16", device=device)
        with pytest.raises(TypeError, match="x must be float32, got float64"):
            fn(device.asarray(np.ones((2, 4))), w, "bf16", device=device)
        with pytest.raises(ValueError, match="x must have 2 dimensions"):
            fn(device.asarray(np.ones(4, np.float32)), w, "bf16", device=device)
        with pytest.raises(ValueError, match="w has 4 columns but x has 5"):
            fn(device.asarray(np.ones((2, 5), np.float32)), w, "bf16", device=device)
        with pytest.raises(ValueError, match="bias must have 3 elements"):
            fn(x, w, "bf16", bias=device.asarray(np.ones(4, np.float32)), device=device)
        with pytest.raises(ValueError, match=r"out must be float32 of shape \(2, 3\)"):
            fn(x, w, "bf16", out=device.asarray(np.ones((2, 4), np.float32)), device=device)
    with pytest.raises(ValueError, match="T=9 tokens exceed dense_gemv's 8"):
        dense_gemv(device.asarray(np.ones((9, 4), np.float32)), w, "bf16", device=device)
    xq = device.asarray(np.ones((2, 64), np.float32))
    with pytest.raises(ValueError, match="q8_0 w has 36 bytes per row but x has 64 columns"):
        dense_gemv(xq, device.asarray(np.zeros((3, 36), np.uint8)), "q8_0", device=device)
    with pytest.raises(ValueError, match="q4_0 w has 18 bytes per row but x has 40 columns"):
        dense_gemv(device.asarray(np.ones((2, 40), np.float32)), device.asarray(np.zeros((3, 18), np.uint8)),
                   "q4_0", device=device)
    with pytest.raises(ValueError, match=r"fp8_block w has 66 bytes per row but x has 64 columns \(w must be "
                                         r"\[N, K \+ 4 \* ceil\(K/128\)\]"):
        dense_gemv(xq, device.asarray(np.zeros((3, 66), np.uint8)), "fp8_block", device=device)
    with pytest.raises(ValueError, match="K a multiple of 16"):
        ops.dense(device.asarray(np.ones((2, 40), np.float32)), device.asarray(np.zeros((3, 44), np.uint8)),
                  "fp8_block", device=device)
    with pytest.raises(ValueError, match=r"fp8_block w has 64 bytes per row, not K \+ 4 \* ceil\(K/128\) for K=64"):
        dense_dequant(device.asarray(np.zeros((3, 64), np.uint8)), "fp8_block", 64, device=device)
    x3 = device.asarray(np.ones((2, 3, 32), np.float32))
    w8 = device.asarray(np.zeros((6, 36), np.uint8))
    assert device.to_host(ops.dense_grouped(device.asarray(np.zeros((0, 3, 32), np.float32)), w8, "fp8_block",
                                            device=device)).shape == (0, 3, 2)
    with pytest.raises(ValueError, match="dense_grouped takes fp8_block rows, not 'bf16'"):
        ops.dense_grouped(x3, w8, "bf16", device=device)
    with pytest.raises(ValueError, match="w's 5 rows are not 3 groups"):
        ops.dense_grouped(x3, device.asarray(np.zeros((5, 36), np.uint8)), "fp8_block", device=device)
    with pytest.raises(ValueError, match="fp8_block w has 40 bytes per row but x has K=32"):
        ops.dense_grouped(x3, device.asarray(np.zeros((6, 40), np.uint8)), "fp8_block", device=device)
    with pytest.raises(TypeError, match="w must be uint8 for storage 'q8_0'"):
        dense_gemv(xq, device.asarray(np.zeros((3, 68), np.uint16)), "q8_0", device=device)
    with pytest.raises(ValueError, match="unknown quantized storage 'bf16'"):
        dense_dequant(device.asarray(np.zeros((3, 68), np.uint8)), "bf16", 64, device=device)
    with pytest.raises(ValueError, match="must be whole blocks of 32"):
        QuantizedMatrix("q8_0", np.zeros((3, 34), np.uint8), (3, 40))
    with pytest.raises(ValueError, match="unknown quantized kind"):
        QuantizedMatrix("q5_0", np.zeros((3, 34), np.uint8), (3, 32))


# ---- kv_store / paged_attention (beyond the registry cases) --------------------------------------------------------
def _paged_inputs(device, seed, kind, t, start, heads, kv_heads, dim, block_size=16, q_scale=1.0):
    """A sequence of start + T positions stored through ops.kv_store in shuffled blocks of a pool whose other rows
    hold NaN (f32/f16) or random codes, and T queries; returns (device arrays for the op, host arrays for the
    reference)."""
    rng = np.random.default_rng(seed)
    total = start + t
    nblocks = -(-total // block_size) + 2
    table = rng.permutation(nblocks).astype(np.int32)
    shape = (nblocks, block_size, kv_heads, dim)
    dt = KV_DTYPES[kind]
    pools = [np.full(shape, np.nan, dt) if kind in ("f32", "f16") else rng.integers(0, np.iinfo(dt).max + 1, shape,
                                                                                      dtype=dt) for _ in range(2)]
    scales = [rng.uniform(0.5, 2.0, shape[:3]).astype(np.float32) for _ in range(2)] if kind == "fp8" else [None] * 2
    dpools = [device.asarray(p) for p in pools]
    dscales = [None if s is None else device.asarray(s) for s in scales]
    dtable = device.asarray(table)
    k = rng.standard_normal((total, kv_heads, dim)).astype(np.float32)
    v = rng.standard_normal((total, kv_heads, dim)).astype(np.float32)
    ops.kv_store(device.asarray(k), device.asarray(v), *dpools, *dscales, dtable, 0, device=device)
    q = (q_scale * rng.standard_normal((t, heads, dim))).astype(np.float32)
    host = [device.to_host(p) for p in dpools] + [None if s is None else device.to_host(s) for s in dscales]
    return (q, *dpools, *dscales, dtable), (q, *host, table)


def _paged_tolerance(device, t):
    """Decode (T <= 16) and the cpu device: fp32 sums on the widened values; prefill on gpu/emu: bf16 tensor-core
    products (Q, K, V and the probabilities rounded to bf16), fp32 softmax and sums."""
    return 1e-5 if device.kind == "cpu" or t <= DECODE_MAX_TOKENS else 1e-2


def _paged_run(device, args, start, **kw):
    q = args[0]
    out = device.asarray(poison((q.shape[0], q.shape[1] * q.shape[2]), np.float32))
    got = ops.paged_attention(device.asarray(q), *args[1:], start, out=out, device=device, **kw)
    assert got is out
    return device.to_host(got)


@pytest.mark.parametrize("kind", ["bf16", "fp8"])
@pytest.mark.parametrize("t,start,heads,kv_heads,dim,window", [
    (1, 0, 4, 4, 32, 0),      # the first position
    (3, 300, 8, 2, 128, 0),   # a long context: several splits on gpu/emu
    (2, 20, 12, 1, 32, 0),    # group of 12: two decode blocks of up to 8 heads, the second half empty
    (1, 70, 16, 1, 32, 5),    # group of 16, a window of 5
    (2, 9, 3, 3, 256, 0),     # the largest head dim
    (1, 40, 4, 2, 48, 0),     # head dims that are not whole 32-lane chunks (the bundled model: 48)
    (3, 45, 6, 2, 96, 20),    # group of 3 in blocks of 4, window inside the context
    (1, 5, 4, 2, 224, 0),
    (17, 0, 4, 2, 32, 0),     # the smallest prompt: more queries than keys at the start
    (40, 23, 6, 2, 80, 0),    # a prompt chunk after a prefix; group of 3 (64 rows hold 21 queries)
    (33, 64, 8, 1, 192, 30),  # group of 8, a window, a chunk starting on a block boundary
    (20, 3, 64, 1, 64, 0),    # group of 64: one query per prefill block
])
def test_paged_attention_awkward_shapes(device, kind, t, start, heads, kv_heads, dim, window):
    args, host = _paged_inputs(device, dim + heads + t, kind, t, start, heads, kv_heads, dim)
    want = paged_attention_reference(*host, start, window=window)
    assert_close(_paged_run(device, args, start, window=window), want,
                 atol=_paged_tolerance(device, t) * float(np.abs(want).max()), name="paged_attention")


@pytest.mark.parametrize("splits", [1, 2, 3, 7, 1000])
@pytest.mark.parametrize("t,start,window,sinks", [(1, 300, 0, False), (3, 130, 0, True), (16, 0, 0, False),
                                                  (2, 400, 100, True)])
def test_paged_decode_context_splits(cuda_device, t, start, window, sinks, splits):
    """Flash-decoding splits, including splits that are empty for the early queries (T=16 at the start) or outside
    the window, merged with the sinks."""
    from freetoken.ops.paged_attention_cuda import paged_attention_cuda

    dev = cuda_device
    args, host = _paged_inputs(dev, splits + t, "bf16", t, start, 4, 2, 32)
    sk = np.random.default_rng(t).uniform(-1, 3, 4).astype(np.float32) if sinks else None
    out = dev.asarray(poison((t, 4 * 32), np.float32))
    paged_attention_cuda(dev, dev.asarray(args[0]), *args[1:], start, window, None if sk is None else dev.asarray(sk),
                         1 / np.sqrt(32), out, splits=splits)
    want = paged_attention_reference(*host, start, window=window, sinks=sk)
    assert_close(dev.to_host(out), want, atol=1e-5 * float(np.abs(want).max()), name="paged decode")


def test_paged_plan_splits(cuda_device):
    from freetoken.ops.paged_attention_cuda import plan_splits

    assert plan_splits(cuda_device, 1, 1, 1000, splits=3) == (3, 352)
    assert plan_splits(cuda_device, 1, 1, 40, splits=1000) == (2, 32)  # chunks are whole 32-key tiles
    assert plan_splits(cuda_device, 1, 1, 1, splits=None) == (1, 32)
    nsplit, chunk = plan_splits(cuda_device, 1, 1, 100_000)
    assert nsplit > 1 and nsplit * chunk >= 100_000 and (nsplit - 1) * chunk < 100_000


@pytest.mark.parametrize("t", [2, 30])
def test_paged_attention_large_scores_stay_finite(device, t):
    """Scores in the hundreds: only a max-subtracted softmax survives (decode and prompt kernels). The prompt kernel
    on gpu/emu rounds q and k to bf16, which moves scores of ~300 by ~1: its bound is the overflow check's, 10%."""
    args, host = _paged_inputs(device, 5, "bf16", t, 50, 4, 2, 64, q_scale=40.0)
    got = _paged_run(device, args, 50)
    assert np.isfinite(got).all()
    want = paged_attention_reference(*host, 50)
    tol = _paged_tolerance(device, t)
    assert_close(got, want, atol=(0.1 if tol > 1e-5 else tol) * float(np.abs(want).max()), name="paged_attention")


@pytest.mark.parametrize("t", [2, 20])
def test_paged_attention_deterministic(device, t):
    args, _ = _paged_inputs(device, 11, "f16", t, 260, 8, 2, 64)
    np.testing.assert_array_equal(_paged_run(device, args, 260), _paged_run(device, args, 260))


def test_paged_attention_no_queries(device):
    args, _ = _paged_inputs(device, 1, "bf16", 1, 4, 4, 2, 32)
    q = device.asarray(np.zeros((0, 4, 32), np.float32))
    assert tuple(ops.paged_attention(q, *args[1:], 5, device=device).shape) == (0, 128)
    ops.kv_store(q[:, :2], q[:, :2], *args[1:5], args[5], 5, device=device)  # nothing to append


def test_kv_store_encodes_awkward_values_as_the_host(device):
    """Ties (round to even), overflow, subnormals, signed zeros, inf and NaN: the device's bf16 / f16 rows are the
    host encoder's bits; fp8 rows saturate at +-448 with the row scale amax / 448 (1 for an all-zero row)."""
    from freetoken.ops.paged_attention import kv_encode

    f32 = np.float32
    ties = np.array([0x3F808000, 0x3F818000, 0x7F7F8000, 0x00008000, 0x80018000], np.uint32).view(f32)
    special = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 3.4e38, -3.4e38, 1e-40, -1e-45, 65504.0, 65520.0,
                        6e-8, 2.9e-8, 1.0], f32)
    rows = np.zeros((4, 1, 19), f32)
    rows[0, 0] = np.concatenate([ties, special])
    rows[1, 0] = np.random.default_rng(1).standard_normal(19) * f32(1e3)
    rows[2, 0, :3] = [1e-30, -2.0, 0.5]  # row 3 stays zero
    table = device.asarray(np.array([1, 0], np.int32))
    for kind in ("bf16", "f16", "fp8"):
        x = rows if kind != "fp8" else np.nan_to_num(rows, nan=0.0, posinf=0.0, neginf=0.0)
        dt = KV_DTYPES[kind]
        pools = [device.asarray(np.zeros((2, 3, 1, 19), dt)) for _ in range(2)]
        scales = [device.asarray(np.zeros((2, 3, 1), f32)) for _ in range(2)] if kind == "fp8" else [None, None]
        ops.kv_store(device.asarray(x), device.asarray(x), *pools, *scales, table, 1, device=device)
        want, want_scale = kv_encode(x, kind)
        got = device.to_host(pools[1]).reshape(6, 1, 19)[[4, 5, 0, 1]]  # positions 1..4: block 1 rows 1, 2, block 0
        nan = np.isnan(x)  # any NaN code will do (CUDA's half NaN is 0x7FFF, NumPy's 0x7E00)
        if kind == "f16":
            assert np.isnan(got[nan]).all()
        elif kind == "bf16":
            assert np.isnan((got[nan].astype(np.uint32) << 16).view(f32)).all()
        np.testing.assert_array_equal(got[~nan], want[~nan], err_msg=kind)
        if want_scale is not None:
            np.testing.assert_array_equal(device.to_host(scales[1]).reshape(6, 1)[[4, 5, 0, 1]], want_scale)


# ---- rms_norm, rope, route_softmax_topk ---------------------------------------------------------------------------
@pytest.mark.parametrize("xs,ws", [((1, 1024), (1024,)), ((3, 20, 64), (20, 64)), ((4, 6, 16), (16,)), ((2, 1), (1,))])
def test_rms_norm_shapes(device, xs, ws):
    rng = np.random.default_rng(8)
    x, w = rng.standard_normal(xs, np.float32), rng.standard_normal(ws, np.float32)
    got = device.to_host(ops.rms_norm(device.asarray(x), device.asarray(w), 1e-6, device=device))
    assert got.dtype == np.float32 and got.shape == x.shape
    assert_close(got, rms_norm_reference(x, w, 1e-6), atol=1e-6, rtol=2e-6)


def test_rms_norm_strided_and_cpu_fallback(device):
    """A strided view of x (the decoder's per-head q/k); on cpu, float64 input takes the array-op fallback."""
    rng = np.random.default_rng(8)
    x = rng.standard_normal((5, 24, 16), np.float32)
    w = rng.standard_normal((20, 16), np.float32)
    got = device.to_host(ops.rms_norm(device.asarray(x)[:, 2:22], device.asarray(w), 1e-6, device=device))
    assert_close(got, rms_norm_reference(x[:, 2:22], w, 1e-6), atol=1e-6, rtol=2e-6)
    if device.kind == "cpu":
        x64 = x[:, 2:22].astype(np.float64)
        np.testing.assert_allclose(ops.rms_norm(x64, w, 1e-6, device=device), rms_norm_reference(x64, w, 1e-6),
                                   rtol=1e-6)
    else:
        with pytest.raises(TypeError, match="x and weight must be float32"):
            ops.rms_norm(device.asarray(x.astype(np.float64)), device.asarray(w[0]), 1e-6, device=device)
        with pytest.raises(ValueError, match="must equal the trailing axes"):
            ops.rms_norm(device.asarray(x), device.asarray(w), 1e-6, device=device)


def test_rope_bit_identical_to_numpy_float32(device):
    """On cpu: NumPy's float32 arithmetic element for element (the decoder's logits stay bit-identical); gpu/emu
    within rounding of the float64 reference. Strided q/k views as the decoder passes them."""
    from freetoken.models.rope import rope_tables

    rng = np.random.default_rng(9)
    cos, sin = rope_tables(np, np.arange(100), 64, 1e6)
    for t, start in ((1, 37), (5, 0)):
        x = rng.standard_normal((t, 24, 64), np.float32)[:, :20]
        c, s = cos[start:start + t], sin[start:start + t]
        got = device.to_host(ops.rope(device.asarray(x), device.asarray(c), device.asarray(s), device=device))
        if device.kind == "cpu":
            half = 32
            want = x * c[:, None, :] + np.concatenate([-x[..., half:], x[..., :half]], axis=-1) * s[:, None, :]
            np.testing.assert_array_equal(got, want)
        else:
            assert_close(got, rope_reference(x, c, s), atol=1e-6, rtol=1e-6)
    if device.kind != "cpu":
        with pytest.raises(ValueError, match="head dim 7 must be even"):
            ops.rope(device.asarray(np.zeros((1, 2, 7), np.float32)), cos[:1, :7], sin[:1, :7], device=device)


@pytest.mark.parametrize("t,heads,kv_heads,dim,start", [(1, 4, 2, 48, 0), (1, 8, 2, 64, 37), (3, 6, 3, 10, 5),
                                                       (2, 2, 1, 128, 20)])
@pytest.mark.parametrize("use_norm", [True, False])
@pytest.mark.parametrize("checked", [False, True])
def test_fused_ops_bit_identical_to_unfused(device, t, heads, kv_heads, dim, start, use_norm, checked):
    """rope_qkv_cache is rms_norm over the q/k heads, rope and the k/v row copies; add_rms_norm is ``x += y`` and
    rms_norm: bit for bit on cpu (its golden logits rest on it) and emu (the same block sums as rms_norm_f32);
    a GPU compiler may contract the two kernels' products differently: within rounding there. Checked or not."""
    from freetoken.models.rope import rope_tables

    def same(got, want):
        if device.kind == "gpu":
            assert_close(got, want, atol=1e-6, rtol=1e-6)
        else:
            np.testing.assert_array_equal(got, want)

    rng = np.random.default_rng(t * 1000 + dim + start)
    cos, sin = rope_tables(np, np.arange(64), dim, 1e6)
    c, s = device.asarray(cos[start:start + t]), device.asarray(sin[start:start + t])
    qkv = device.asarray((3 * rng.standard_normal((t, (heads + 2 * kv_heads) * dim))).astype(np.float32))
    qn, kn = (1 + 0.1 * rng.standard_normal((2, dim))).astype(np.float32)
    norm = device.asarray(np.concatenate([np.tile(qn, (heads, 1)), np.tile(kn, (kv_heads, 1))])) if use_norm else None
    rows = start + t + 2
    qk = qkv.reshape(t, heads + 2 * kv_heads, dim)[:, :heads + kv_heads]
    if use_norm:
        qk = ops.rms_norm(device.xp.ascontiguousarray(qk), norm, 1e-6, device=device)
    qk = ops.rope(device.xp.ascontiguousarray(qk), c, s, device=device)
    k_want, v_want = (np.full((rows, kv_heads, dim), 7.0, np.float32) for _ in range(2))
    k_want[start:start + t] = device.to_host(qk[:, heads:])
    v_want[start:start + t] = device.to_host(qkv.reshape(t, -1, dim)[:, heads + kv_heads:])
    k_got, v_got = device.asarray(np.full_like(k_want, 7.0)), device.asarray(np.full_like(v_want, 7.0))
    q_got = ops.rope_qkv_cache(qkv, norm, 1e-6, c, s, k_got, v_got, start, device=device, checked=False,
                               out=device.asarray(np.full((t, heads, dim), np.nan, np.float32)))
    if checked:  # the checked path on the same (valid) arguments
        q_got = ops.rope_qkv_cache(qkv, norm, 1e-6, c, s, k_got, v_got, start, out=q_got, device=device,
                                   checked=True)
    same(device.to_host(q_got), device.to_host(qk[:, :heads]))
    same(device.to_host(k_got), k_want)
    np.testing.assert_array_equal(device.to_host(v_got), v_want)

    x = (3 * rng.standard_normal((t, heads * dim))).astype(np.float32)
    y = (3 * rng.standard_normal((t, heads * dim))).astype(np.float32)
    w = device.asarray((1 + 0.1 * rng.standard_normal(heads * dim)).astype(np.float32))
    want = device.to_host(ops.rms_norm(device.asarray(x + y), w, 1e-6, device=device))
    xd = device.asarray(x.copy())
    got = ops.add_rms_norm(xd, device.asarray(y), w, 1e-6, out=device.empty(x.shape), device=device, checked=checked)
    np.testing.assert_array_equal(device.to_host(xd), x + y)
    same(device.to_host(got), want)


def test_fused_ops_misuse(device):
    k = device.asarray(np.zeros((4, 2, 8), np.float32))
    qkv = device.asarray(np.zeros((1, 6 * 8), np.float32))
    cs = device.asarray(np.zeros((1, 8), np.float32))
    with pytest.raises(ValueError, match="do not fit caches of 4 rows"):
        ops.rope_qkv_cache(qkv, None, 1e-6, cs, cs, k, device.asarray(np.zeros((4, 2, 8), np.float32)), 4,
                           device=device)
    with pytest.raises(ValueError, match=r"must be \[T, \(H \+ 2 Hkv\) D\] with H > 0"):
        ops.rope_qkv_cache(device.asarray(np.zeros((1, 4 * 8), np.float32)), None, 1e-6, cs, cs, k, k, 0,
                           device=device)
    with pytest.raises(ValueError, match=r"norm must be \[4, 8\]"):
        ops.rope_qkv_cache(qkv, device.asarray(np.ones((3, 8), np.float32)), 1e-6, cs, cs, k, k, 0, device=device)
    x = device.asarray(np.zeros((2, 8), np.float32))
    with pytest.raises(ValueError, match="differs from x shape"):
        ops.add_rms_norm(x, device.asarray(np.zeros((1, 8), np.float32)), cs[0], 1e-6, device=device)
    with pytest.raises(ValueError, match="must be C-contiguous"):
        ops.add_rms_norm(device.asarray(np.zeros((8, 2), np.float32)).T, x, cs[0], 1e-6, device=device)


@pytest.mark.parametrize("renorm", [False, True])
def test_route_softmax_topk_ties_and_nan(device, renorm):
    rng = np.random.default_rng(10)
    logits = rng.standard_normal((7, 64), np.float32) * 3
    logits[1, [5, 9, 40]] = logits[1].max() + 1  # a three-way tie: lower index first
    logits[2, 3] = np.nan  # NaN: the whole row's probabilities are NaN, ids 0..k-1
    ids, w = ops.route_softmax_topk(device.asarray(logits), 8, renorm, device=device)
    ids, w = device.to_host(ids), device.to_host(w)
    want_ids, want_w = route_softmax_topk_reference(logits, 8, renorm)
    np.testing.assert_array_equal(ids, want_ids)
    assert ids[1, :3].tolist() == [5, 9, 40]
    assert_close(w, want_w, atol=1e-8, rtol=2e-6)
    assert np.isnan(w[2]).all() and ids[2].tolist() == list(range(8))
    with pytest.raises(ValueError, match="k=65 must be in"):
        ops.route_softmax_topk(device.asarray(logits), 65, renorm, device=device)


# ---- gated_delta_rule: its chunked (WY) form against the recurrent kernel (gpu/emu) --------------------------------
# Small heads and few chunks: the emulator runs each of these in well under a second.
def _rule_inputs(rng, t, hk, hv, dk, dv, g_low):
    qkv = rng.standard_normal((t, 2 * hk * dk + hv * dv), dtype=np.float32)
    g = rng.uniform(g_low, 0.0, (t, hv)).astype(np.float32)
    beta = rng.uniform(0.02, 0.98, (t, hv)).astype(np.float32)
    state = (0.5 * rng.standard_normal((hv, dk, dv))).astype(np.float32)
    return qkv, g, beta, state


def _rule(dev, qkv, g, beta, state, hk, mode):
    """(out, new state) as host arrays; the host ``state`` is left as it was."""
    st = dev.asarray(state.copy())
    o = ops.gated_delta_rule(dev.asarray(qkv), dev.asarray(g), dev.asarray(beta), st, hk, mode=mode, device=dev)
    return dev.to_host(o), dev.to_host(st)


def _close_to(got, want, name):
    """Two fp32 evaluations of the rule: each is within ~7e-7 of the largest value from the float64 result."""
    assert_close(got, want, atol=1e-7 + 2e-6 * float(np.abs(want).max()), name=name)


@pytest.mark.parametrize("t,hk,hv,dk,dv,g_low", [
    (64, 2, 4, 16, 24, -3.0),  # one chunk exactly (mode="auto"'s threshold), GQA
    (129, 1, 2, 48, 16, -0.05),  # two chunks and a 1-token one; weak decay: the state carries across chunks
    (100, 2, 2, 33, 40, 0.0),  # no decay (G = 0); Dk not a multiple of the prep kernel's 32-dim tiles
    (1, 1, 1, 8, 8, -1.0),  # a single token through the chunked form (mode="chunked" at any T)
])
def test_gated_delta_chunked_equals_recurrent(cuda_device, t, hk, hv, dk, dv, g_low):
    """The chunked form and the recurrent kernel agree on the same input, out and state, and both match the float64
    reference."""
    inp = _rule_inputs(np.random.default_rng(t + dk), t, hk, hv, dk, dv, g_low)
    rec_o, rec_s = _rule(cuda_device, *inp, hk, "recurrent")
    chk_o, chk_s = _rule(cuda_device, *inp, hk, "chunked")
    _close_to(chk_o, rec_o, "out")
    _close_to(chk_s, rec_s, "state")
    ref_o, ref_s = gated_delta_rule_reference(*inp, hk)
    _close_to(chk_o, ref_o, "out vs reference")
    _close_to(chk_s, ref_s, "state vs reference")


def test_gated_delta_chunked_prefill_then_decode(cuda_device):
    """A sequence fed in pieces with mode="auto": a chunked prefill, recurrent decode steps, a second (chunked,
    partial-chunk) prompt, a short (recurrent) one and more decode steps, equals the recurrent form over every token at
    once: each piece's output and the final state."""
    dev, hk, hv, dk, dv = cuda_device, 1, 2, 32, 24
    pieces = [100, 1, 1, 1, 70, 5, 1]
    assert pieces[0] >= LINEAR_CHUNKED_MIN_TOKENS and pieces[5] < LINEAR_CHUNKED_MIN_TOKENS
    qkv, g, beta, state = _rule_inputs(np.random.default_rng(9), sum(pieces), hk, hv, dk, dv, -0.5)
    want_o, want_s = _rule(dev, qkv, g, beta, state, hk, "recurrent")
    st, pos = dev.asarray(state.copy()), 0
    for n in pieces:
        part = slice(pos, pos + n)
        o = ops.gated_delta_rule(dev.asarray(qkv[part]), dev.asarray(g[part]), dev.asarray(beta[part]), st, hk,
                                 device=dev)
        _close_to(dev.to_host(o), want_o[part], f"out[{pos}:{pos + n}]")
        pos += n
    _close_to(dev.to_host(st), want_s, "state")


def test_gated_delta_rule_dispatch(cuda_device, monkeypatch):
    """mode="auto" launches the recurrent kernel below LINEAR_CHUNKED_MIN_TOKENS tokens and the chunked form's two
    kernels from there on; an unknown mode is refused."""
    import freetoken.ops.linear_attention as la

    launched = []

    def spy(dev, source, kernel, *args):
        launched.append(kernel)
        return real(dev, source, kernel, *args)

    real = la.cuda_kernel
    monkeypatch.setattr(la, "cuda_kernel", spy)
    hk, hv, dk, dv = 1, 1, 8, 8
    for t, want in ((LINEAR_CHUNKED_MIN_TOKENS - 1, ["gated_delta_rule_f32"]),
                    (LINEAR_CHUNKED_MIN_TOKENS, ["gated_delta_chunk_prep_f32", "gated_delta_chunk_scan_f32"])):
        launched.clear()
        _rule(cuda_device, *_rule_inputs(np.random.default_rng(t), t, hk, hv, dk, dv, -1.0), hk, "auto")
        assert launched == want, t
    with pytest.raises(ValueError, match="mode must be"):
        _rule(cuda_device, *_rule_inputs(np.random.default_rng(0), 2, hk, hv, dk, dv, -1.0), hk, "wy")


# ---- moe_experts (tests/test_cpu_experts.py: the Numba executor's own API) ----------------------------------------
def _moe(fmt_name="q4_0", bias=False, slots=6):
    layout = RecordLayout(formats.get(fmt_name), 96, 160, bias)
    return layout, random_record(layout, slots, 0)


def test_moe_bf16_activations(device):
    layout, banks = _moe()
    rng = np.random.default_rng(5)
    x = rng.standard_normal((3, 96)).astype(np.float32)
    ids = rng.integers(0, 6, (3, 2)).astype(np.int32)
    weights = rng.random((3, 2)).astype(np.float32)
    xb = x.astype(ml_dtypes.bfloat16)
    want = moe_forward_reference(xb, ids, weights, layout.dequantize(banks))
    dev_banks = {n: device.asarray(a) for n, a in banks.items()}
    xin = xb if device.kind != "gpu" else xb.view(np.uint16)
    got = device.to_host(ops.moe_experts(device.asarray(xin), device.asarray(ids), device.asarray(weights), dev_banks,
                                         layout, mode="decode", device=device, activations="f32"))
    assert_close(got, want, atol=2e-6 * float(np.abs(want).max()), rtol=1e-5)


def test_moe_bad_ids_and_shapes(device):
    layout, banks = _moe("mxfp4")
    dev_banks = {n: device.asarray(a) for n, a in banks.items()}
    x = device.asarray(np.ones((2, 96), np.float32))
    w = device.asarray(np.ones((2, 2), np.float32))
    with pytest.raises(ValueError, match=r"ids\[1, 0\] = 6"):
        device.to_host(ops.moe_experts(x, device.asarray(np.array([[0, 1], [6, 0]], np.int32)), w, dev_banks, layout,
                                       device=device))
    ids = device.asarray(np.zeros((2, 2), np.int32))
    with pytest.raises(ValueError, match="x has 48 features"):
        ops.moe_experts(x[:, :48], ids, w, dev_banks, layout, device=device)
    with pytest.raises(ValueError, match="gate.s"):
        ops.moe_experts(x, ids, w, {**dev_banks, "gate.s": dev_banks["gate.s"][:, :, :1]}, layout, device=device)
    with pytest.raises(ValueError, match="unknown activation"):
        ops.moe_experts(x, ids, w, dev_banks, layout, act="relu", device=device)


@pytest.mark.parametrize("fmt_name", ["q4_0", "bf16"])
def test_moe_workspace_reuse_equals_fresh_buffers(cuda_device, fmt_name):
    """One MoeWorkspace serves call after call (counters reset, plan rebuilt) with exactly the results of fresh
    buffers, in decode and prefill modes; a call larger than it was made for falls back to fresh buffers."""
    layout, banks = _moe(fmt_name)
    dev_banks = {name: cuda_device.asarray(a) for name, a in banks.items()}
    ws = ops.MoeWorkspace(cuda_device, layout, dev_banks, max_pairs=40)
    for n, (tokens, k, mode) in enumerate([(1, 8, "decode"), (3, 2, "decode"), (17, 2, "prefill"), (1, 1, "decode"),
                                           (30, 2, "prefill")]):  # the last one has 60 pairs > 40
        rng = np.random.default_rng(10 + n)
        x = rng.standard_normal((tokens, 96)).astype(np.float32)
        ids = rng.integers(0, 6, (tokens, k)).astype(np.int32)
        weights = rng.random((tokens, k)).astype(np.float32)
        args = (cuda_device.asarray(x), cuda_device.asarray(ids), cuda_device.asarray(weights), dev_banks, layout)
        want = cuda_device.to_host(ops.moe_experts(*args, mode=mode, device=cuda_device))
        got = cuda_device.to_host(ops.moe_experts(*args, mode=mode, device=cuda_device, workspace=ws))
        np.testing.assert_array_equal(got, want)


# ---- cache ops (tests/test_cache.py: ExpertCache on top) ------------------------------------------------------------
def test_cache_admit_errors(device):
    """An id out of range: error 1 and slot -1 for its pair; no victim left (every slot pinned): error 2."""
    slots, experts = 4, 3
    i32, i64 = np.int32, np.int64
    st = [device.asarray(a) for a in (np.full(experts, -1, i32), np.full(slots, -1, i32), np.full(slots, -1, i64),
                                       np.zeros(slots, np.uint8), np.zeros(1, i64), np.zeros(8, i32),
                                       np.zeros(1, i32), np.zeros(1, i64), np.zeros(1, i64), np.zeros(1, i32))]
    sfi, ios, rec, pin, clock, work, n_work, hits, misses, err = st
    ids = device.asarray(np.array([[0, 5]], i32))
    ops.cache_admit(ids, 0, experts, sfi, ios, rec, pin, clock, work, n_work, hits, misses, err, device=device)
    assert device.to_host(ids).tolist() == [[0, -1]] and int(device.to_host(err)[0]) == 1
    assert device.to_host(ios).tolist() == [0, -1, -1, -1] and int(device.to_host(n_work)[0]) == 1
    pin[...] = 1
    ids = device.asarray(np.array([[1]], i32))
    ops.cache_admit(ids, 0, experts, sfi, ios, rec, pin, clock, work, n_work, hits, misses, err, device=device)
    assert int(device.to_host(err)[0]) == 2 and device.to_host(ids).tolist() == [[-1]]
    assert device.to_host(hits).tolist() == [0] and device.to_host(misses).tolist() == [2]
    with pytest.raises(TypeError, match="C-contiguous int32"):
        ops.cache_admit(device.asarray(np.zeros((1, 2), np.int64)), 0, experts, sfi, ios, rec, pin, clock, work,
                        n_work, hits, misses, err, device=device)
