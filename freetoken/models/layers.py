"""Transformer building blocks on a device's array module (``xp``: numpy or cupy), in float32."""

from __future__ import annotations

import numpy as np


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


def rope_frequencies(head_dim: int, theta: float, scaling: dict | None = None,
                     max_position: int = 32768) -> tuple[np.ndarray, float]:
    """(inverse frequencies float64 [head_dim / 2], attention factor applied to cos and sin) of a RoPE variant.

    ``scaling``: None / ``{"rope_type": "default"}``, ``linear`` (positions divided by ``factor``), ``yarn``
    (NTK-by-parts: low frequencies interpolated by ``factor``, high ones kept, a linear ramp between the
    ``beta_fast`` / ``beta_slow`` rotation counts over ``original_max_position_embeddings``; cos/sin scaled by
    ``attention_factor``, default 0.1 ln(factor) + 1) or ``llama3`` (wavelength bands). HF transformers'
    definitions, checked against its rotary embeddings in tests/test_rope.py."""
    half = np.arange(0, head_dim, 2, dtype=np.float64) / head_dim
    inv = 1.0 / theta**half
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind == "default":
        return inv, 1.0
    factor = float(scaling["factor"])
    if kind == "linear":
        return inv / factor, 1.0
    original = float(scaling.get("original_max_position_embeddings") or max_position)
    if kind == "yarn":
        attn = scaling.get("attention_factor")
        if attn is None:
            def mscale(scale, m=1.0):
                return 1.0 if scale <= 1 else 0.1 * m * np.log(scale) + 1.0

            ms, ms_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
            attn = mscale(factor, ms) / mscale(factor, ms_all) if ms and ms_all else mscale(factor)
        beta_fast = float(scaling.get("beta_fast") or 32)
        beta_slow = float(scaling.get("beta_slow") or 1)

        def correction_dim(rotations):
            return head_dim * np.log(original / (rotations * 2 * np.pi)) / (2 * np.log(theta))

        low, high = correction_dim(beta_fast), correction_dim(beta_slow)
        if scaling.get("truncate", True):
            low, high = np.floor(low), np.ceil(high)
        low, high = max(low, 0), min(high, head_dim - 1)
        if low == high:
            high += 0.001
        ramp = np.clip((np.arange(head_dim // 2, dtype=np.float64) - low) / (high - low), 0, 1)
        extrapolate = 1 - ramp  # 1: keep the frequency, 0: interpolate it by ``factor``
        return inv / factor * (1 - extrapolate) + inv * extrapolate, float(attn)
    if kind == "llama3":
        low_wl = original / float(scaling["low_freq_factor"])
        high_wl = original / float(scaling["high_freq_factor"])
        wavelen = 2 * np.pi / inv
        out = np.where(wavelen > low_wl, inv / factor, inv)
        smooth = (original / wavelen - scaling["low_freq_factor"]) / (scaling["high_freq_factor"]
                                                                     - scaling["low_freq_factor"])
        mid = (wavelen <= low_wl) & (wavelen >= high_wl)
        return np.where(mid, (1 - smooth) * out / factor + smooth * out, out), 1.0
    raise ValueError(f"rope scaling {kind!r} is not supported (supported: default, linear, yarn, llama3)")


def rope_tables(xp, positions, head_dim: int, theta: float, scaling: dict | None = None, max_position: int = 32768):
    """cos/sin [T, head_dim] (frequencies repeated over both halves, HF convention) of a RoPE variant
    (:func:`rope_frequencies`)."""
    inv_freq, attn = rope_frequencies(head_dim, theta, scaling, max_position)
    ang = np.asarray(positions, np.float64)[:, None] * inv_freq[None, :]
    ang = np.concatenate([ang, ang], axis=-1)
    return xp.asarray((np.cos(ang) * attn).astype(np.float32)), xp.asarray((np.sin(ang) * attn).astype(np.float32))


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
    from freetoken.ops.attention import attention_arrays

    return attention_arrays(xp, q, k_cache, v_cache, start)
