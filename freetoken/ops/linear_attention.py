"""Gated DeltaNet's two sequence ops (Qwen3-Next, Qwen3.5/3.6-MoE linear-attention layers):

* :func:`short_conv`: the causal depthwise convolution over the projected q|k|v channels with its rolling state,
  followed by SiLU;
* :func:`gated_delta_rule`: the gated delta rule over a per-head recurrent state ``S [Dk, Dv]``.

Both update their state in place, so decode (T = 1) and prefill (T > 1, or a chunk of a long prompt) are the same
call: a sequence's layer state is what these ops read and write, nothing else.

The cpu device runs the Numba kernels :func:`freetoken.cpu_kernels.linear_attention.short_conv_rows` and
:func:`~freetoken.cpu_kernels.linear_attention.gated_delta_rule_rows` (the rule's recurrent form at every T: a
chunked prototype was 5x slower there); gpu/emu run ``short_conv_f32`` and, for the rule, ``gated_delta_rule_f32``
(the recurrent form: decode and prompts under ``LINEAR_CHUNKED_MIN_TOKENS`` tokens) or the chunked (WY) form,
``gated_delta_chunk_prep_f32`` then ``gated_delta_chunk_scan_f32`` (``cuda/linear_attention.cu``), which works on
chunks of ``LINEAR_CHUNK`` tokens in parallel and is sequential over chunks instead of tokens. Both take
K <= ``LINEAR_CONV_MAX_TAPS`` taps and head dims Dk, Dv <= ``LINEAR_MAX_HEAD_DIM``
(:mod:`freetoken.device.constants`).
"""

from __future__ import annotations

import functools

import numpy as np

from freetoken.device.constants import (
    LINEAR_CHUNK,
    LINEAR_CHUNK_COLUMNS,
    LINEAR_CHUNK_RECORD,
    LINEAR_CHUNK_THREADS,
    LINEAR_CHUNKED_MIN_TOKENS,
    LINEAR_COLUMNS,
    LINEAR_CONV_MAX_TAPS,
    LINEAR_CONV_THREADS,
    LINEAR_L2NORM_EPS,
    LINEAR_MAX_HEAD_DIM,
)
from freetoken.ops._common import as_input, check_int32, cpu_module, cuda_kernel, prepare_out, resolve

#: ``l2norm``'s epsilon inside the rule: ``x * rsqrt(sum(x^2) + eps)`` (fla's and transformers' value).
L2NORM_EPS = LINEAR_L2NORM_EPS
#: The rule's forms on gpu/emu (``mode``): "auto" picks by the token count.
RULE_MODES = ("auto", "recurrent", "chunked")


def short_conv(x, weight, state, *, out=None, device=None, checked: bool = False):
    """Causal depthwise convolution of K taps with SiLU, continuing a sequence: ``out[t, c] = silu(sum_j weight[c, j]
    * u[t + j, c])`` where ``u = concat(state, x)`` (the K - 1 inputs before ``x`` first), then ``state`` becomes the
    last K - 1 rows of ``u``.

    Parameters
    ----------
    x : float32 [T, C]: the layer's projected q|k|v channels, T >= 1
    weight : float32 [C, K]: HF ``conv1d.weight`` [C, 1, K] without its middle axis (tap K - 1 meets the newest input)
    state : float32 [K - 1, C], C-contiguous, updated in place: the K - 1 inputs before ``x``, oldest first (zeros at
        the start of a sequence)
    out : float32 [T, C], C-contiguous, optional
    checked : the caller vouches for every argument (float32, C-contiguous, the shapes above, ``out`` given)

    Returns
    -------
    float32 [T, C] on the device.
    """
    if checked:
        _run_conv(device, x, weight, state, out)
        return out
    dev = resolve(device)
    x, weight = check_conv_inputs(dev, x, weight)
    st = dev.as_array(state)
    want = (weight.shape[1] - 1, x.shape[1])
    if st.dtype != np.float32 or tuple(st.shape) != want or not st.flags.c_contiguous:
        raise ValueError(f"state must be float32 {want}, C-contiguous, got {st.dtype} {tuple(st.shape)}")
    y = prepare_out(dev, out, tuple(x.shape), np.float32)
    _run_conv(dev, x, weight, st, y)
    return y


