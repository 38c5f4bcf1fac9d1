"""The paged KV ops on the cpu device beyond the registry cases (tests/test_kernel_parity.py runs those on every
device): float32 accuracy of the prompt path against the float64 reference, the storage encodings on awkward values,
independence from where the blocks sit in the pool, and errors that name the bad argument."""

import ml_dtypes
import numpy as np
import pytest

from freetoken import get_device, ops
from freetoken.ops.paged_attention import kv_encode
from freetoken.testing.reference.paged_attention import KV_DTYPES, kv_encode_reference, paged_attention_reference

CPU = get_device("cpu")


def _sequence(rng, kind, total, kv_heads, dim, block_size, shuffle=True):
    k = rng.standard_normal((total, kv_heads, dim)).astype(np.float32)
    v = rng.standard_normal((total, kv_heads, dim)).astype(np.float32)
    nblocks = -(-total // block_size) + 2
    table = (rng.permutation(nblocks) if shuffle else np.arange(nblocks)).astype(np.int32)
    shape = (nblocks, block_size, kv_heads, dim)
    pools = [np.zeros(shape, KV_DTYPES[kind]) for _ in range(2)]
    scales = [np.zeros(shape[:3], np.float32) for _ in range(2)] if kind == "fp8" else [None, None]
    ops.kv_store(k, v, pools[0], pools[1], scales[0], scales[1], table, 0, device=CPU)
    return pools, scales, table


@pytest.mark.parametrize("kind", ["f32", "f16", "bf16", "fp8"])
@pytest.mark.parametrize("heads, kv_heads, dim, t, start, window, sinks", [
    (8, 2, 128, 70, 0, 0, False),      # a whole prompt, several query tiles and blocks
    (4, 4, 64, 33, 90, 0, True),       # a chunk continuing a sequence, no GQA, sinks
    (6, 2, 96, 40, 25, 17, False),     # a sliding window shorter than the chunk
    (4, 1, 256, 18, 0, 0, False),      # the largest head dim, one kv head for all
])
def test_prompt_attention_float32_accuracy(kind, heads, kv_heads, dim, t, start, window, sinks):
    """The cpu kernel sums in float32 (exponentials in float64): within 1e-5 of the largest output of the float64
    reference on the same stored keys and values, for every kind (the kinds' rounding is in both)."""
    rng = np.random.default_rng(7)
    (kp, vp), (ks, vs), table = _sequence(rng, kind, start + t, kv_heads, dim, 16)
    q = (2.0 * rng.standard_normal((t, heads, dim))).astype(np.float32)
    sk = rng.uniform(-1, 3, heads).astype(np.float32) if sinks else None
    got = ops.paged_attention(q, kp, vp, ks, vs, table, start, window=window, sinks=sk, device=CPU)
    want = paged_attention_reference(q, kp, vp, ks, vs, table, start, window=window, sinks=sk)
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()


@pytest.mark.parametrize("kind", ["f32", "f16", "bf16"])
@pytest.mark.parametrize("heads, kv_heads, dim, t, start, window, sinks", [
    (16, 4, 64, 1, 520, 0, False),     # the synthetic bench's decode step
    (3, 1, 48, 1, 2000, 0, True),      # a group of 3 (padding rows), 3 chunks of 16, 4 runs of keys, sinks
    (2, 2, 80, 1, 63, 0, False),       # no GQA, the last row of the first block
    (8, 1, 256, 2, 700, 0, False),     # two queries of a group of 8: 16 rows, the largest head dim
    (16, 1, 16, 1, 1100, 300, True),   # one kv head for 16, a window across blocks, sinks
    (4, 2, 128, 1, 0, 0, False),       # the first token
])
def test_decode_attention_float32_accuracy(kind, heads, kv_heads, dim, t, start, window, sinks):
    """The decode kernel (a few query rows per kv head, K/V rows read in place) within 1e-5 of the largest output
    of the float64 reference, across group sizes, head dims, runs of keys, windows and sinks."""
    from freetoken.cpu_kernels.paged_decode import handles, splits_for

    assert handles(kind, dim, t * heads // kv_heads)
    rng = np.random.default_rng(11)
    (kp, vp), (ks, vs), table = _sequence(rng, kind, start + t, kv_heads, dim, 64)
    q = (2.0 * rng.standard_normal((t, heads, dim))).astype(np.float32)
    sk = rng.uniform(-1, 3, heads).astype(np.float32) if sinks else None
    got = ops.paged_attention(q, kp, vp, ks, vs, table, start, window=window, sinks=sk, device=CPU)
    want = paged_attention_reference(q, kp, vp, ks, vs, table, start, window=window, sinks=sk)
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()
    if start == 2000:
        assert splits_for(t, 64, start, window) == 4


@pytest.mark.parametrize("t, start", [(1, 300), (20, 0)])  # the decode kernel and the prompt kernel
@pytest.mark.parametrize("poison", [np.nan, np.inf])
def test_non_finite_query_gives_nan_not_an_exception(t, start, poison):
    """A non-finite query (what corrupt weights give) turns its head's outputs into NaN, as NumPy and the CUDA
    kernels do; the other heads are untouched. The kernels divide by the softmax sum, which such a row leaves at 0 or
    NaN: under Numba's default error model that raised ZeroDivisionError in the middle of a forward pass."""
    rng = np.random.default_rng(3)
    (kp, vp), _, table = _sequence(rng, "bf16", start + t, 2, 64, 64)
    q = rng.standard_normal((t, 8, 64)).astype(np.float32)
    q[:, 5, 7] = poison
    got = ops.paged_attention(q, kp, vp, None, None, table, start, device=CPU).reshape(t, 8, 64)
    want = paged_attention_reference(q, kp, vp, None, None, table, start).reshape(t, 8, 64)
    assert np.isnan(got[:, 5]).all() and np.isnan(want[:, 5]).all()
    keep = [h for h in range(8) if h != 5]
    assert np.abs(got[:, keep] - want[:, keep]).max() <= 1e-5 * np.abs(want[:, keep]).max()


def test_decode_attention_does_not_depend_on_thread_count():
    """The runs of keys come from the context, not the threads: 1 and 2 threads give bit-identical outputs."""
    import numba

    rng = np.random.default_rng(5)
    (kp, vp), _, table = _sequence(rng, "bf16", 1500, 2, 64, 64)
    q = rng.standard_normal((1, 8, 64)).astype(np.float32)
    threads = numba.get_num_threads()
    out = []
    try:
        for n in (1, min(2, numba.config.NUMBA_NUM_THREADS)):
            numba.set_num_threads(n)
            out.append(ops.paged_attention(q, kp, vp, None, None, table, 1499, device=CPU))
    finally:
        numba.set_num_threads(threads)
    np.testing.assert_array_equal(out[0], out[1])


def test_cpu_store_encodes_as_the_reference():
    """The Numba append (f32, bf16 pools) writes the bytes the reference encoder gives, awkward values included,
    into the blocks the table names."""
    f32 = np.float32
    special = np.array([0.0, -0.0, np.inf, -np.inf, 3.4e38, -3.4e38, 1e-40, -1e-45, 65504.0], f32)
    ties = np.array([0x3F808000, 0x3F818000, 0x7F7F8000, 0x00008000, 0x80018000], np.uint32).view(f32)
    rng = np.random.default_rng(9)
    for kind in ("f32", "bf16"):
        k = rng.standard_normal((5, 2, 16)).astype(f32) * f32(100)
        k[0, 0, :9], k[0, 1, :5] = special, ties
        k[4, 1, 3] = np.nan
        v = -k[::-1].copy()
        table = np.array([3, 0, 2, 1], np.int32)
        pools = [np.zeros((4, 4, 2, 16), KV_DTYPES[kind]) for _ in range(2)]
        ops.kv_store(k, v, pools[0], pools[1], None, None, table, 6, device=CPU)
        for pool, x in zip(pools, (k, v), strict=True):
            want, _ = kv_encode_reference(x, kind)
            got = np.stack([pool[table[p // 4], p % 4] for p in range(6, 11)])
            nan = np.isnan(x)
            assert np.isnan(got.view(ml_dtypes.bfloat16).astype(f32) if kind == "bf16" else got)[nan].all()
            np.testing.assert_array_equal(got[~nan], want[~nan], err_msg=kind)
        assert not pools[0][table[0]].any() and not pools[0][table[1], :2].any()  # positions 0-5 untouched


def test_result_does_not_depend_on_block_placement():
    """The same sequence in blocks 0, 1, 2, ... and in shuffled blocks gives bit-identical outputs."""
    out = []
    for shuffle in (False, True):
        rng = np.random.default_rng(3)
        (kp, vp), (ks, vs), table = _sequence(rng, "bf16", 150, 2, 64, 16, shuffle=shuffle)
        q = np.random.default_rng(4).standard_normal((20, 8, 64)).astype(np.float32)
        out.append(ops.paged_attention(q, kp, vp, ks, vs, table, 130, device=CPU))
    np.testing.assert_array_equal(out[0], out[1])


def test_bf16_and_f16_encodings_on_awkward_values():
    """Ties (round to even), the largest values (overflow to inf), subnormals, signed zeros, inf and NaN encode as
    ml_dtypes / NumPy round them (the reference), and NaN stays NaN."""
    f32 = np.float32
    ties = (np.array([0x3F808000, 0x3F818000, 0x7F7F8000, 0x00008000, 0x80018000], np.uint32)).view(f32)
    special = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 3.4e38, -3.4e38, 1e-40, -1e-45, 65504.0, 65520.0,
                        6e-8, 2.9e-8], f32)
    rand = np.random.default_rng(1).standard_normal(4096).astype(f32) * f32(1e3)
    x = np.concatenate([ties, special, rand])[None]
    for kind in ("bf16", "f16"):
        got, _ = kv_encode(x, kind)
        want, _ = kv_encode_reference(x, kind)
        gv = got.view(ml_dtypes.bfloat16) if kind == "bf16" else got
        wv = want.view(ml_dtypes.bfloat16) if kind == "bf16" else want
        assert np.array_equal(np.isnan(gv.astype(f32)), np.isnan(wv.astype(f32)))
        ok = ~np.isnan(wv.astype(f32))
        np.testing.assert_array_equal(got[ok], want[ok], err_msg=kind)


def test_fp8_rows_scale_and_saturate():
    """fp8 rows: scale amax / 448 (1 for an all-zero row), codes as the reference rounds them."""
    x = np.random.default_rng(2).standard_normal((5, 3, 32)).astype(np.float32) * np.float32(50)
    x[1, 2] = 0.0
    x[3, 0, 7] = 1e30
    got, gs = kv_encode(x, "fp8")
    want, ws = kv_encode_reference(x, "fp8")
    np.testing.assert_array_equal(gs, ws)
    np.testing.assert_array_equal(got, want)
    assert gs[1, 2] == 1.0


def _args(kind="bf16", nblocks=4, bs=16, kv_heads=2, dim=32):
    pools = [np.zeros((nblocks, bs, kv_heads, dim), KV_DTYPES[kind]) for _ in range(2)]
    scales = [np.ones((nblocks, bs, kv_heads), np.float32) for _ in range(2)] if kind == "fp8" else [None, None]
    return pools, scales, np.arange(nblocks, dtype=np.int32)


@pytest.mark.parametrize("change, match", [
    (dict(q=np.zeros((2, 4, 16), np.float32)), "head dim of q"),
    (dict(q=np.zeros((2, 3, 32), np.float32)), "multiple of kv heads"),
    (dict(q=np.zeros((2, 4, 32), np.float64)), "q must be float32"),
    (dict(start=63), "too short"),
    (dict(start=-1), "must be >= 0"),
    (dict(table=np.array([0, 9, 1, 2], np.int32), start=20), "outside the pool"),
    (dict(window=-3), "window=-3"),
    (dict(sinks=np.zeros(3, np.float32)), "one logit per query head"),
    (dict(k_scale=np.ones((4, 16, 2), np.float32)), "has no scales"),
    (dict(k_pool=np.zeros((4, 16, 2, 32), np.int32)), "KV pool stores"),
])
def test_attention_errors_name_the_argument(change, match):
    (kp, vp), (ks, vs), table = _args()
    a = dict(q=np.zeros((2, 4, 32), np.float32), k_pool=kp, v_pool=vp, k_scale=ks, v_scale=vs, table=table,
             start=0, window=0, sinks=None)
    a.update(change)
    if "k_pool" in change:
        a["v_pool"] = a["k_pool"]
    with pytest.raises((ValueError, TypeError), match=match):
        ops.paged_attention(a["q"], a["k_pool"], a["v_pool"], a["k_scale"], a["v_scale"], a["table"], a["start"],
                            window=a["window"], sinks=a["sinks"], device=CPU)


def test_store_errors_name_the_argument():
    (kp, vp), (ks, vs), table = _args("fp8")
    k = np.zeros((3, 2, 32), np.float32)
    with pytest.raises(ValueError, match="needs k_scale"):
        ops.kv_store(k, k, kp, vp, None, vs, table, 0, device=CPU)
    with pytest.raises(ValueError, match="differ from the pool"):
        ops.kv_store(np.zeros((3, 1, 32), np.float32), np.zeros((3, 1, 32), np.float32), kp, vp, ks, vs, table, 0,
                     device=CPU)
    with pytest.raises(ValueError, match="v_pool"):
        ops.kv_store(k, k, kp, vp[:2], ks, vs, table, 0, device=CPU)


@pytest.mark.parametrize("heads, kv_heads, dim, start, window", [(4, 2, 48, 40, 0), (16, 4, 64, 700, 0),
                                                                  (3, 1, 48, 150, 33)])
def test_decode_serial_copy_matches_the_parallel_kernel(heads, kv_heads, dim, start, window):
    """A short context runs the decode kernel's serial copy (:data:`~freetoken.cpu_kernels.paged_decode.SERIAL_MACS`):
    the same loops, so the same bits as the parallel kernel, and ops.paged_attention picks it by size."""
    from freetoken.cpu_kernels import paged_decode

    rng = np.random.default_rng(9)
    (kp, vp), _, table = _sequence(rng, "bf16", start + 1, kv_heads, dim, 64)
    q = rng.standard_normal((1, heads, dim)).astype(np.float32)
    nsplit = paged_decode.splits_for(1, 64, start, window)
    outs = []
    for kernel in (paged_decode.paged_decode_rows, paged_decode.paged_decode_rows_serial):
        out = np.empty((1, heads * dim), np.float32)
        kernel(q, kp, vp, table, start, window, None, np.float32(1 / np.sqrt(dim)), nsplit, out)
        outs.append(out)
    np.testing.assert_array_equal(outs[0], outs[1])
    np.testing.assert_array_equal(ops.paged_attention(q, kp, vp, None, None, table, start, window=window,
                                                      device=CPU), outs[0])
    keys = min(start + 1, window) if window else start + 1
    small = keys * heads * dim < paged_decode.SERIAL_MACS
    assert (paged_decode.decode_kernel(keys, heads, dim) is paged_decode.paged_decode_rows_serial) == small
