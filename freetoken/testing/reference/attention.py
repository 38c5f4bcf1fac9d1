"""NumPy float64 reference of causal grouped-query attention (the semantics of ``ops.attention`` and
``ops.attention_decode``)."""

from __future__ import annotations

import numpy as np


def attention_reference(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, start: int) -> np.ndarray:
    """q [T, H, D]; k_cache, v_cache [>= start + T, Hkv, D] -> [T, H * D] float64.

    Query t (position start + t) attends to cache rows 0..start+t; query head h uses kv head h // (H // Hkv);
    scores are scaled by 1 / sqrt(D).
    """
    t, heads, dim = q.shape
    kv_heads = k_cache.shape[1]
    total = start + t
    k = np.asarray(k_cache[:total], np.float64).repeat(heads // kv_heads, axis=1)  # [total, H, D]
    v = np.asarray(v_cache[:total], np.float64).repeat(heads // kv_heads, axis=1)
    scores = np.einsum("thd,nhd->htn", np.asarray(q, np.float64), k) / np.sqrt(dim)  # [H, T, total]
    mask = np.arange(total)[None, :] > (start + np.arange(t))[:, None]
    scores = np.where(mask[None], -np.inf, scores)
    scores -= scores.max(axis=-1, keepdims=True)
    p = np.exp(scores)
    p /= p.sum(axis=-1, keepdims=True)
    return np.einsum("htn,nhd->thd", p, v).reshape(t, heads * dim)
