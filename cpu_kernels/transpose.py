"""Blocked 2-D transpose on the CPU (the cpu twin of ``cuda/transpose.cu``)."""

import numba as nb

_B = 32


@nb.njit(error_model="numpy", parallel=True, cache=True)
def transpose_2d(x, out):
    rows, cols = x.shape
    for bi in nb.prange((rows + _B - 1) // _B):
        r0 = bi * _B
        for c0 in range(0, cols, _B):
            for r in range(r0, min(r0 + _B, rows)):
                for c in range(c0, min(c0 + _B, cols)):
                    out[c, r] = x[r, c]
