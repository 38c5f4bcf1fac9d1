"""Decode attention (ops.attention_decode) against the float64 reference and the model's NumPy attention."""

import numpy as np
import pytest

from freetoken import ops
from freetoken.models.layers import attention as numpy_attention
from freetoken.ops.attention import plan_splits
from freetoken.ops.attention_reference import attention_reference
from freetoken.testing import assert_close, poison

REL = 1e-5  # tolerance: REL * max |reference|


def _inputs(seed, t, start, heads, kv_heads, dim, extra_rows=3, q_scale=1.0):
    """Random q and a cache with `extra_rows` NaN rows past start + T - 1 (never to be read)."""
    rng = np.random.default_rng(seed)
    rows = start + t + extra_rows
    q = (q_scale * rng.standard_normal((t, heads, dim))).astype(np.float32)
    k = rng.standard_normal((rows, kv_heads, dim)).astype(np.float32)
    v = rng.standard_normal((rows, kv_heads, dim)).astype(np.float32)
    k[start + t:] = np.nan
    v[start + t:] = np.nan
    return q, k, v


def _run(device, q, k, v, start, **kw):
    t, heads, dim = q.shape
    out = device.asarray(poison((t, heads * dim), np.float32))
    got = ops.attention_decode(device.asarray(q), device.asarray(k), device.asarray(v), start, out=out,
                               device=device, **kw)
    assert got is out
    return device.to_host(got)


def _check(got, want, name="attention"):
    assert_close(got, want, atol=REL * float(np.abs(want).max()), name=name)


@pytest.mark.parametrize("dim", [32, 64, 128])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 2), (6, 1)])
@pytest.mark.parametrize("start", [0, 1, 37, 300])
@pytest.mark.parametrize("t", [1, 3])
def test_matches_reference(device, t, start, heads, kv_heads, dim):
    q, k, v = _inputs(t * 1000 + start + dim, t, start, heads, kv_heads, dim)
    _check(_run(device, q, k, v, start), attention_reference(q, k, v, start))


@pytest.mark.parametrize("t,start,heads,kv_heads,dim", [
    (2, 20, 12, 1, 32),   # group of 12: two blocks of up to 8 heads, the second half empty
    (1, 70, 16, 1, 32),   # group of 16: two full blocks of 8
    (2, 9, 3, 3, 256),    # the largest head dim
    (1, 40, 4, 2, 48),    # head dims that are not whole 32-lane chunks (the bundled model: 48)
    (3, 5, 8, 8, 16),
    (2, 130, 6, 2, 80),
    (3, 45, 6, 2, 96),    # 3 elements per lane, group of 3 in blocks of 4
    (1, 5, 4, 2, 224),
    (17, 0, 4, 2, 32),    # prefill-like: more queries than keys at the start
])
def test_awkward_shapes(device, t, start, heads, kv_heads, dim):
    q, k, v = _inputs(dim + heads, t, start, heads, kv_heads, dim)
    _check(_run(device, q, k, v, start), attention_reference(q, k, v, start))


@pytest.mark.parametrize("splits", [1, 2, 3, 7, 1000])
@pytest.mark.parametrize("t,start", [(1, 300), (3, 130), (40, 0)])
def test_context_splits(cuda_device, t, start, splits):
    """Flash-decoding splits, including splits that are empty for the early queries (t=40, start=0)."""
    q, k, v = _inputs(splits + t, t, start, 4, 2, 32)
    _check(_run(cuda_device, q, k, v, start, splits=splits), attention_reference(q, k, v, start))


def test_plan_splits(cuda_device):
    assert plan_splits(cuda_device, 1, 1, 1000, splits=3) == (3, 352)
    assert plan_splits(cuda_device, 1, 1, 40, splits=1000) == (2, 32)  # chunks are whole 32-key tiles
    assert plan_splits(cuda_device, 1, 1, 1, splits=None) == (1, 32)
    nsplit, chunk = plan_splits(cuda_device, 1, 1, 100_000)
    assert nsplit > 1 and nsplit * chunk >= 100_000 and (nsplit - 1) * chunk < 100_000


@pytest.mark.parametrize("t,start,heads,kv_heads,dim", [(1, 63, 8, 2, 64), (4, 11, 4, 1, 32), (5, 0, 6, 3, 128)])
def test_matches_model_attention(device, t, start, heads, kv_heads, dim):
    q, k, v = _inputs(7 * t + start, t, start, heads, kv_heads, dim, extra_rows=0)
    want = numpy_attention(np, q, k, v, start)
    _check(_run(device, q, k, v, start), want, "vs models.layers.attention")


