"""RMSNorm of each row on the CPU (the cpu twin of ``cuda/rms_norm.cu``; the cpu device's ``ops.rms_norm``)."""

import numba as nb
import numpy as np

_F32 = np.float32


@nb.njit(cache=True, boundscheck=False, fastmath={"reassoc", "contract", "nsz"})
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
