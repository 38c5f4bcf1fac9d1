"""``ops.PagedBatch`` and the batch ops refuse what they cannot run, naming the argument; the parity of the ops
themselves is in the registry's cases (tests/test_kernel_parity.py)."""

import numpy as np
import pytest

from freetoken import ops
from freetoken.device import get_device


def _pools(blocks=6, block_size=4, kv_heads=1, dim=16):
    shape = (blocks, block_size, kv_heads, dim)
    return np.zeros(shape, np.float32), np.zeros(shape, np.float32)


def test_batch_layout_is_checked():
    tables = np.zeros((2, 3), np.int32)
    with pytest.raises(ValueError, match="one of each per sequence"):
        ops.PagedBatch(tables, [0, 1, 2], [1, 1], device="cpu")
    with pytest.raises(ValueError, match="at least one row"):
        ops.PagedBatch(tables, [0, 1], [1, 0], device="cpu")
    with pytest.raises(ValueError, match=r"starts\[1\]"):
        ops.PagedBatch(tables, [0, -1], [1, 1], device="cpu")
    with pytest.raises(TypeError, match="tables must be int32"):
        ops.PagedBatch(tables.astype(np.int64), [0, 1], [1, 1], device="cpu")
    batch = ops.PagedBatch(tables, [5, 2], [1, 3], device="cpu")
    assert batch.bounds == (0, 1, 4) and batch.rows == 4
    np.testing.assert_array_equal(batch.row_table([1]), [[1, 1, 2], [2, 1, 3], [3, 1, 4]])


def test_batch_ops_refuse_mismatches():
    k_pool, v_pool = _pools()
    batch = ops.PagedBatch(np.array([[0, 1, 2], [3, 4, 5]], np.int32), [5, 2], [1, 3], device="cpu")
    q = np.zeros((4, 2, 16), np.float32)
    with pytest.raises(ValueError, match="3 rows given for a batch of 4"):
        ops.paged_attention_batch(q[:3], k_pool, v_pool, None, None, batch, device="cpu")
    with pytest.raises(TypeError, match="batch must be a PagedBatch"):
        ops.paged_attention_batch(q, k_pool, v_pool, None, None, object(), device="cpu")
    with pytest.raises(ValueError, match="the batch was made for the cpu device"):
        ops.kv_store_batch(q[:, :1], q[:, :1], k_pool, v_pool, None, None, batch, device="emu")
    short = ops.PagedBatch(np.array([[0], [3]], np.int32), [5, 2], [1, 3], device="cpu")  # 6 positions need 2 blocks
    with pytest.raises(ValueError, match="block_table of 1 blocks is too short for positions up to 5"):
        ops.paged_attention_batch(q, k_pool, v_pool, None, None, short, device="cpu")
    outside = ops.PagedBatch(np.array([[0, 9], [3, 4]], np.int32), [5, 2], [1, 3], device="cpu")
    with pytest.raises(ValueError, match="outside the pool"):
        ops.kv_store_batch(q[:, :1], q[:, :1], k_pool, v_pool, None, None, outside, device="cpu")


def test_batch_equals_alone_bitwise_on_cpu():
    """The cpu batch call gives each decode step exactly what the single-sequence call gives it (same kernel body,
    same order of sums): bit-equal, not merely close."""
    rng = np.random.default_rng(3)
    dev = get_device("cpu")
    k_pool = rng.standard_normal((40, 16, 2, 32)).astype(np.float32)
    v_pool = rng.standard_normal((40, 16, 2, 32)).astype(np.float32)
    tables = rng.permutation(40).astype(np.int32).reshape(4, 10)
    starts, counts = [150, 3, 80, 40], [1, 1, 2, 1]
    q = rng.standard_normal((5, 4, 32)).astype(np.float32)
    got = ops.paged_attention_batch(q, k_pool, v_pool, None, None, ops.PagedBatch(tables, starts, counts, device=dev),
                                    device=dev)
    at = 0
    for s, (start, n) in enumerate(zip(starts, counts, strict=True)):
        alone = ops.paged_attention(q[at:at + n], k_pool, v_pool, None, None, tables[s], start, device=dev)
        np.testing.assert_array_equal(got[at:at + n], alone)
        at += n


def test_latent_batch_ops_refuse_mismatches():
    pool = np.zeros((6, 4, 1, 24), np.float32)
    batch = ops.PagedBatch(np.array([[0, 1, 2], [3, 4, 5]], np.int32), [5, 2], [1, 3], device="cpu")
    q = np.zeros((4, 2, 24), np.float32)
    with pytest.raises(ValueError, match="3 rows given for a batch of 4"):
        ops.latent_attention_batch(q[:3], pool, None, batch, 16, scale=0.1, device="cpu")
    with pytest.raises(ValueError, match="rank=30 must be in"):
        ops.latent_attention_batch(q, pool, None, batch, 30, scale=0.1, device="cpu")
    with pytest.raises(ValueError, match="kv rows of 20 values differ"):
        ops.latent_store_batch(np.zeros((4, 20), np.float32), pool, None, batch, device="cpu")
    with pytest.raises(ValueError, match="an fp8 pool needs pool_scale"):
        ops.latent_store_batch(np.zeros((4, 24), np.float32), pool.astype(np.uint8), None, batch, device="cpu")
