"""Gated DeltaNet's two sequence ops on the CPU (the cpu twins of ``cuda/linear_attention.cu``; contract:
``freetoken/ops/linear_attention.py``, reference: ``freetoken/testing/reference/linear_attention.py``).

* :func:`short_conv_rows`: the causal depthwise convolution with SiLU, one token row at a time, channels in the
  vector lanes (a ``prange`` over tokens for a prompt; decode runs on the calling thread);
* :func:`gated_delta_rule_rows`: the gated delta rule in its recurrent form, for one sequence or several (each its
  state of a pool). A value column of the state evolves on
  its own, so the parallel tasks are (value head, block of :data:`COLUMNS` columns): the task's ``Dk x COLUMNS``
  tile of ``S`` stays in L1 over the T tokens, and per token two passes over it, columns in the lanes: ``S *=
  exp(g)`` with ``d = k^T S``, then ``S += k delta^T`` with ``out = q^T S``. Decode reads and writes each state once
  (memory bound: 4 MiB a Qwen3.5 layer).

Float32 with fused multiply-adds and no reassociation (``contract``): every lane sums in order, so results do not
depend on the vector width.
"""

import numba as nb
import numpy as np
from freetoken.cpu_kernels.paged_attention import _exp

from freetoken.device.constants import LINEAR_L2NORM_EPS

_FASTMATH = {"contract"}
_F32 = np.float32
#: From this many tokens the per-token work (:func:`short_conv_rows`, the rule's q/k normalisation) spreads over
#: the threads (a decode step's one row takes a few microseconds, less than waking them).
PARALLEL_TOKENS = 16
#: Value columns per parallel task of :func:`gated_delta_rule_rows` (its state tile: Dk x COLUMNS floats).
COLUMNS = 32


@nb.njit(error_model="numpy", inline="always", fastmath=_FASTMATH)
def _silu(a):
    """a * sigmoid(a) by :func:`~freetoken.cpu_kernels.paged_attention._exp` of -|a| (branch free: vectorises)."""
    e = _exp(-abs(a))
    s = _F32(1.0) / (_F32(1.0) + e)
    return a * (s if a >= _F32(0.0) else e * s)


@nb.njit(error_model="numpy", inline="always")
def _u_row(x, state, r):
    """Row r of u = concat(state, x)."""
    km = state.shape[0]
    return state[r] if r < km else x[r - km]


@nb.njit(error_model="numpy", inline="always", fastmath=_FASTMATH)
def _conv_token(x, weight, state, out, t):
    """out[t] = ``silu(sum_j weight[:, j] * u[t + j])``, u = concat(state, x) (state not written); the taps summed
    in order j = 0 .. K - 1 (as ``cuda/linear_attention.cu``)."""
    channels = x.shape[1]
    k = weight.shape[1]
    o = out[t]
    if k == 4:  # Qwen's taps: the weight row's 4 values are a constant-stride group the vectoriser de-interleaves
        a0, a1, a2, a3 = _u_row(x, state, t), _u_row(x, state, t + 1), _u_row(x, state, t + 2), x[t]
        for c in range(channels):
            o[c] = _silu(weight[c, 0] * a0[c] + weight[c, 1] * a1[c] + weight[c, 2] * a2[c] + weight[c, 3] * a3[c])
        return
    a = _u_row(x, state, t)
    for c in range(channels):
        o[c] = weight[c, 0] * a[c]
    for j in range(1, k):
        a = _u_row(x, state, t + j)
        for c in range(channels):
            o[c] += weight[c, j] * a[c]
    for c in range(channels):
        o[c] = _silu(o[c])


@nb.njit(error_model="numpy", inline="always")
def _conv_state(x, state):
    """state <- the last K - 1 rows of concat(state, x) (rows move up: each read before it is overwritten)."""
    t_count, channels = x.shape
    km = state.shape[0]
    for j in range(km):
        src = _u_row(x, state, t_count + j)
        dst = state[j]
        for c in range(channels):
            dst[c] = src[c]


@nb.njit(error_model="numpy", parallel=True, cache=True, boundscheck=False, fastmath=_FASTMATH)
def short_conv_rows(x, weight, state, out):
    """x, out float32 [T, C]; weight [C, K]; state [K - 1, C] (oldest first), updated: ``out[t, c] = silu(sum_j
    weight[c, j] u[t + j, c])``, u = concat(state, x), then state = the last K - 1 rows of u. All C-contiguous.
    From :data:`PARALLEL_TOKENS` tokens the rows spread over the threads; fewer run on the calling thread."""
    t_count = x.shape[0]
    if t_count >= PARALLEL_TOKENS:
        for t in nb.prange(t_count):
            _conv_token(x, weight, state, out, t)
    else:
        for t in range(t_count):
            _conv_token(x, weight, state, out, t)
    _conv_state(x, state)


@nb.njit(error_model="numpy", inline="always")
def _l2_scale(qkv, t, off, dk):
    """1 / sqrt(sum(x^2) + eps) of the Dk values ``qkv[t, off:off + dk]`` (the sum in float64)."""
    acc = 0.0
    for i in range(dk):
        v = np.float64(qkv[t, off + i])
        acc += v * v
    return _F32(1.0 / np.sqrt(acc + LINEAR_L2NORM_EPS))


@nb.njit(error_model="numpy", inline="always")
def _normalise_token(qkv, t, qk):
    """qk[t, kh, 0] = l2norm(q) / sqrt(Dk), qk[t, kh, 1] = l2norm(k) of token t's key heads."""
    k_heads, dk = qk.shape[1], qk.shape[3]
    qscale = _F32(1.0 / np.sqrt(dk))
    for kh in range(k_heads):
        for part in range(2):
            off = (part * k_heads + kh) * dk
            r = _l2_scale(qkv, t, off, dk)
            if part == 0:
                r *= qscale
            for i in range(dk):
                qk[t, kh, part, i] = qkv[t, off + i] * r