def test_large_scores_stay_finite(device):
    """Scores in the hundreds: only a max-subtracted softmax survives."""
    q, k, v = _inputs(5, 2, 50, 4, 2, 64, q_scale=40.0)
    got = _run(device, q, k, v, 50)
    assert np.isfinite(got).all()
    _check(got, attention_reference(q, k, v, 50))


def test_deterministic(device):
    q, k, v = _inputs(11, 2, 260, 8, 2, 64)
    a = _run(device, q, k, v, 260)
    b = _run(device, q, k, v, 260)
    np.testing.assert_array_equal(a, b)


def test_noncontiguous_q_and_new_out(device):
    q, k, v = _inputs(3, 2, 10, 8, 4, 32)
    k_d, v_d = device.asarray(k), device.asarray(v)
    got = device.to_host(ops.attention_decode(device.asarray(q), k_d, v_d, 10, device=device))
    wide = device.asarray(np.zeros(q.shape[:2] + (2 * q.shape[2],), np.float32))
    wide[..., ::2] = device.asarray(q)  # wide[..., ::2]: the values of q, strided
    got2 = device.to_host(ops.attention_decode(wide[..., ::2], k_d, v_d, 10, device=device))
    np.testing.assert_array_equal(got, got2)
    assert got.shape == (2, 8 * 32) and got.dtype == np.float32
    _check(got, attention_reference(q, k, v, 10))


def test_no_queries(device):
    q = device.asarray(np.zeros((0, 4, 32), np.float32))
    k = device.asarray(np.zeros((5, 2, 32), np.float32))
    got = ops.attention_decode(q, k, k, 5, device=device)
    assert tuple(got.shape) == (0, 128)


@pytest.mark.parametrize("q_shape,k_shape,start,kw,exc,match", [
    ((4, 32), (8, 2, 32), 0, {}, ValueError, r"q must be \[T, H, D\]"),
    ((1, 4, 32), (8, 64), 0, {}, ValueError, r"k_cache must be \[rows, Hkv, D\]"),
    ((1, 6, 32), (8, 4, 32), 0, {}, ValueError, r"query heads \(6\) must be a positive multiple of kv heads \(4\)"),
    ((1, 4, 0), (8, 2, 0), 0, {}, ValueError, r"head dim 0 unsupported"),
    ((1, 4, 288), (8, 2, 288), 0, {}, ValueError, r"head dim 288 unsupported"),
    ((1, 4, 32), (8, 2, 64), 0, {}, ValueError, r"head dim of q \(32\) and of the cache \(64\) differ"),
    ((3, 4, 32), (8, 2, 32), 6, {}, ValueError, r"cache of 8 rows is too short for start=6 \+ T=3"),
    ((1, 4, 32), (8, 2, 32), -1, {}, ValueError, r"start=-1 must be >= 0"),
    ((1, 4, 32), (8, 2, 32), 1.0, {}, TypeError, r"start must be an integer"),
    ((1, 4, 32), (8, 2, 32), 0, {"splits": 0}, ValueError, r"splits=0 must be at least 1"),
])
def test_rejects_bad_inputs(device, q_shape, k_shape, start, kw, exc, match):
    q = device.asarray(np.zeros(q_shape, np.float32))
    k = device.asarray(np.zeros(k_shape, np.float32))
    with pytest.raises(exc, match=match):
        ops.attention_decode(q, k, k, start, device=device, **kw)


def test_rejects_mismatched_cache_and_dtypes(device):
    q = device.asarray(np.zeros((1, 4, 32), np.float32))
    k = device.asarray(np.zeros((8, 2, 32), np.float32))
    with pytest.raises(ValueError, match=r"v_cache shape \(9, 2, 32\) differs from k_cache shape \(8, 2, 32\)"):
        ops.attention_decode(q, k, device.asarray(np.zeros((9, 2, 32), np.float32)), 0, device=device)
    with pytest.raises(TypeError, match="k_cache must be float32"):
        ops.attention_decode(q, k.astype(np.float16), k, 0, device=device)
    with pytest.raises(ValueError, match=r"out must be float32 of shape \(1, 128\)"):
        ops.attention_decode(q, k, k, 0, out=device.asarray(np.zeros((1, 64), np.float32)), device=device)
