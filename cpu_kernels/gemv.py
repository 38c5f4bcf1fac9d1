"""Dense ``out[T, N] = x[T, K] @ W[N, K].T`` on the CPU (the decoder's non-expert projections), and the small
per-token ops around them (RMSNorm, RoPE, MoE routing: re-exported from :mod:`~freetoken.cpu_kernels.rms_norm`,
:mod:`~freetoken.cpu_kernels.rope` and :mod:`~freetoken.cpu_kernels.routing`) as single Numba calls.

Public entry point of the products: :func:`gemv`. ``W`` is float32, float16 or bf16 (``uint16`` bits or
``ml_dtypes.bfloat16``); ``x`` and ``out`` are float32; accumulation is float32 (reassociated: vector lanes, FMA).

* Few tokens (T <= :data:`GEMV_MAX_TOKENS`), :func:`_gemv_kernel`: bound by reading the weights (two flops per weight
  and token). A ``prange`` over blocks of output rows (below :data:`SERIAL_MACS` multiply-adds the same loops on the
  calling thread); each row is read from memory once per call, widened to float32
  in registers (bf16: a 16-bit shift; f16: ``vcvtph2ps``) and dotted with every token (groups of 4, 2, 1 tokens; later
  groups re-read the row from L1). Numba's loop vectoriser turns the inner loops into 16-lane FMAs.
* More tokens, :func:`_gemm_kernel`: compute bound. A ``prange`` over 16-row panels of the weights, each widened
  once into float32 and multiplied by every token with the micro-kernel of :mod:`~freetoken.cpu_kernels.gemm_panel`
  (rows in vector lanes, one panel load per ``TOKENS`` FMAs); tokens in panels of about 1 MiB of ``x``.

One kernel source serves the three storage types: it is compiled per weight dtype, and float16 (which Numba cannot
type) travels as its ``int16`` bits, bf16 as ``uint16`` bits. Measured on a 2-core Zen 5 with the projections of a
16-layer Qwen3-MoE-like model (hidden 1024, 94 MB in f16): one token 1.5-1.9 ms (50-63 GB/s; NumPy's float32
product on one BLAS thread: 5.6 ms); 64 tokens 19 ms (~300 GFLOP/s; one BLAS thread: 58 ms).
"""

from __future__ import annotations

import numba as nb
import numpy as np
from freetoken.cpu_kernels.gemm_panel import PANEL_ROWS, TOKENS, panel_product, widen_panel
from freetoken.cpu_kernels.rms_norm import rms_norm_rows
from freetoken.cpu_kernels.rope import rope_rows
from freetoken.cpu_kernels.routing import softmax_topk_rows
from freetoken.cpu_kernels.widen import FASTMATH, _widen

__all__ = ["GEMV_MAX_TOKENS", "gemv", "matmul_into", "rms_norm_rows", "rope_rows", "softmax_topk_rows",
           "storage_view", "widen"]

#: Output rows per parallel work item of the GEMV.
ROWS = 16
#: Up to this many tokens :func:`gemv` runs the GEMV kernel, beyond it the register-tiled one (measured crossover).
GEMV_MAX_TOKENS = 4
#: Bytes of ``x`` per token panel of the tiled kernel.
PANEL_BYTES = 1 << 20
#: Below this many multiply-adds (N x K x T) the GEMV runs on the calling thread (:func:`_gemv_serial`): a router
#: gate or a tiny projection takes microseconds, less than waking the other threads, and on a busy machine a
#: parallel region waits for every one of its threads to be scheduled.
SERIAL_MACS = 1 << 18

_F32 = np.float32


@nb.njit(fastmath=FASTMATH, inline="always")
def _row_tokens(x, w, out, r, t, t_count, k):
    """out[t:t_count, r] for one row r: tokens in groups of 4, 2, 1 (the row re-read from L1 by later groups)."""
    while t_count - t >= 4:
        a0 = a1 = a2 = a3 = _F32(0.0)
        for i in range(k):
            v = _widen(w[r, i])
            a0 += v * x[t, i]
            a1 += v * x[t + 1, i]
            a2 += v * x[t + 2, i]
            a3 += v * x[t + 3, i]
        out[t, r] = a0
        out[t + 1, r] = a1
        out[t + 2, r] = a2
        out[t + 3, r] = a3
        t += 4
    if t_count - t >= 2:
        a0 = a1 = _F32(0.0)
        for i in range(k):
            v = _widen(w[r, i])
            a0 += v * x[t, i]
            a1 += v * x[t + 1, i]
        out[t, r] = a0
        out[t + 1, r] = a1
        t += 2
    if t_count - t == 1:
        a0 = _F32(0.0)
        for i in range(k):
            a0 += _widen(w[r, i]) * x[t, i]
        out[t, r] = a0