@nb.njit(error_model="numpy", inline="always", fastmath=_FASTMATH)
def _rule_columns(qk, qkv, g, beta, s, h, kh, j0, w, out):
    """The rule over every token for columns ``j0 .. j0 + w`` (w <= :data:`COLUMNS`) of value head h's state ``s
    [Dk, Dv]`` (key head kh; q and k normalised in ``qk``). Inlined where it is called, so that a call with
    ``w = COLUMNS`` compiles with a constant trip count. Every inner loop runs over the columns of a row view from 0
    (an index offset by j0 could be negative as far as Numba knows: its wraparound select stops the vectoriser); the
    sums ``d`` and ``o`` are the task's own arrays (no aliasing for the vectoriser to check)."""
    t_count, dk = qk.shape[0], qk.shape[3]
    dv = s.shape[1]
    v0 = 2 * qk.shape[1] * dk + h * dv + j0
    d = np.empty(COLUMNS, np.float32)  # k^T S, then delta
    o = np.empty(COLUMNS, np.float32)
    for t in range(t_count):
        q = qk[t, kh, 0]
        k = qk[t, kh, 1]
        decay = _F32(np.exp(g[t, h]))
        b = beta[t, h]
        for j in range(w):
            d[j] = _F32(0.0)
        for i in range(dk):  # S *= exp(g); d = k^T S
            ki = k[i]
            r = s[i, j0:j0 + w]
            for j in range(w):
                v = r[j] * decay
                r[j] = v
                d[j] += v * ki
        x = qkv[t, v0:v0 + w]
        for j in range(w):  # delta
            d[j] = b * (x[j] - d[j])
        for j in range(w):
            o[j] = _F32(0.0)
        for i in range(dk):  # S += k delta^T; out = q^T S
            ki = k[i]
            qi = q[i]
            r = s[i, j0:j0 + w]
            for j in range(w):
                v = r[j] + ki * d[j]
                r[j] = v
                o[j] += v * qi
        ot = out[t, h, j0:j0 + w]
        for j in range(w):
            ot[j] = o[j]


# ---- several sequences in one call (continuous batching: freetoken/ops/linear_batch.py) ---------------------------
@nb.njit(error_model="numpy", parallel=True, cache=True, boundscheck=False, fastmath=_FASTMATH)
def short_conv_batch_rows(x, weight, states, desc, out):
    """:func:`short_conv_rows` for several sequences in one call: ``desc`` int32 [S, 3] holds each sequence's
    (state index in ``states`` [N, K - 1, C], first row, end row) of ``x`` / ``out``. The parallel tasks are the
    sequences, each running its rows in order (the op gives sequences of :data:`PARALLEL_TOKENS` rows or more to
    :func:`short_conv_rows`, which spreads them over the threads)."""
    for s in nb.prange(desc.shape[0]):
        lo, hi = desc[s, 1], desc[s, 2]
        xs, os_, st = x[lo:hi], out[lo:hi], states[desc[s, 0]]
        for t in range(hi - lo):
            _conv_token(xs, weight, st, os_, t)
        _conv_state(xs, st)


@nb.njit(error_model="numpy", parallel=True, cache=True, boundscheck=False, fastmath=_FASTMATH)
def gated_delta_rule_rows(qkv, g, beta, states, desc, k_heads, out):
    """qkv float32 [T, 2 Hk Dk + Hv Dv] (q, k, v heads); g, beta [T, Hv]; states [N, Hv, Dk, Dv], updated; ``desc``
    int32 [S, 3]: each sequence's (state index in ``states``, first row, end row); k_heads Hk -> out [T, Hv, Dv];
    all C-contiguous. One sequence (``gated_delta_rule``: N = S = 1) or several in one call (its batch twin). Per
    value head h (key head h // (Hv / Hk)) and token, q and k l2-normalised (q also by 1 / sqrt(Dk)): ``S *=
    exp(g); S += k (beta (v - k^T S))^T; out = q^T S``.

    A value column of S evolves on its own (k^T S, the update and q^T S are per column), so the parallel tasks are
    (sequence, head, block of :data:`COLUMNS` columns): a task's ``Dk x COLUMNS`` tile of S (16 KiB at Dk = 128)
    stays in L1 over the sequence's tokens; per token two passes over it, columns in the lanes
    (:func:`_rule_columns`). q and k are normalised once per call."""
    t_count = qkv.shape[0]
    hv, dk, dv = states.shape[1], states.shape[2], states.shape[3]
    rep = hv // k_heads
    qk = np.empty((t_count, k_heads, 2, dk), np.float32)
    if t_count >= PARALLEL_TOKENS:
        for t in nb.prange(t_count):
            _normalise_token(qkv, t, qk)
    else:
        for t in range(t_count):
            _normalise_token(qkv, t, qk)
    nb_ = (dv + COLUMNS - 1) // COLUMNS
    per = hv * nb_
    for task in nb.prange(desc.shape[0] * per):
        s = task // per
        h = (task - s * per) // nb_
        j0 = (task - s * per - h * nb_) * COLUMNS
        lo, hi = desc[s, 1], desc[s, 2]
        st = states[desc[s, 0], h]
        if j0 + COLUMNS <= dv:
            _rule_columns(qk[lo:hi], qkv[lo:hi], g[lo:hi], beta[lo:hi], st, h, h // rep, j0, COLUMNS, out[lo:hi])
        else:
            _rule_columns(qk[lo:hi], qkv[lo:hi], g[lo:hi], beta[lo:hi], st, h, h // rep, j0, dv - j0, out[lo:hi])
