"""RMSNorm of each row on the CPU (the cpu twin of ``cuda/rms_norm.cu``; the cpu device's ``ops.rms_norm``)."""

import numba as nb
import numpy as np

_F32 = np.float32


@nb.njit(error_model="numpy", cache=True, boundscheck=False, fastmath={"reassoc", "contract", "nsz"})
def rms_norm_rows(x, w, eps, out):
    """out[r] = x[r] / sqrt(mean(x[r]^2) + eps) * w[r % W] for x, out [R, D] and w [W, D] float32, C-contiguous.

    The mean of squares accumulates in float64 (NumPy's float32 pairwise sum differs from it by float32 rounding);
    the rest is NumPy's float32 arithmetic, op for op. One thread: the rows of one token are a few thousand values.
    """
    rows, d = x.shape
    wrows = w.shape[0]
    for r in range(rows):
        acc = 0.0
        for i in range(d):
            v = np.float64(x[r, i])
            acc += v * v
        s = np.sqrt(_F32(acc / d) + eps)
        wr = r % wrows
        for i in range(d):
            out[r, i] = x[r, i] / s * w[wr, i]


@nb.njit(error_model="numpy", cache=True, boundscheck=False)
def _add_rows(x, y):
    """x += y, element for element (float32 adds, as NumPy's)."""
    rows, d = x.shape
    for r in range(rows):
        for i in range(d):
            x[r, i] = x[r, i] + y[r, i]


@nb.njit(error_model="numpy", cache=True, boundscheck=False)
def add_rms_norm_rows(x, y, w, eps, out):
    """x += y, then out = :func:`rms_norm_rows` (x, w, eps): the residual add and the next norm in one call; x, y,
    out [R, D], w [W, D] float32 (x and out C-contiguous, out not aliasing y). The same arithmetic as NumPy's ``x +=
    y`` followed by :func:`rms_norm_rows`, bit for bit."""
    _add_rows(x, y)
    rms_norm_rows(x, w, eps, out)
