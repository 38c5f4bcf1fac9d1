"""NumPy reference of the paged KV cache: storage encodings, the append, and causal grouped-query attention over it
(the contract of ``ops.kv_store`` and ``ops.paged_attention``).

Layout (one layer's view of the pool; the pool owns ``[layers, blocks, ...]`` and hands each layer its slice):

- ``k_pool``, ``v_pool``: ``[num_blocks, block_size, Hkv, D]`` in the storage dtype of the KV kind:

  ======  ===============  ===================================================================================
  kind    array dtype      value of a stored element
  ======  ===============  ===================================================================================
  f32     float32          itself
  f16     float16          itself (IEEE half, round to nearest even; overflow is inf)
  bf16    uint16           the top half of a float32 (round to nearest even; NaN stays NaN)
  fp8     uint8            e4m3fn code times the row scale ``k_scale[block, row, kv_head]`` (float32)
  ======  ===============  ===================================================================================

  fp8 keeps one float32 scale per (token, kv head) = amax of that head's D values / 448 (1.0 when the amax is 0),
  so appending a token never rescales the tokens already stored (a per-block scale would), at 4 bytes per D
  bytes (3% at D = 128). Codes round to nearest even and saturate at +-448.
- ``block_table``: int32 ``[n]``: logical position ``p`` of the sequence lives in pool block
  ``block_table[p // block_size]``, row ``p % block_size``. Blocks need not be in order; entries past the last
  used block are not read.

Attention: query ``t`` sits at position ``start + t`` and attends to the positions ``p`` with
``p <= start + t`` and, with a window ``W > 0``, ``start + t - p < W`` (the sliding window of Mistral / gpt-oss /
transformers' ``sliding_window``: the query and the W - 1 positions before it). Query head ``h`` reads kv head
``h // (H // Hkv)``. Scores are ``scale * q.k`` (``scale`` default ``1 / sqrt(D)``). With ``sinks`` (float32
``[H]``, gpt-oss' learned per-head logit) the softmax denominator gains ``exp(sinks[h])`` (in the same shifted
frame as the scores); the sink carries no value. All of it in float64 here.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

#: Largest finite e4m3fn magnitude.
E4M3_MAX = 448.0

#: KV kind -> storage dtype of the pool arrays.
KV_DTYPES: dict[str, type] = {"f32": np.float32, "f16": np.float16, "bf16": np.uint16, "fp8": np.uint8}


def kv_kind(pool: np.ndarray) -> str:
    """The KV kind of a pool array, from its dtype."""
    for kind, dt in KV_DTYPES.items():
        if pool.dtype == dt:
            return kind
    raise ValueError(f"no KV kind stores {pool.dtype}")


def kv_encode_reference(x: np.ndarray, kind: str) -> tuple[np.ndarray, np.ndarray | None]:
    """float32 ``[..., D]`` -> (stored ``[..., D]`` in the kind's dtype, float32 scales ``[...]`` for fp8 else None)."""
    x = np.asarray(x, np.float32)
    if kind == "f32":
        return x.copy(), None
    if kind == "f16":
        with np.errstate(over="ignore"):
            return x.astype(np.float16), None
    if kind == "bf16":
        return x.astype(ml_dtypes.bfloat16).view(np.uint16), None
    if kind == "fp8":
        amax = np.max(np.abs(x), axis=-1)
        scale = np.where(amax > 0, amax / np.float32(E4M3_MAX), np.float32(1.0)).astype(np.float32)
        q = np.clip(x / scale[..., None], -E4M3_MAX, E4M3_MAX)  # saturate: ml_dtypes makes overflow NaN
        return q.astype(ml_dtypes.float8_e4m3fn).view(np.uint8), scale
    raise ValueError(f"unknown KV kind {kind!r}")


def kv_decode_reference(stored: np.ndarray, scale: np.ndarray | None = None) -> np.ndarray:
    """Stored values (any KV kind, by dtype) -> float32; ``scale`` is required for fp8."""
    kind = kv_kind(stored)
    if kind == "f32":
        return stored.astype(np.float32)
    if kind == "f16":
        return stored.astype(np.float32)
    if kind == "bf16":
        return (stored.astype(np.uint32) << np.uint32(16)).view(np.float32)
    if scale is None:
        raise ValueError("fp8 KV needs its scales")
    return stored.view(ml_dtypes.float8_e4m3fn).astype(np.float32) * np.asarray(scale, np.float32)[..., None]


def kv_store_reference(k, v, k_pool, v_pool, k_scale, v_scale, block_table, start: int):
    """Append ``k``, ``v`` ``[T, Hkv, D]`` at positions ``start ..``: returns new (k_pool, v_pool, k_scale,
    v_scale) with exactly those rows written (the inputs are not modified; scales None unless fp8)."""
    k_pool, v_pool = k_pool.copy(), v_pool.copy()
    k_scale = None if k_scale is None else k_scale.copy()
    v_scale = None if v_scale is None else v_scale.copy()
    kind = kv_kind(k_pool)
    bs = k_pool.shape[1]
    for pool, scales, x in ((k_pool, k_scale, k), (v_pool, v_scale, v)):
        enc, sc = kv_encode_reference(x, kind)
        for t in range(x.shape[0]):
            p = start + t
            b, r = int(block_table[p // bs]), p % bs
            pool[b, r] = enc[t]
            if sc is not None:
                scales[b, r] = sc[t]
    return k_pool, v_pool, k_scale, v_scale


def gather_reference(pool, scales, block_table, length: int) -> np.ndarray:
    """Positions ``0 .. length - 1`` of one pool as float32 ``[length, Hkv, D]``."""
    bs = pool.shape[1]
    pos = np.arange(length)
    blocks = np.asarray(block_table, np.int64)[pos // bs]
    rows = pos % bs
    stored = pool[blocks, rows]
    return kv_decode_reference(stored, None if scales is None else scales[blocks, rows])


def paged_attention_reference(q, k_pool, v_pool, k_scale, v_scale, block_table, start: int, *, window: int = 0,
                              sinks=None, scale: float | None = None) -> np.ndarray:
    """q ``[T, H, D]`` at positions ``start ..`` against the pool -> ``[T, H * D]`` float64 (see the module doc)."""
    t_count, heads, dim = q.shape
    total = start + t_count
    k = gather_reference(k_pool, k_scale, block_table, total).astype(np.float64)
    v = gather_reference(v_pool, v_scale, block_table, total).astype(np.float64)
    group = heads // k.shape[1]
    k, v = k.repeat(group, axis=1), v.repeat(group, axis=1)  # [total, H, D]
    sc = 1.0 / np.sqrt(dim) if scale is None else float(scale)
    with np.errstate(invalid="ignore", over="ignore"):
        s = np.einsum("thd,nhd->htn", np.asarray(q, np.float64), k) * sc  # [H, T, total]
    qpos = start + np.arange(t_count)[:, None]
    kpos = np.arange(total)[None, :]
    visible = kpos <= qpos
    if window > 0:
        visible &= qpos - kpos < window
    s = np.where(visible[None], s, -np.inf)
    m = s.max(axis=-1, keepdims=True)
    if sinks is not None:
        m = np.maximum(m, np.asarray(sinks, np.float64)[:, None, None])
    p = np.exp(s - m)
    denom = p.sum(axis=-1, keepdims=True)
    if sinks is not None:
        denom = denom + np.exp(np.asarray(sinks, np.float64)[:, None, None] - m)
    p /= denom
    return np.einsum("htn,nhd->thd", p, v).reshape(t_count, heads * dim)


def kv_store_batch_reference(k, v, k_pool, v_pool, k_scale, v_scale, tables, starts, counts):
    """:func:`kv_store_reference` for several sequences: rows ``bounds[s] .. bounds[s + 1] - 1`` of ``k``, ``v``
    (``bounds`` the running sums of ``counts``) at positions ``starts[s] ..`` through block table ``tables[s]``."""
    bounds = np.concatenate([[0], np.cumsum(counts)]).astype(int)
    for s, start in enumerate(starts):
        lo, hi = bounds[s], bounds[s + 1]
        k_pool, v_pool, k_scale, v_scale = kv_store_reference(k[lo:hi], v[lo:hi], k_pool, v_pool, k_scale, v_scale,
                                                              tables[s], int(start))
    return k_pool, v_pool, k_scale, v_scale


def paged_attention_batch_reference(q, k_pool, v_pool, k_scale, v_scale, tables, starts, counts, *, window: int = 0,
                                    sinks=None, scale: float | None = None) -> np.ndarray:
    """:func:`paged_attention_reference` of each sequence's rows of ``q`` (laid out as for
    :func:`kv_store_batch_reference`), stacked: ``[T, H * D]`` float64."""
    bounds = np.concatenate([[0], np.cumsum(counts)]).astype(int)
    return np.concatenate([
        paged_attention_reference(q[bounds[s]:bounds[s + 1]], k_pool, v_pool, k_scale, v_scale, tables[s], int(start),
                                  window=window, sinks=sinks, scale=scale)
        for s, start in enumerate(starts)])
