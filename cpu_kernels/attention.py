"""Causal grouped-query attention on the CPU (the cpu twin of ``cuda/attention.cu``, same semantics).

One (query, head) pair per parallel iteration: exact two-pass softmax with float64 scores and sums.
"""

import numba as nb
import numpy as np


@nb.njit(parallel=True, cache=True)
def attention_decode_f32(q, k, v, start, out):
    """q [T, H, D], k, v [>= start + T, Hkv, D] float32 -> out [T, H * D] float32 (query t sees rows 0..start+t)."""
    t_count, heads, dim = q.shape
    group = heads // k.shape[1]
    scale = 1.0 / np.sqrt(dim)
    for r in nb.prange(t_count * heads):
        t = r // heads
        h = r - t * heads
        kvh = h // group
        n = start + t + 1
        s = np.empty(n, np.float64)
        mx = -np.inf
        for j in range(n):
            acc = 0.0
            for d in range(dim):
                acc += np.float64(q[t, h, d]) * k[j, kvh, d]
            acc *= scale
            s[j] = acc
            mx = max(mx, acc)
        total = 0.0
        for j in range(n):
            s[j] = np.exp(s[j] - mx)
            total += s[j]
        o = np.zeros(dim, np.float64)
        for j in range(n):
            p = s[j]
            for d in range(dim):
                o[d] += p * v[j, kvh, d]
        for d in range(dim):
            out[t, h * dim + d] = o[d] / total
