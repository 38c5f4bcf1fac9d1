"""MoE routing (softmax, top-k, renormalisation) on the CPU (the cpu twin of ``cuda/routing.cu``; the cpu device's
``ops.route_softmax_topk``)."""

import numba as nb
import numpy as np

_F32 = np.float32


@nb.njit(error_model="numpy", inline="always")
def _before(a, ia, b, ib):
    return a > b or (a == b and ia < ib)


@nb.njit(error_model="numpy", inline="always")
def _softmax_row(logits, r, p):
    """Row ``r``'s softmax into ``p`` (max-subtracted; sums in float64; a NaN logit makes every p NaN)."""
    n = logits.shape[1]
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


@nb.njit(error_model="numpy", inline="always")
def _topk_ids(key, k, ids, r):
    """``ids[r, :k]``: the k largest of ``key [E]`` (no NaN: -inf instead), largest first, ties to the lower index."""
    prev, prev_i = _F32(np.inf), -1
    for j in range(k):
        best, best_i = _F32(-np.inf), 0x7FFFFFFF
        for c in range(key.shape[0]):
            v = key[c]
            if _before(prev, prev_i, v, c) and _before(v, c, best, best_i):
                best, best_i = v, c
        ids[r, j] = best_i
        prev, prev_i = best, best_i


@nb.njit(error_model="numpy", inline="always")
def _choose_groups(gscore, topk_group, chosen):
    """``chosen[g]``: whether group g is among the ``topk_group`` best scores (ties to the lower group)."""
    chosen[:] = False
    for _ in range(topk_group):
        best, best_g = _F32(-np.inf), 0x7FFFFFFF
        for g in range(gscore.shape[0]):
            if not chosen[g] and _before(gscore[g], g, best, best_g):
                best, best_g = gscore[g], g
        chosen[best_g] = True


@nb.njit(error_model="numpy", cache=True, boundscheck=False)
def softmax_topk_rows(logits, k, renorm, ids, w):
    """MoE routing of each row of ``logits [R, E]`` (float32): softmax, the k largest probabilities (largest first,
    ties to the lower index, NaN ranked as -inf: ``cpu_kernels/topk.py``'s rule) into ``ids [R, k]`` int32 and
    ``w [R, k]`` float32, renormalised to sum 1 when ``renorm``. Sums accumulate in float64 (NumPy's float32
    pairwise sums differ from them by float32 rounding); a NaN logit makes the row's probabilities NaN, as in NumPy.
    """
    rows, n = logits.shape
    p = np.empty(n, np.float32)
    key = np.empty(n, np.float32)
    for r in range(rows):
        _softmax_row(logits, r, p)
        for c in range(n):
            key[c] = _F32(-np.inf) if p[c] != p[c] else p[c]
        _topk_ids(key, k, ids, r)
        sel = 0.0
        for j in range(k):
            w[r, j] = p[ids[r, j]]
            sel += w[r, j]
        if renorm:
            s = _F32(sel)
            for j in range(k):
                w[r, j] = w[r, j] / s


@nb.njit(error_model="numpy", inline="always")
def _sigmoid(x):
    return _F32(1.0) / (_F32(1.0) + np.exp(-x))


@nb.njit(error_model="numpy", cache=True, boundscheck=False)
def sigmoid_group_topk_rows(logits, bias, k, n_group, topk_group, renorm, scale, ids, w):
    """DeepSeek-V3 / GLM-4.5 routing of each row of ``logits [R, E]`` (float32; ``bias [E]`` float32): scores
    ``s = sigmoid(logit)``, selection keys ``s + bias`` (NaN ranked as -inf); a group's score is the sum of its two
    largest keys; the ``topk_group`` best of the ``n_group`` equal groups stay in play; the k largest keys among
    their experts into ``ids [R, k]`` int32 (largest first, ties to the lower index, as everywhere); their scores
    ``s`` into ``w [R, k]``, divided by (their sum + 1e-20) when ``renorm``, times ``scale``. The float32 operations
    of ``cuda/routing.cu``'s ``route_sigmoid_group_topk_f32``."""
    rows, n = logits.shape
    gsize = n // n_group
    key = np.empty(n, np.float32)
    gscore = np.empty(n_group, np.float32)
    chosen = np.empty(n_group, np.bool_)
    scale = _F32(scale)
    for r in range(rows):
        for c in range(n):
            v = _sigmoid(logits[r, c]) + bias[c]
            key[c] = _F32(-np.inf) if v != v else v
        for g in range(n_group):
            a, b = _F32(-np.inf), _F32(-np.inf)
            for c in range(g * gsize, (g + 1) * gsize):
                v = key[c]
                if v > a:
                    b = a
                    a = v
                elif v > b:
                    b = v
            gscore[g] = a + b
        _choose_groups(gscore, topk_group, chosen)
        for c in range(n):
            if not chosen[c // gsize]:
                key[c] = _F32(-np.inf)
        _topk_ids(key, k, ids, r)
        sel = _F32(0.0)
        for j in range(k):
            s = _sigmoid(logits[r, ids[r, j]])
            w[r, j] = s
            sel += s
        denom = sel + _F32(1e-20)
        for j in range(k):
            w[r, j] = (w[r, j] / denom if renorm else w[r, j]) * scale


@nb.njit(error_model="numpy", cache=True, boundscheck=False)
def softmax_group_topk_rows(logits, k, n_group, topk_group, renorm, scale, ids, w):
    """DeepSeek-V2 routing of each row of ``logits [R, E]`` (float32): softmax probabilities (as
    :func:`softmax_topk_rows`); a group's score is its largest probability; the ``topk_group`` best of the
    ``n_group`` equal groups stay in play; the k largest probabilities among their experts into ``ids [R, k]``
    int32 (largest first, ties to the lower index, NaN ranked as -inf), the probabilities into ``w [R, k]``,
    divided by their sum when ``renorm``, times ``scale``. ``cuda/routing.cu``'s ``route_softmax_group_topk_f32``."""
    rows, n = logits.shape
    gsize = n // n_group
    p = np.empty(n, np.float32)
    key = np.empty(n, np.float32)
    gscore = np.empty(n_group, np.float32)
    chosen = np.empty(n_group, np.bool_)
    scale = _F32(scale)
    for r in range(rows):
        _softmax_row(logits, r, p)
        for g in range(n_group):
            a = _F32(-np.inf)
            for c in range(g * gsize, (g + 1) * gsize):
                if p[c] > a:
                    a = p[c]
            gscore[g] = a
        _choose_groups(gscore, topk_group, chosen)
        for c in range(n):
            key[c] = p[c] if chosen[c // gsize] and p[c] == p[c] else _F32(-np.inf)
        _topk_ids(key, k, ids, r)
        sel = 0.0
        for j in range(k):
            w[r, j] = p[ids[r, j]]
            sel += w[r, j]
        s = _F32(sel)
        for j in range(k):
            w[r, j] = (w[r, j] / s if renorm else w[r, j]) * scale