def check_conv_inputs(dev, x, weight):
    """(x, weight) on ``dev``, checked as :func:`short_conv` takes them (shared with its batch twin)."""
    x = as_input(dev, x, "x", np.float32, 2)
    weight = as_input(dev, weight, "weight", np.float32, 2)
    t, c = x.shape
    if t < 1:
        raise ValueError("x must have at least one row")
    if weight.shape[0] != c or not 2 <= weight.shape[1] <= LINEAR_CONV_MAX_TAPS:
        raise ValueError(f"weight must be [C={c}, 2 <= K <= {LINEAR_CONV_MAX_TAPS}], got {tuple(weight.shape)}")
    check_int32("T", t)
    check_int32("C", c)
    return x, weight


def _run_conv(dev, x, weight, state, out) -> None:
    if dev.kind == "cpu":
        short_conv_rows = cpu_module("linear_attention").short_conv_rows

        short_conv_rows(x, weight, state, out)
        return
    t, c = x.shape
    cuda_kernel(dev, "linear_attention.cu", "short_conv_f32")(
        (-(-c // LINEAR_CONV_THREADS),), (LINEAR_CONV_THREADS,),
        (x, weight, state, out, np.int32(t), np.int32(c), np.int32(weight.shape[1]), state, np.int32(0)))
    # (width 0: one sequence; the batch descriptor is not read, the state stands in for it)


def gated_delta_rule(qkv, g, beta, state, k_heads: int, *, out=None, mode: str = "auto", device=None,
                     checked: bool = False):
    """The gated delta rule over T tokens, continuing from ``state``.

    For value head h (key head ``kh = h // (Hv / Hk)``) and each token t in order, with ``q = l2norm(q_t,kh) /
    sqrt(Dk)`` and ``k = l2norm(k_t,kh)`` (``x * rsqrt(sum(x^2) + 1e-6)``)::

        S = exp(g[t, h]) * S
        S = S + k (beta[t, h] * (v[t, h] - k^T S))      # outer product: [Dk] x [Dv]
        out[t, h] = q^T S

    Parameters
    ----------
    qkv : float32 [T, 2 Hk Dk + Hv Dv]: the short convolution's output, q heads, then k heads, then v heads
    g : float32 [T, Hv]: log decay (<= 0)
    beta : float32 [T, Hv]: the write strength (in (0, 1))
    state : float32 [Hv, Dk, Dv], C-contiguous, updated in place (zeros at the start of a sequence)
    k_heads : Hk, a divisor of Hv
    out : float32 [T, Hv, Dv], C-contiguous, optional
    mode : "recurrent" (one token after another), "chunked" (the chunk-parallel WY form: T / LINEAR_CHUNK chunks in
        parallel, then a scan over chunks; it allocates T / 64 * Hv * 33 KiB of scratch) or "auto": chunked from
        ``LINEAR_CHUNKED_MIN_TOKENS`` tokens on. gpu/emu only: the cpu device always runs its recurrent kernel.
    checked : the caller vouches for every argument (and ``mode``)

    Returns
    -------
    float32 [T, Hv, Dv] on the device.
    """
    if checked:
        _run_rule(device, qkv, g, beta, state, int(k_heads), out, mode)
        return out
    dev = resolve(device)
    st = dev.as_array(state)
    if st.dtype != np.float32 or st.ndim != 3 or not st.flags.c_contiguous:
        raise ValueError(f"state must be float32 [Hv, Dk, Dv], C-contiguous, got {st.dtype} {tuple(st.shape)}")
    if mode not in RULE_MODES:
        raise ValueError(f"mode must be {', '.join(RULE_MODES)}, got {mode!r}")
    qkv, g, beta, k_heads = check_rule_inputs(dev, qkv, g, beta, st.shape, k_heads)
    y = prepare_out(dev, out, (qkv.shape[0], st.shape[0], st.shape[2]), np.float32)
    _run_rule(dev, qkv, g, beta, st, k_heads, y, mode)
    return y


def check_rule_inputs(dev, qkv, g, beta, state_shape, k_heads):
    """(qkv, g, beta, k_heads) on ``dev``, checked as :func:`gated_delta_rule` takes them for a state of
    ``state_shape`` [Hv, Dk, Dv] (shared with its batch twin)."""
    qkv = as_input(dev, qkv, "qkv", np.float32, 2)
    g = as_input(dev, g, "g", np.float32, 2)
    beta = as_input(dev, beta, "beta", np.float32, 2)
    hv, dk, dv = state_shape
    if not (1 <= dk <= LINEAR_MAX_HEAD_DIM and 1 <= dv <= LINEAR_MAX_HEAD_DIM):
        raise ValueError(f"head dims Dk={dk}, Dv={dv} must be 1 .. {LINEAR_MAX_HEAD_DIM}")
    k_heads = int(k_heads)
    if k_heads < 1 or hv % k_heads:
        raise ValueError(f"k_heads {k_heads} must divide the {hv} value heads")
    t = qkv.shape[0]
    if t < 1 or qkv.shape[1] != 2 * k_heads * dk + hv * dv:
        raise ValueError(f"qkv must be [T >= 1, 2*{k_heads}*{dk} + {hv}*{dv}], got {tuple(qkv.shape)}")
    for name, a in (("g", g), ("beta", beta)):
        if tuple(a.shape) != (t, hv):
            raise ValueError(f"{name} must be [{t}, {hv}], got {tuple(a.shape)}")
    check_int32("T", t)
    return qkv, g, beta, k_heads


@functools.lru_cache(maxsize=64)
def _one_sequence(t: int) -> np.ndarray:
    """The cpu rule kernel's descriptor of one sequence of ``t`` rows on state 0, made once per ``t`` (a decode step
    asks for it in every linear layer; the kernel never writes it, and it stays writable so that Numba compiles one
    specialisation for this and the batch's descriptors)."""
    return np.array([[0, 0, t]], np.int32)


def _run_rule(dev, qkv, g, beta, state, k_heads, out, mode="auto") -> None:
    if dev.kind == "cpu":
        gated_delta_rule_rows = cpu_module("linear_attention").gated_delta_rule_rows

        # one sequence: the kernel's pool of one state, rows 0 .. T
        gated_delta_rule_rows(qkv, g, beta, state.reshape(1, *state.shape), _one_sequence(qkv.shape[0]), k_heads,
                              out)
        return
    t = qkv.shape[0]
    hv, dk, dv = state.shape
    dims = (np.int32(t), np.int32(k_heads), np.int32(hv), np.int32(dk), np.int32(dv))
    if mode == "recurrent" or (mode == "auto" and t < LINEAR_CHUNKED_MIN_TOKENS):
        cuda_kernel(dev, "linear_attention.cu", "gated_delta_rule_f32")(  # width 0: one sequence (see short_conv)
            (hv, -(-dv // LINEAR_COLUMNS)), (LINEAR_COLUMNS,), (qkv, g, beta, state, out, *dims, state, np.int32(0)))
        return
    # chunked: the prep kernel (all chunks at once, per key head) writes each (value head, chunk)'s Tb, P and
    # coefficients to the scratch; the scan (per value head and 16 state columns) runs the chunks in order
    chunks = -(-t // LINEAR_CHUNK)
    rec = dev.empty((hv * chunks * LINEAR_CHUNK_RECORD,), np.float32)
    cuda_kernel(dev, "linear_attention.cu", "gated_delta_chunk_prep_f32")(
        (chunks, k_heads), (LINEAR_CHUNK_THREADS,), (qkv, g, beta, rec, *dims))
    cuda_kernel(dev, "linear_attention.cu", "gated_delta_chunk_scan_f32")(
        (hv, -(-dv // LINEAR_CHUNK_COLUMNS)), (LINEAR_CHUNK_THREADS,), (qkv, rec, state, out, *dims))
