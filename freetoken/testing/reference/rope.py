"""Reference of ``ops.rope`` (HF convention)."""

import numpy as np


def rope_reference(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """float64 ``x * cos + rotate_half(x) * sin`` for x [T, heads, D], cos/sin [T, D];
    rotate_half(x) = concat(-x2, x1) over the two halves of D."""
    x = np.asarray(x, np.float64)
    half = x.shape[-1] // 2
    rotated = np.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * np.asarray(cos, np.float64)[:, None, :] + rotated * np.asarray(sin, np.float64)[:, None, :]


def rope_qkv_cache_reference(qkv, norm, eps: float, cos, sin, k_cache, v_cache, start: int):
    """float64 (q [T, H, D], the k cache, the v cache after the op) of ``ops.rope_qkv_cache``: q and k heads of ``qkv
    [T, (H + 2 Hkv) D]`` RMS-normed with ``norm [H + Hkv, D]`` (None: not normed) and rotated; k and v rows
    start .. start + T - 1 of the caches replaced."""
    from freetoken.testing.reference.rms_norm import rms_norm_reference

    k_cache, v_cache = np.array(k_cache, np.float64), np.array(v_cache, np.float64)
    t, (kv_heads, d) = qkv.shape[0], k_cache.shape[1:]
    x = np.asarray(qkv, np.float64).reshape(t, -1, d)
    heads = x.shape[1] - 2 * kv_heads
    qk = x[:, :heads + kv_heads]
    if norm is not None:
        qk = rms_norm_reference(qk, norm, eps)
    qk = rope_reference(qk, cos, sin)
    k_cache[start:start + t] = qk[:, heads:]
    v_cache[start:start + t] = x[:, heads + kv_heads:]
    return qk[:, :heads], k_cache, v_cache
