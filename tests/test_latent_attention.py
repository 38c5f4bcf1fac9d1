"""The latent attention ops beyond the registry cases (tests/test_kernel_parity.py runs those on every device): the
cpu kernel's float32 accuracy, the CUDA kernel's exact data flow (inputs whose products and probabilities bf16 holds
exactly, so the tensor-core path must match the float64 reference to float32 rounding), the flash-decoding splits,
the identity the model relies on (absorbed weights give the expanded multi-head attention), the append's encodings,
determinism and errors that name the bad argument."""

import math

import numpy as np
import pytest

from freetoken import get_device, ops
from freetoken.testing import assert_close, poison
from freetoken.testing.reference.latent_attention import (
    latent_attention_reference,
    latent_rows_reference,
    latent_store_reference,
)
from freetoken.testing.reference.paged_attention import KV_DTYPES

CPU = get_device("cpu")


def _cache(device, rng, kind, rows, block_size=16, spare=2):
    """``rows`` [n, R + P] float32 appended through ops.latent_store at position 0 in shuffled blocks of a pool
    whose other rows hold NaN (f32/f16) or random codes; returns (device pool, scale, table, host pool, scale)."""
    total, width = rows.shape
    nblocks = -(-total // block_size) + spare
    table = rng.permutation(nblocks).astype(np.int32)
    shape = (nblocks, block_size, 1, width)
    dt = KV_DTYPES[kind]
    pool = (np.full(shape, np.nan, dt) if kind in ("f32", "f16")
            else rng.integers(0, np.iinfo(dt).max + 1, shape, dtype=dt))
    scale = rng.uniform(0.5, 2.0, shape[:3]).astype(np.float32) if kind == "fp8" else None
    dpool, dscale, dtable = device.asarray(pool), None if scale is None else device.asarray(scale), \
        device.asarray(table)
    ops.latent_store(device.asarray(rows), dpool, dscale, dtable, 0, device=device)
    return dpool, dscale, dtable, device.to_host(dpool), None if scale is None else device.to_host(dscale), table


def _run(device, q, cache, start, rank, scale):
    dpool, dscale, dtable = cache[:3]
    out = device.asarray(poison((q.shape[0], q.shape[1] * rank), np.float32))
    got = ops.latent_attention(device.asarray(q), dpool, dscale, dtable, start, rank, scale=scale, out=out,
                               device=device)
    assert got is out
    return device.to_host(got)


def _tolerance(device):
    """cpu: float32 on the widened rows; gpu/emu: bf16 Q, rows and probabilities on the tensor cores."""
    return 1e-5 if device.kind == "cpu" else 1e-2


@pytest.mark.parametrize("kind", ["f32", "f16", "bf16", "fp8"])
@pytest.mark.parametrize("t,heads,rank,rope,start", [
    (1, 32, 512, 64, 100),   # DeepSeek-V3's rows, a decode step
    (20, 5, 48, 8, 33),      # a prompt chunk after a prefix, rows of several queries
    (3, 2, 7, 0, 0),         # the sequence's start, no rope part
])
def test_cpu_float32_accuracy(kind, t, heads, rank, rope, start):
    """The cpu kernel sums in float32: within 1e-5 of the largest output of the float64 reference on the same
    stored rows, for every kind (the kinds' rounding is in both)."""
    rng = np.random.default_rng(t + heads + rank)
    cache = _cache(CPU, rng, kind, rng.standard_normal((start + t, rank + rope)).astype(np.float32))
    q = (2.0 * rng.standard_normal((t, heads, rank + rope))).astype(np.float32)
    sc = 1.0 / math.sqrt(rank + rope)
    want = latent_attention_reference(q, *cache[3:5], cache[5], start, rank, scale=sc)
    assert_close(_run(CPU, q, cache, start, rank, sc), want, atol=1e-5 * float(np.abs(want).max()), name="latent")


def _exact_inputs(rng, t, heads, width, total):
    """Integer rows and queries in [-2, 2] (bf16 holds them and their dot products): with scale ln 2 every score is
    an integer in base 2, so every probability relative to the running max is a power of two, exact in bf16 too."""
    rows = rng.integers(-2, 3, (total, width)).astype(np.float32)
    q = rng.integers(-2, 3, (t, heads, width)).astype(np.float32)
    return rows, q


EXACT_SCALE = math.log(2.0)


@pytest.mark.parametrize("kind", ["bf16", "f16", "f32"])
@pytest.mark.parametrize("t,heads,rank,rope,start", [
    (1, 16, 512, 64, 40),    # DeepSeek-V3's rows (the 576 build): 16 heads a block
    (2, 3, 100, 20, 70),     # R not a multiple of 8: the last column tile in part
    (19, 5, 31, 0, 45),      # odd rows, no rope part; row blocks span several queries; a partial last block
    (1, 40, 64, 16, 0),      # the first position; two row blocks, the second in part
])
def test_cuda_data_flow_is_exact(device, kind, t, heads, rank, rope, start):
    """On inputs whose products and probabilities bf16 holds exactly, every device matches the float64 reference
    to float32 rounding: a wrong fragment, row, column, mask or rescale in the tensor-core path shows at 1e-5."""
    rng = np.random.default_rng(7 * t + heads)
    rows, q = _exact_inputs(rng, t, heads, rank + rope, start + t)
    cache = _cache(device, rng, kind, rows)
    want = latent_attention_reference(q, *cache[3:5], cache[5], start, rank, scale=EXACT_SCALE)
    assert_close(_run(device, q, cache, start, rank, EXACT_SCALE), want, atol=1e-5 * float(np.abs(want).max()),
                 name="latent")


@pytest.mark.parametrize("splits", [1, 2, 3, 7, 1000])
@pytest.mark.parametrize("t,start", [(1, 300), (3, 130), (16, 0)])
def test_decode_context_splits(cuda_device, t, start, splits):
    """Flash-decoding splits merged by paged_combine, including splits that are empty for the early queries (T=16
    at the start), exact to float32 rounding on exact inputs."""
    from freetoken.ops.latent_attention_cuda import latent_attention_cuda

    dev = cuda_device
    rng = np.random.default_rng(splits + t)
    rows, q = _exact_inputs(rng, t, 4, 40, start + t)
    cache = _cache(dev, rng, "bf16", rows)
    out = dev.asarray(poison((t, 4 * 32), np.float32))
    latent_attention_cuda(dev, dev.asarray(q), *cache[:3], start, 32, EXACT_SCALE, out, splits=splits)
    want = latent_attention_reference(q, *cache[3:5], cache[5], start, 32, scale=EXACT_SCALE)
    assert_close(dev.to_host(out), want, atol=1e-5 * float(np.abs(want).max()), name="latent decode")


@pytest.mark.parametrize("t,start", [(1, 57), (6, 20)])
def test_absorbed_equals_expanded_attention(device, t, start):
    """DeepSeek's identity: with per-head W_UK [H, N, R] and W_UV [H, V, R], multi-head attention over expanded keys
    k_h = [W_UK_h c_kv, k_pe] and values v_h = W_UV_h c_kv equals latent attention with the absorbed query
    [W_UK_h^T q_nope_h, q_pe] followed by W_UV_h (float64 expanded attention; float32 pool: no storage rounding)."""
    rng = np.random.default_rng(t)
    heads, nope, rope, rank, vdim = 4, 24, 8, 40, 16
    total = start + t
    w_uk = (rng.standard_normal((heads, nope, rank)) / math.sqrt(rank)).astype(np.float32)
    w_uv = (rng.standard_normal((heads, vdim, rank)) / math.sqrt(rank)).astype(np.float32)
    c_kv = rng.standard_normal((total, rank)).astype(np.float32)
    k_pe = rng.standard_normal((total, rope)).astype(np.float32)
    q_nope = (2.0 * rng.standard_normal((t, heads, nope))).astype(np.float32)
    q_pe = (2.0 * rng.standard_normal((t, heads, rope))).astype(np.float32)
    scale = 1.0 / math.sqrt(nope + rope)

    # expanded: per-head keys and values, causal softmax attention in float64
    c64, w_uk64, w_uv64 = c_kv.astype(np.float64), w_uk.astype(np.float64), w_uv.astype(np.float64)
    keys = np.concatenate([np.einsum("hnr,pr->phn", w_uk64, c64),
                           np.broadcast_to(k_pe.astype(np.float64)[:, None], (total, heads, rope))], axis=-1)
    values = np.einsum("hvr,pr->phv", w_uv64, c64)
    qx = np.concatenate([q_nope, q_pe], axis=-1).astype(np.float64)
    s = np.einsum("thd,phd->htp", qx, keys) * scale
    s = np.where(np.arange(total)[None, None] <= start + np.arange(t)[None, :, None], s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    want = np.einsum("htp,phv->thv", p, values)

    # absorbed: one latent row per token, the query moved into latent space, W_UV after the attention
    cache = _cache(device, rng, "f32", np.concatenate([c_kv, k_pe], axis=1))
    q_lat = np.einsum("hnr,thn->thr", w_uk64, q_nope.astype(np.float64)).astype(np.float32)
    q = np.ascontiguousarray(np.concatenate([q_lat, q_pe], axis=-1))
    lat = _run(device, q, cache, start, rank, scale).reshape(t, heads, rank).astype(np.float64)
    got = np.einsum("hvr,thr->thv", w_uv64, lat)
    assert_close(got, want, atol=_tolerance(device) * float(np.abs(want).max()), name="absorbed")


def test_store_encodes_awkward_values_as_the_host(device):
    """Rows wider than paged attention's head dims and than attention takes (1100 values) with ties, overflow,
    subnormals, signed zeros, inf and NaN: the device's bf16 / f16 rows are the reference encoder's bits; fp8 rows
    saturate at +-448 with the row scale amax / 448 (1 for an all-zero row); f32 rows are copied. Only the appended
    positions change."""
    f32 = np.float32
    width = 1100
    ties = np.array([0x3F808000, 0x3F818000, 0x7F7F8000, 0x00008000, 0x80018000], np.uint32).view(f32)
    special = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 3.4e38, -3.4e38, 1e-40, -1e-45, 65504.0, 65520.0,
                        6e-8, 2.9e-8, 1.0], f32)
    rows = np.zeros((4, width), f32)
    rows[0, :19] = np.concatenate([ties, special])
    rows[1] = np.random.default_rng(1).standard_normal(width) * f32(1e3)
    rows[2, :3] = [1e-30, -2.0, 0.5]  # row 3 stays zero
    table = np.array([1, 0], np.int32)
    for kind in ("f32", "bf16", "f16", "fp8"):
        x = rows if kind != "fp8" else np.nan_to_num(rows, nan=0.0, posinf=0.0, neginf=0.0)
        pool = np.full((2, 3, 1, width), 7, KV_DTYPES[kind])
        scale = np.full((2, 3, 1), 5.0, f32) if kind == "fp8" else None
        dpool, dscale = device.asarray(pool), None if scale is None else device.asarray(scale)
        ops.latent_store(device.asarray(x), dpool, dscale, device.asarray(table), 1, device=device)
        want_pool, want_scale = latent_store_reference(x, pool, scale, table, 1)
        got = device.to_host(dpool)
        nan = np.isnan(want_pool.astype(f32)) if kind in ("f32", "f16") else \
            np.isnan((want_pool.astype(np.uint32) << 16).view(f32)) if kind == "bf16" else np.zeros(pool.shape, bool)
        if kind == "f16":  # any NaN code will do (CUDA's half NaN is 0x7FFF, NumPy's 0x7E00)
            assert np.isnan(got[nan]).all()
        elif kind == "bf16":
            assert np.isnan((got[nan].astype(np.uint32) << 16).view(f32)).all()
        np.testing.assert_array_equal(got[~nan], want_pool[~nan], err_msg=kind)
        if want_scale is not None:
            np.testing.assert_array_equal(device.to_host(dscale), want_scale)
            assert want_scale[0, 1, 0] == 1.0  # the all-zero row (position 4: block 0, row 1)


