"""DeepSeek-V3's multi-head latent attention over the paged KV cache, absorbed form: :func:`latent_store` appends
latent rows ``[c_kv, k_pe]``, :func:`latent_attention` runs causal attention of every query head over them
(``cuda/latent_attention.cu`` on gpu/emu through :mod:`freetoken.ops.latent_attention_cuda`,
``cpu_kernels/latent_attention.py`` on the cpu device).

The layout, the storage kinds and the arithmetic are the contract of
``freetoken/testing/reference/latent_attention.py``: the pool of :mod:`freetoken.ops.paged_attention` with one kv
head and rows of R + P values, ``[num_blocks, block_size, 1, R + P]`` (float32, float16, bf16 bits as uint16 or fp8
e4m3 codes as uint8 with one float32 scale per row), addressed through an int32 block table.
"""

from __future__ import annotations

import numpy as np

from freetoken.device.constants import LATENT_MAX_DIM
from freetoken.ops._common import as_input, cpu_module, prepare_out, resolve
from freetoken.ops.paged_attention import _NO_TABLE, _whole, decode_table, kv_encode, kv_kind_of


def _check(dev, pool, pool_scale, block_table, start, t_count, max_width=None):
    """Validate the pool (rows of at most ``max_width`` values when given), its scales, the block table and start;
    returns (pool, pool_scale, table, start)."""
    pool = dev.as_array(pool)
    if pool.ndim != 4 or pool.shape[2] != 1:
        raise ValueError(f"pool must be [num_blocks, block_size, 1, R + P], got shape {tuple(pool.shape)}")
    if not pool.flags.c_contiguous:
        raise ValueError("pool must be C-contiguous (it is written in place)")
    kind = kv_kind_of(pool)
    nb_, bs, _, width = pool.shape
    if width < 1 or bs < 1:
        raise ValueError(f"pool must have rows of at least 1 value in blocks of at least 1 row, got shape "
                         f"{tuple(pool.shape)}")
    if max_width is not None and width > max_width:
        raise ValueError(f"pool rows of {width} values unsupported: R + P must be in [1, {max_width}]")
    if kind == "fp8":
        if pool_scale is None:
            raise ValueError("an fp8 pool needs pool_scale [num_blocks, block_size, 1] float32")
        pool_scale = dev.as_array(pool_scale)
        if (tuple(pool_scale.shape) != (nb_, bs, 1) or pool_scale.dtype != np.float32
                or not pool_scale.flags.c_contiguous):
            raise ValueError(f"pool_scale must be C-contiguous float32 {(nb_, bs, 1)}, got {pool_scale.dtype} "
                             f"{tuple(pool_scale.shape)}")
    elif pool_scale is not None:
        raise ValueError(f"a {kind} pool has no scales: pass pool_scale=None")
    table = as_input(dev, block_table, "block_table", np.int32, 1)
    start = _whole("start", start)
    need = -(-(start + t_count) // bs)
    if table.shape[0] < need:
        raise ValueError(f"block_table of {table.shape[0]} blocks is too short for positions up to "
                         f"{start + t_count - 1} (block size {bs}: {need} blocks)")
    if need:
        used = np.asarray(dev.to_host(table[:need]))
        if used.min() < 0 or used.max() >= nb_:
            raise ValueError(f"block_table[:{need}] holds blocks outside the pool's 0 .. {nb_ - 1}")
    return pool, pool_scale, table, start


def check_latent_query(dev, q, pool, rank, scale, out):
    """The queries' rows against the pool's, the latent ``rank``, ``scale`` and ``out`` (checked or allocated);
    returns (rank, out)."""
    if q.shape[2] != pool.shape[3]:
        raise ValueError(f"q rows of {q.shape[2]} values (R + P) differ from the pool's {pool.shape[3]}")
    if q.shape[1] == 0:
        raise ValueError("q must have at least one head")
    rank = _whole("rank", rank)
    if not 1 <= rank <= q.shape[2]:
        raise ValueError(f"rank={rank} must be in [1, {q.shape[2]}] (R of rows of R + P = {q.shape[2]} values)")
    if not np.isfinite(scale):
        raise ValueError(f"scale={scale} must be finite")
    return rank, prepare_out(dev, out, (q.shape[0], q.shape[1] * rank), np.float32)


def latent_store(kv, pool, pool_scale, block_table, start, *, device=None, checked: bool = False):
    """Append latent rows at positions ``start .. start + T - 1`` of a sequence's paged cache (in place).

    Parameters
    ----------
    kv : float32 array [T, R + P]: per token ``[c_kv, k_pe]`` (any R + P; attention takes up to 1024)
    pool : [num_blocks, block_size, 1, R + P] array of the KV kind's dtype (float32, float16, uint16 = bf16 bits,
        uint8 = fp8 e4m3 codes), written in place
    pool_scale : float32 [num_blocks, block_size, 1] (fp8: written with the rows), else None
    block_table : int32 [n]: position p lives in block ``block_table[p // block_size]``, row ``p % block_size``
    start : int >= 0
    device : Device or name, optional
    checked : the caller vouches for the arguments
    """
    dev = resolve(device) if not checked else device
    if not checked:
        kv = as_input(dev, kv, "kv", np.float32, 2)
        pool, pool_scale, block_table, start = _check(dev, pool, pool_scale, block_table, start, kv.shape[0])
        if kv.shape[1] != pool.shape[3]:
            raise ValueError(f"kv rows of {kv.shape[1]} values differ from the pool's {pool.shape[3]}")
    t = kv.shape[0]
    if t == 0:
        return None
    if dev.kind != "cpu":
        from freetoken.ops.latent_attention_cuda import latent_store_cuda

        latent_store_cuda(dev, kv, pool, pool_scale, block_table, start)
        return None
    bs = pool.shape[1]
    pos = start + np.arange(t)
    blocks, rows = block_table[pos // bs], pos % bs
    stored, sc = kv_encode(kv, kv_kind_of(pool))
    pool[blocks, rows, 0] = stored
    if sc is not None:
        pool_scale[blocks, rows, 0] = sc
    return None


def latent_attention(q, pool, pool_scale, block_table, start, rank, *, scale: float, out=None, device=None,
                     checked: bool = False):
    """Causal multi-head latent attention of T queries at positions ``start .. start + T - 1`` over a sequence's
    cached latent rows (:func:`latent_store`; the queries' own rows included).

    Query t sees the positions p <= start + t; the score of head h is ``scale * q[t, h] . row_p`` over all R + P
    values and its output the softmax-weighted sum of ``row_p[:R]`` (the latent: the caller applies W_UV).

    Parameters
    ----------
    q : float32 array [T, H, R + P], R + P <= 1024: per head the absorbed no-rope query (R values) and the roped
        query (P values)
    pool, pool_scale, block_table, start : as for :func:`latent_store`
    rank : R, the latent rank: 1 <= R <= R + P
    scale : the softmax scale (finite)
    out : float32 array [T, H * R], optional
    device : Device or name, optional
    checked : the caller vouches for the arguments

    Returns
    -------
    float32 array [T, H * R] on the device.
    """
    if checked:
        dev = device
    else:
        dev = resolve(device)
        q = as_input(dev, q, "q", np.float32, 3)
        pool, pool_scale, block_table, start = _check(dev, pool, pool_scale, block_table, start, q.shape[0],
                                                      LATENT_MAX_DIM)
        rank, out = check_latent_query(dev, q, pool, rank, scale, out)
    t_count, heads, _ = q.shape
    if out is None:
        out = dev.empty((t_count, heads * rank), np.float32)
    if t_count == 0:
        return out
    if dev.kind != "cpu":
        from freetoken.ops.latent_attention_cuda import latent_attention_cuda

        latent_attention_cuda(dev, q, pool, pool_scale, block_table, start, rank, float(scale), out)
        return out
    latent_attention_rows = cpu_module("latent_attention").latent_attention_rows

    kind = kv_kind_of(pool)
    if kind == "f16":  # the kernel widens IEEE half bits from int16 (Numba has no float16 arithmetic)
        pool = pool.view(np.int16)
    table = decode_table("fp8") if kind == "fp8" else _NO_TABLE
    latent_attention_rows(q, pool, pool_scale, table, block_table, start, rank, np.float32(scale), out)
    return out
