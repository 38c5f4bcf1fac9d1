"""Rotary position embedding on the CPU (the cpu twin of ``cuda/rope.cu``; the cpu device's ``ops.rope``)."""

import numba as nb
import numpy as np
from freetoken.cpu_kernels.rms_norm import rms_norm_rows


@nb.njit(error_model="numpy", cache=True, boundscheck=False)
def rope_rows(x, cos, sin, out):
    """out = x * cos + rotate_half(x) * sin for x, out [T, H, D] (D even) and cos, sin [T, D] float32: NumPy's
    float32 arithmetic element for element (no fast-math: no FMA contraction), so the results are identical."""
    t_count, heads, d = x.shape
    half = d // 2
    for t in range(t_count):
        for h in range(heads):
            for i in range(half):
                out[t, h, i] = x[t, h, i] * cos[t, i] + (-x[t, h, i + half]) * sin[t, i]
            for i in range(half, d):
                out[t, h, i] = x[t, h, i] * cos[t, i] + x[t, h, i - half] * sin[t, i]


@nb.njit(error_model="numpy", cache=True, boundscheck=False)
def _rope_row(x, c, s, out):
    """One head: out = x * c + rotate_half(x) * s, as :func:`rope_rows` computes each element."""
    d = x.shape[0]
    half = d // 2
    for i in range(half):
        out[i] = x[i] * c[i] + (-x[i + half]) * s[i]
    for i in range(half, d):
        out[i] = x[i] * c[i] + x[i - half] * s[i]


@nb.njit(error_model="numpy", cache=True, boundscheck=False)
def rope_qkv_cache_rows(qkv, norm, use_norm, eps, cos, sin, k_cache, v_cache, start, q):
    """A fused q/k/v projection into attention's inputs in one call: for every token t of ``qkv [T, H + 2 Hkv, D]``
    (C-contiguous), its q and k heads RMS-normed with ``norm [H + Hkv, D]`` when ``use_norm``
    (:func:`~freetoken.cpu_kernels.rms_norm.rms_norm_rows`) and rotated (:func:`rope_rows`' arithmetic) with ``cos,
    sin [T, D]``: q heads into ``q [T, H, D]``, k heads into ``k_cache[start + t]``; the v heads copied into
    ``v_cache[start + t]`` (caches [rows, Hkv, D]). Bit for bit what rms_norm_rows, rope_rows and the row copies
    compute one after the other."""
    t_count, _, d = qkv.shape
    heads = q.shape[1]
    kv_heads = k_cache.shape[1]
    nqk = heads + kv_heads
    normed = np.empty((nqk, d), np.float32)
    for t in range(t_count):
        x = qkv[t]
        qk = x[:nqk]
        if use_norm:
            rms_norm_rows(qk, norm, eps, normed)
            qk = normed
        for h in range(heads):
            _rope_row(qk[h], cos[t], sin[t], q[t, h])
        krow = k_cache[start + t]
        vrow = v_cache[start + t]
        for h in range(kv_heads):
            _rope_row(qk[heads + h], cos[t], sin[t], krow[h])
            vsrc = x[nqk + h]
            vdst = vrow[h]
            for i in range(d):
                vdst[i] = vsrc[i]