def test_deterministic_and_no_queries(device):
    rng = np.random.default_rng(11)
    cache = _cache(device, rng, "f16", rng.standard_normal((290, 72)).astype(np.float32))
    q = rng.standard_normal((3, 8, 72)).astype(np.float32)
    np.testing.assert_array_equal(_run(device, q, cache, 287, 64, 0.1), _run(device, q, cache, 287, 64, 0.1))
    empty = ops.latent_attention(device.asarray(np.zeros((0, 8, 72), np.float32)), *cache[:3], 290, 64, scale=0.1,
                                 device=device)
    assert tuple(empty.shape) == (0, 8 * 64)
    ops.latent_store(device.asarray(np.zeros((0, 72), np.float32)), *cache[:3], 290, device=device)  # nothing
    np.testing.assert_array_equal(device.to_host(cache[0]), cache[3])


def test_gathered_rows_are_the_stored_rows():
    """latent_rows_reference reads back what latent_store wrote (the reference's own round trip)."""
    rng = np.random.default_rng(5)
    rows = rng.standard_normal((37, 20)).astype(np.float32)
    cache = _cache(CPU, rng, "f32", rows)
    np.testing.assert_array_equal(latent_rows_reference(cache[3], None, cache[5], 37), rows)


def _args(kind="bf16", nblocks=4, bs=16, width=40):
    pool = np.zeros((nblocks, bs, 1, width), KV_DTYPES[kind])
    scale = np.ones((nblocks, bs, 1), np.float32) if kind == "fp8" else None
    return pool, scale, np.arange(nblocks, dtype=np.int32)