@nb.njit(parallel=True, cache=True, boundscheck=False, fastmath=FASTMATH)
def _gemv_kernel(x, w, out):
    """out[t, r] = sum_i widen(w[r, i]) * x[t, i]; x [T, K], w [N, K], out [T, N], all C-contiguous."""
    t_count, k = x.shape
    n = w.shape[0]
    for blk in nb.prange((n + ROWS - 1) // ROWS):
        for r in range(blk * ROWS, min(blk * ROWS + ROWS, n)):
            _row_tokens(x, w, out, r, 0, t_count, k)


#: :func:`_gemv_kernel` compiled without threads (``prange`` runs as ``range``): the same loops, the same sums.
_gemv_serial = nb.njit(cache=True, boundscheck=False, fastmath=FASTMATH)(_gemv_kernel.py_func)


@nb.njit(parallel=True, cache=True, boundscheck=False, fastmath=FASTMATH)
def _gemm_kernel(x, w, out, nthreads):
    """The same product for many tokens: a ``prange`` over 16-row panels, each widened once into a float32
    ``[K, 16]`` buffer of the thread and multiplied by every token in K slices of ``KC`` and token tiles of
    ``TOKENS`` (the micro-kernel of :mod:`freetoken.cpu_kernels.gemm_panel`: rows in vector lanes)."""
    t_count, k = x.shape
    n = w.shape[0]
    npanel = (n + PANEL_ROWS - 1) // PANEL_ROWS
    for wk in nb.prange(nthreads):
        panel = np.empty((k, PANEL_ROWS), np.float32)
        toks = np.empty(TOKENS, np.int64)
        acc = np.empty((t_count, PANEL_ROWS), np.float32)
        for p in range(wk * npanel // nthreads, (wk + 1) * npanel // nthreads):
            r0 = p * PANEL_ROWS
            widen_panel(w, r0, panel)
            panel_product(x, panel, r0, min(PANEL_ROWS, n - r0), out, toks, acc)


def matmul_into(x: np.ndarray, w: np.ndarray, out: np.ndarray) -> None:
    """``out = x @ widen(w).T`` with no checks (the caller's): x float32 [T, K], w the kernel's weight array
    (:func:`storage_view`) [N, K], out float32 [T, N], all C-contiguous, T >= 1."""
    t_count = x.shape[0]
    if t_count <= GEMV_MAX_TOKENS:
        if w.size * t_count < SERIAL_MACS:
            _gemv_serial(x, w, out)
        else:
            _gemv_kernel(x, w, out)
        return
    panel = max(4, PANEL_BYTES // (4 * max(1, x.shape[1])) // 4 * 4)
    nthreads = nb.get_num_threads()
    if t_count <= panel:
        _gemm_kernel(x, w, out, nthreads)
        return
    for t0 in range(0, t_count, panel):  # out rows of a panel are a C-contiguous block
        _gemm_kernel(x[t0:t0 + panel], w, out[t0:t0 + panel], nthreads)


def storage_view(w: np.ndarray) -> np.ndarray:
    """``w`` (float32, float16, bf16 as ``ml_dtypes.bfloat16`` or uint16 bits) as the kernel's weight array:
    float16 as int16 bits, bf16 as uint16 bits (a view, no copy); C-contiguous required."""
    if w.dtype == np.float32 or w.dtype == np.uint16:
        return w
    if w.dtype == np.float16:
        return w.view(np.int16)
    if w.dtype.name == "bfloat16":
        return w.view(np.uint16)
    raise TypeError(f"weights must be float32, float16 or bf16 (uint16 bits), got {w.dtype}")


def widen(w: np.ndarray) -> np.ndarray:
    """The float32 values of weights as the kernels read them (float32; float16 or its int16 bits; bf16 or its uint16
    bits): a new array unless already float32."""
    if w.dtype == np.float32:
        return w
    if w.dtype == np.float16 or w.dtype == np.int16:
        return w.view(np.float16).astype(np.float32)
    w = storage_view(w)
    return (w.astype(np.uint32) << np.uint32(16)).view(np.float32)


def gemv(x: np.ndarray, w: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """``x @ widen(w).T`` in float32: the GEMV kernel up to :data:`GEMV_MAX_TOKENS` tokens, the tiled one beyond.

    Parameters
    ----------
    x : float32 [T, K] (a vector [K] is taken as T = 1)
    w : [N, K] float32, float16, or bf16 (``ml_dtypes.bfloat16`` or ``uint16`` bits), C-contiguous; int16 is read
        as float16 bits (what :func:`storage_view` makes of float16)
    out : float32 [T, N], C-contiguous, optional

    Returns
    -------
    float32 [T, N] (``out`` when given)
    """
    if w.dtype != np.int16:
        w = storage_view(w)
    if w.ndim != 2 or not w.flags.c_contiguous:
        raise ValueError(f"w must be a C-contiguous matrix, got shape {list(w.shape)}")
    x = np.asarray(x)
    if x.ndim == 1:
        x = x[None]
    if x.dtype != np.float32 or x.ndim != 2 or not x.flags.c_contiguous:
        x = np.ascontiguousarray(x, dtype=np.float32)
        if x.ndim != 2:
            raise ValueError(f"x must be [T, K], got shape {list(x.shape)}")
    n, k = w.shape
    if x.shape[1] != k:
        raise ValueError(f"x has {x.shape[1]} columns, w has {k}")
    if out is None:
        out = np.empty((x.shape[0], n), np.float32)
    elif out.dtype != np.float32 or out.shape != (x.shape[0], n) or not out.flags.c_contiguous:
        raise ValueError(f"out must be float32 C-contiguous of shape {[x.shape[0], n]}")
    if x.shape[0] and n:
        matmul_into(x, w, out)
    return out
