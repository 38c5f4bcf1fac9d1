"""Row sums on the CPU (the cpu twin of ``cuda/reduce.cu``)."""

import numba as nb
import numpy as np


@nb.njit(error_model="numpy", parallel=True, cache=True)
def row_sum_f32(x, out):
    rows, cols = x.shape
    for r in nb.prange(rows):
        acc = np.float32(0.0)
        for c in range(cols):
            acc += x[r, c]
        out[r] = acc
