"""Transformer building blocks on a device's array module (``xp``: numpy or cupy), in float32."""

from __future__ import annotations

import numpy as np

from freetoken.models.rope import rope_frequencies, rope_tables  # noqa: F401  (their old home)


def rms_norm(xp, x, weight, eps: float):
    """``x * rsqrt(mean(x^2) + eps) * weight`` over the last axis (HF LlamaRMSNorm semantics, fp32).

    NumPy float32 arrays whose ``weight`` matches the trailing axes of ``x`` run one Numba call
    (:func:`freetoken.cpu_kernels.gemv.rms_norm_rows`) instead of six array ops."""
    if (xp is np and isinstance(x, np.ndarray) and x.dtype == np.float32 and weight.dtype == np.float32
            and 1 <= weight.ndim <= x.ndim and x.shape[x.ndim - weight.ndim:] == weight.shape and x.size):
        from freetoken.cpu_kernels.gemv import rms_norm_rows

        d = x.shape[-1]
        x2 = np.ascontiguousarray(x).reshape(-1, d)
        out = np.empty(x2.shape, np.float32)
        rms_norm_rows(x2, np.ascontiguousarray(weight).reshape(-1, d), np.float32(eps), out)
        return out.reshape(x.shape)
    var = xp.mean(x * x, axis=-1, keepdims=True)
    return x / xp.sqrt(var + np.float32(eps)) * weight


def apply_rope(xp, x, cos, sin):
    """Rotate x [T, heads, head_dim] by position: ``x * cos + rotate_half(x) * sin``.

    NumPy float32 arrays run one Numba call (:func:`freetoken.cpu_kernels.gemv.rope_rows`, the same arithmetic)."""
    if (xp is np and isinstance(x, np.ndarray) and x.ndim == 3 and x.shape[-1] % 2 == 0 and x.dtype == np.float32
            and cos.dtype == sin.dtype == np.float32 and cos.shape == sin.shape == (x.shape[0], x.shape[2])):
        from freetoken.cpu_kernels.gemv import rope_rows

        out = np.empty(x.shape, np.float32)
        rope_rows(x, cos, sin, out)
        return out
    half = x.shape[-1] // 2
    rotated = xp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def attention(xp, q, k_cache, v_cache, start: int):
    """Causal grouped-query attention of T new queries at positions start..start+T-1.

    q [T, H, D]; k_cache, v_cache [>= start + T, Hkv, D] already holding the new keys/values. Returns [T, H * D].
    """
    t, heads, dim = q.shape
    kv_heads = k_cache.shape[1]
    total = start + t
    k = k_cache[:total]
    v = v_cache[:total]
    group = heads // kv_heads
    qg = q.reshape(t, kv_heads, group, dim).transpose(1, 2, 0, 3)  # [Hkv, G, T, D]
    scores = xp.matmul(qg, k.transpose(1, 2, 0)[:, None]) * np.float32(1.0 / np.sqrt(dim))  # [Hkv, G, T, total]
    mask = np.arange(total)[None, :] > (start + np.arange(t))[:, None]
    scores = xp.where(xp.asarray(mask), np.float32(-np.inf), scores)
    scores = scores - scores.max(axis=-1, keepdims=True)
    p = xp.exp(scores)
    p /= p.sum(axis=-1, keepdims=True)
    out = xp.matmul(p, v.transpose(1, 0, 2)[:, None])  # [Hkv, G, T, D]
    return out.transpose(2, 0, 1, 3).reshape(t, heads * dim)
