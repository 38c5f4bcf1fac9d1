"""Top-k of each row on the CPU (the cpu twin of ``cuda/topk.cu``, same order and tie rule)."""

import numba as nb
import numpy as np


@nb.njit(error_model="numpy", inline="always")
def _before(a, ia, b, ib):
    return a > b or (a == b and ia < ib)


@nb.njit(error_model="numpy", parallel=True, cache=True)
def topk_rows_f32(x, k, idx, val):
    rows, n = x.shape
    for r in nb.prange(rows):
        prev, prev_i = np.inf, -1
        for j in range(k):
            best, best_i = -np.inf, 0x7FFFFFFF
            for c in range(n):
                v = x[r, c]
                key = -np.inf if np.isnan(v) else v
                if _before(prev, prev_i, key, c) and _before(key, c, best, best_i):
                    best, best_i = key, c
            idx[r, j] = best_i
            val[r, j] = x[r, best_i]
            prev, prev_i = best, best_i