@pytest.mark.parametrize("change, match", [
    (dict(q=np.zeros((2, 4, 32), np.float32)), "q rows of 32 values"),
    (dict(q=np.zeros((2, 0, 40), np.float32)), "at least one head"),
    (dict(q=np.zeros((2, 4, 40), np.float64)), "q must be float32"),
    (dict(q=np.zeros((2, 40), np.float32)), "q must have 3 dimensions"),
    (dict(rank=0), r"rank=0 must be in \[1, 40\]"),
    (dict(rank=41), r"rank=41 must be in \[1, 40\]"),
    (dict(rank=2.5), "rank must be an integer"),
    (dict(scale=float("nan")), "scale=nan must be finite"),
    (dict(start=63), "too short"),
    (dict(start=-1), "start=-1 must be >= 0"),
    (dict(table=np.array([0, 9, 1, 2], np.int32), start=20), "outside the pool"),
    (dict(table=np.arange(4, dtype=np.int64)), "block_table must be int32"),
    (dict(pool_scale=np.ones((4, 16, 1), np.float32)), "has no scales"),
    (dict(pool=np.zeros((4, 16, 1, 40), np.int32)), "KV pool stores"),
    (dict(pool=np.zeros((4, 16, 2, 40), np.uint16)), r"pool must be \[num_blocks, block_size, 1, R \+ P\]"),
    (dict(pool=np.zeros((4, 16, 1, 1100), np.uint16), q=np.zeros((2, 4, 1100), np.float32)), "R \\+ P must be in"),
    (dict(pool=np.zeros((4, 16, 1, 40), np.uint8)), "needs pool_scale"),
    (dict(pool=np.zeros((4, 16, 1, 40), np.uint8), pool_scale=np.ones((4, 16), np.float32)), "pool_scale must be"),
    (dict(out=np.zeros((2, 4 * 40), np.float32)), "out must be float32 of shape"),
])
def test_attention_errors_name_the_argument(change, match):
    pool, scale, table = _args()
    a = dict(q=np.zeros((2, 4, 40), np.float32), pool=pool, pool_scale=scale, table=table, start=0, rank=32,
             scale=0.1, out=None)
    a.update(change)
    with pytest.raises((ValueError, TypeError), match=match):
        ops.latent_attention(a["q"], a["pool"], a["pool_scale"], a["table"], a["start"], a["rank"], scale=a["scale"],
                             out=a["out"], device=CPU)


