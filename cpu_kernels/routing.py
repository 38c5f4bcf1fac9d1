"""MoE routing (softmax, top-k, renormalisation) on the CPU (the cpu twin of ``cuda/routing.cu``; the cpu device's
``ops.route_softmax_topk``)."""

import numba as nb
import numpy as np

_F32 = np.float32


@nb.njit(inline="always")
def _before(a, ia, b, ib):
    return a > b or (a == b and ia < ib)


@nb.njit(cache=True, boundscheck=False)
def softmax_topk_rows(logits, k, renorm, ids, w):
    """MoE routing of each row of ``logits [R, E]`` (float32): softmax, the k largest probabilities (largest first,
    ties to the lower index, NaN ranked as -inf: ``cpu_kernels/topk.py``'s rule) into ``ids [R, k]`` int32 and
    ``w [R, k]`` float32, renormalised to sum 1 when ``renorm``. Sums accumulate in float64 (NumPy's float32
    pairwise sums differ from them by float32 rounding); a NaN logit makes the row's probabilities NaN, as in NumPy.
    """
    rows, n = logits.shape
    p = np.empty(n, np.float32)
    for r in range(rows):
        m = logits[r, 0]
        for c in range(1, n):
            v = logits[r, c]
            if v > m or v != v:
                m = v
            if m != m:
                break
        total = 0.0
        for c in range(n):
            e = np.exp(logits[r, c] - m)
            p[c] = e
            total += e
        s = _F32(total)
        for c in range(n):
            p[c] = p[c] / s
        prev, prev_i = _F32(np.inf), -1
        sel = 0.0
        for j in range(k):
            best, best_i = _F32(-np.inf), 0x7FFFFFFF
            for c in range(n):
                v = p[c]
                key = _F32(-np.inf) if v != v else v
                if _before(prev, prev_i, key, c) and _before(key, c, best, best_i):
                    best, best_i = key, c
            ids[r, j] = best_i
            w[r, j] = p[best_i]
            sel += p[best_i]
            prev, prev_i = best, best_i
        if renorm:
            s = _F32(sel)
            for j in range(k):
                w[r, j] = w[r, j] / s
