"""NumPy reference of DeepSeek-V3's multi-head latent attention (MLA) over the paged KV cache, in its absorbed form
(the contract of ``ops.latent_store`` and ``ops.latent_attention``).

Layout: the paged KV pool of ``freetoken/testing/reference/paged_attention.py`` with one kv head and rows of
``R + P`` values:

- ``pool``: ``[num_blocks, block_size, 1, R + P]`` in a KV kind's storage dtype (float32, float16, uint16 = bf16
  bits, uint8 = fp8 e4m3 codes); fp8 rows carry ``pool_scale [num_blocks, block_size, 1]`` float32, one scale per
  row = amax of its R + P values / 448 (1.0 for an all-zero row), exactly as ``kv_store`` encodes a row;
- ``block_table``: int32 ``[n]``: position ``p`` lives in pool block ``block_table[p // block_size]``, row
  ``p % block_size``.

Each cached row is ``[c_kv (R values), k_pe (P values)]``: the normed compressed latent of one token and its roped
rope key, which every query head shares (MLA caches one latent per token instead of per-head keys and values).

``latent_store(kv, ...)`` writes the float32 rows ``kv [T, R + P]`` at positions ``start .. start + T - 1`` in the
pool's encoding (the same encodings as ``kv_store``; any R + P).

``latent_attention(q, ..., rank=R, scale=s)``: ``q`` float32 ``[T, H, R + P]``; per head the first R values are the
absorbed no-rope query (``W_UK_h^T q_nope_h``: already in latent space), the last P the roped query (P = 0 allowed).
Query ``t`` sits at position ``start + t`` and sees the positions ``p <= start + t`` (causal; no window, no sinks).

- ``score(t, h, p) = s * dot(q[t, h, :], row_p)`` over all R + P values (``s`` from the caller: DeepSeek's softmax
  scale, YaRN's mscale included);
- ``out[t, h * R : (h + 1) * R] = sum_p softmax_p(score) * row_p[:R]``: the values are the latent part of the same
  rows (the caller applies ``W_UV_h`` afterwards), the output float32 ``[T, H * R]``.

The reference computes in float64 on the stored (decoded) rows; the kernels use float32 softmax and sums (the CUDA
kernel multiplies bf16 Q, rows and probabilities on the tensor cores). Limits of the ops: attention
``1 <= R <= R + P <= 1024`` and ``H >= 1``; the append any ``R + P``.
"""

from __future__ import annotations

import numpy as np

from freetoken.testing.reference.paged_attention import gather_reference, kv_encode_reference, kv_kind

#: Token rows per float64 step of the reference (bounds its [rows, H, context] scores).
_CHUNK_ELEMENTS = 1 << 24


def latent_store_reference(kv, pool, pool_scale, block_table, start: int):
    """Append the rows ``kv [T, R + P]`` at positions ``start ..``: returns new (pool, pool_scale) with exactly those
    rows written (the inputs are not modified; ``pool_scale`` None unless fp8)."""
    pool = pool.copy()
    pool_scale = None if pool_scale is None else pool_scale.copy()
    enc, sc = kv_encode_reference(np.asarray(kv, np.float32), kv_kind(pool))
    bs = pool.shape[1]
    for t in range(enc.shape[0]):
        p = start + t
        b, r = int(block_table[p // bs]), p % bs
        pool[b, r, 0] = enc[t]
        if sc is not None:
            pool_scale[b, r, 0] = sc[t]
    return pool, pool_scale


def latent_rows_reference(pool, pool_scale, block_table, length: int) -> np.ndarray:
    """Positions ``0 .. length - 1`` of the cache as float32 ``[length, R + P]``."""
    return gather_reference(pool, pool_scale, block_table, length)[:, 0]


def latent_attention_reference(q, pool, pool_scale, block_table, start: int, rank: int, *,
                               scale: float) -> np.ndarray:
    """q ``[T, H, R + P]`` at positions ``start ..`` against the cached latent rows -> ``[T, H * R]`` float64 (see
    the module doc)."""
    q = np.asarray(q, np.float64)
    t_count, heads, width = q.shape
    total = start + t_count
    rows = latent_rows_reference(pool, pool_scale, block_table, total).astype(np.float64)  # [total, R + P]
    out = np.empty((t_count, heads, rank), np.float64)
    step = max(1, _CHUNK_ELEMENTS // max(1, heads * total))
    kpos = np.arange(total)[None, None, :]
    for t0 in range(0, t_count, step):
        t1 = min(t_count, t0 + step)
        with np.errstate(invalid="ignore", over="ignore"):
            s = (q[t0:t1] @ rows.T) * float(scale)  # [t, H, total]
        qpos = start + np.arange(t0, t1)[:, None, None]
        s = np.where(kpos <= qpos, s, -np.inf)
        p = np.exp(s - s.max(axis=-1, keepdims=True))
        p /= p.sum(axis=-1, keepdims=True)
        out[t0:t1] = p @ rows[:, :rank]
    return out.reshape(t_count, heads * rank)


def latent_store_batch_reference(kv, pool, pool_scale, tables, starts, counts):
    """:func:`latent_store_reference` for several sequences: rows ``bounds[s] .. bounds[s + 1] - 1`` of ``kv``
    (``bounds`` the running sums of ``counts``) at positions ``starts[s] ..`` through block table ``tables[s]``."""
    bounds = np.concatenate([[0], np.cumsum(counts)]).astype(int)
    for s, start in enumerate(starts):
        pool, pool_scale = latent_store_reference(kv[bounds[s]:bounds[s + 1]], pool, pool_scale, tables[s],
                                                  int(start))
    return pool, pool_scale


def latent_attention_batch_reference(q, pool, pool_scale, tables, starts, counts, rank: int, *,
                                     scale: float) -> np.ndarray:
    """:func:`latent_attention_reference` of each sequence's rows of ``q`` (laid out as for
    :func:`latent_store_batch_reference`), stacked: ``[T, H * R]`` float64."""
    bounds = np.concatenate([[0], np.cumsum(counts)]).astype(int)
    return np.concatenate([
        latent_attention_reference(q[bounds[s]:bounds[s + 1]], pool, pool_scale, tables[s], int(start), rank,
                                   scale=scale)
        for s, start in enumerate(starts)])
