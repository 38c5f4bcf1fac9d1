"""Rotary position embeddings: the frequencies of each RoPE variant (HF transformers' definitions) and the cos/sin
tables the attention block rotates queries and keys with (``freetoken.ops.rope``)."""

from __future__ import annotations

import numpy as np


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


def rope_tables(xp, positions, head_dim: int, theta: float, scaling: dict | None = None, max_position: int = 32768,
                rotary_dim: int = 0):
    """cos/sin [T, head_dim] (frequencies repeated over both halves, HF convention) of a RoPE variant
    (:func:`rope_frequencies`).

    ``rotary_dim`` (0: ``head_dim``): partial rotary, as GLM-4.5 has it: HF rotates the first ``rotary_dim``
    dimensions of a head by halves of ``rotary_dim`` and passes the rest through. The tables here are for heads whose
    dimensions :func:`partial_rotary_order` reordered: the rotated pairs at ``j`` and ``j + head_dim / 2`` for ``j <
    rotary_dim / 2`` (frequencies of a ``rotary_dim``-wide RoPE), cos 1 and sin 0 everywhere else, so the one
    full-width rotation kernel computes partial rotary exactly."""
    rd = rotary_dim or head_dim
    inv_freq, attn = rope_frequencies(rd, theta, scaling, max_position)
    ang = np.asarray(positions, np.float64)[:, None] * inv_freq[None, :]
    cos, sin = np.cos(ang) * attn, np.sin(ang) * attn
    if rd < head_dim:
        pad = ((0, 0), (0, (head_dim - rd) // 2))
        cos, sin = np.pad(cos, pad, constant_values=1.0), np.pad(sin, pad, constant_values=0.0)
    cos, sin = np.concatenate([cos, cos], axis=-1), np.concatenate([sin, sin], axis=-1)
    return xp.asarray(cos.astype(np.float32)), xp.asarray(sin.astype(np.float32))


def partial_rotary_order(head_dim: int, rotary_dim: int) -> np.ndarray:
    """The reordering of one head's dimensions (``new[j] = old[order[j]]``) that lets a full-width rotate-half RoPE
    compute HF's partial rotary: HF pairs dimension ``j`` with ``j + rotary_dim / 2`` inside the first ``rotary_dim``;
    after the reorder they sit at ``j`` and ``j + head_dim / 2``, and the passed-through dimensions fill the rest of
    each half (:func:`rope_tables` gives them cos 1, sin 0). Applied to the q and k rows alike (their projections,
    biases and norm weights), it leaves every q.k product, and so attention, unchanged."""
    half, rh = head_dim // 2, rotary_dim // 2
    passed = list(range(rotary_dim, head_dim))
    first, second = passed[:half - rh], passed[half - rh:]
    return np.asarray([*range(rh), *first, *range(rh, rotary_dim), *second], np.int64)


def query_temperature(positions, floor_scale: int, attn_scale: float) -> np.ndarray:
    """Llama 4's attention temperature tuning: the factor ``1 + attn_scale * ln(1 + floor((p + 1) / floor_scale))``
    each query at position ``p`` is multiplied by (after RoPE), float32. It is 1 up to position ``floor_scale - 2``
    and then grows with the log of the context: softmax over more keys flattens, and a larger logit scale at far
    positions keeps attention as sharp as training left it (transformers' Llama 4 and llama.cpp compute the same
    factor)."""
    p = np.asarray(positions, np.float64)
    return (1.0 + attn_scale * np.log1p(np.floor((p + 1.0) / floor_scale))).astype(np.float32)
