"""Rotary position embedding on the CPU (the cpu twin of ``cuda/rope.cu``; the cpu device's ``ops.rope``)."""

import numba as nb


@nb.njit(cache=True, boundscheck=False)
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