def test_store_errors_name_the_argument():
    pool, scale, table = _args("fp8")
    kv = np.zeros((3, 40), np.float32)
    with pytest.raises(ValueError, match="needs pool_scale"):
        ops.latent_store(kv, pool, None, table, 0, device=CPU)
    with pytest.raises(ValueError, match="kv rows of 39 values differ from the pool's 40"):
        ops.latent_store(kv[:, :39], pool, scale, table, 0, device=CPU)
    with pytest.raises(ValueError, match="kv must have 2 dimensions"):
        ops.latent_store(kv[None], pool, scale, table, 0, device=CPU)
    with pytest.raises(ValueError, match="too short"):
        ops.latent_store(kv, pool, scale, table, 62, device=CPU)
    with pytest.raises(ValueError, match="must be C-contiguous"):
        ops.latent_store(kv, np.zeros((4, 16, 1, 80), np.uint8)[..., ::2], scale, table, 0, device=CPU)


def test_no_mma_build_compiles_for_gpus():
    """FREETOKEN_NO_MMA=1 builds the kernel on the portable mma twin instead of tensor cores (to tell a tensor-core
    fault on a GPU from the rest of the kernel); that build must stay warning-free too."""
    from freetoken.device.nvrtc import compile_cubin
    from freetoken.paths import cuda_dir

    src = cuda_dir() / "latent_attention.cu"
    assert compile_cubin(src.read_text(), src.name, "sm_86", ["-DFT_NO_MMA"])[:4] == b"\x7fELF"
