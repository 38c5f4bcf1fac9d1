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
* More tokens, :func:`_gemm_kernel`: compute bound. Register tiles of 4 rows x 4 tokens (16 vector accumulators: 8
  loads per 16 FMAs), a ``prange`` over blocks of 4 rows, tokens in panels of about 1 MiB of ``x`` (L2-resident
  while every row block streams past it).

One kernel source serves the three storage types: it is compiled per weight dtype, and float16 (which Numba cannot
type) travels as its ``int16`` bits, bf16 as ``uint16`` bits. Measured on a 2-core Zen 5 with the projections of a
16-layer Qwen3-MoE-like model (hidden 1024, 94 MB in f16): one token 1.5-1.9 ms (50-63 GB/s; NumPy's float32
product on one BLAS thread: 5.6 ms); 64 tokens 19 ms (~300 GFLOP/s; one BLAS thread: 58 ms).
"""

from __future__ import annotations

import numba as nb
import numpy as np
from freetoken.cpu_kernels.rms_norm import rms_norm_rows
from freetoken.cpu_kernels.rope import rope_rows
from freetoken.cpu_kernels.routing import softmax_topk_rows
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

__all__ = ["GEMV_MAX_TOKENS", "gemv", "matmul_into", "rms_norm_rows", "rope_rows", "softmax_topk_rows",
           "storage_view", "widen"]

#: LLVM fast-math flags of the products: reassociation (vectorised reductions) and contraction (FMA); NaN and inf
#: propagate.
FASTMATH = {"reassoc", "contract", "nsz", "arcp"}
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


@intrinsic
def _widen(typingctx, v):
    """One stored weight -> float32: float32 as is, uint16 as bf16 bits, int16 as IEEE half bits."""
    if v not in (types.float32, types.uint16, types.int16):
        return None

    def codegen(context, builder, signature, args):
        (a,) = args
        if signature.args[0] == types.float32:
            return a
        if signature.args[0] == types.int16:  # fpext half: vcvtph2ps once vectorised
            return builder.fpext(builder.bitcast(a, ir.HalfType()), ir.FloatType())
        bits = builder.shl(builder.zext(a, ir.IntType(32)), ir.Constant(ir.IntType(32), 16))
        return builder.bitcast(bits, ir.FloatType())
    return types.float32(v), codegen


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


@nb.njit(fastmath=FASTMATH, inline="always")
def tile_rows4(x, w, i, out, r, t_count, k):
    """out[:, r:r+4] = x @ widen(w[i:i+4]).T: register tiles of 4 rows x 4 tokens (16 accumulators), the last
    T % 4 tokens as 4 rows x 1 token. Shared by :func:`_gemm_kernel` (i = r) and the quantized product's
    dequantized panels (:mod:`freetoken.cpu_kernels.qgemv`)."""
    t = 0
    while t_count - t >= 4:
        a00 = a01 = a02 = a03 = a10 = a11 = a12 = a13 = _F32(0.0)
        a20 = a21 = a22 = a23 = a30 = a31 = a32 = a33 = _F32(0.0)
        for c in range(k):
            w0 = _widen(w[i, c])
            w1 = _widen(w[i + 1, c])
            w2 = _widen(w[i + 2, c])
            w3 = _widen(w[i + 3, c])
            x0 = x[t, c]
            x1 = x[t + 1, c]
            x2 = x[t + 2, c]
            x3 = x[t + 3, c]
            a00 += w0 * x0
            a01 += w0 * x1
            a02 += w0 * x2
            a03 += w0 * x3
            a10 += w1 * x0
            a11 += w1 * x1
            a12 += w1 * x2
            a13 += w1 * x3
            a20 += w2 * x0
            a21 += w2 * x1
            a22 += w2 * x2
            a23 += w2 * x3
            a30 += w3 * x0
            a31 += w3 * x1
            a32 += w3 * x2
            a33 += w3 * x3
        out[t, r] = a00
        out[t + 1, r] = a01
        out[t + 2, r] = a02
        out[t + 3, r] = a03
        out[t, r + 1] = a10
        out[t + 1, r + 1] = a11
        out[t + 2, r + 1] = a12
        out[t + 3, r + 1] = a13
        out[t, r + 2] = a20
        out[t + 1, r + 2] = a21
        out[t + 2, r + 2] = a22
        out[t + 3, r + 2] = a23
        out[t, r + 3] = a30
        out[t + 1, r + 3] = a31
        out[t + 2, r + 3] = a32
        out[t + 3, r + 3] = a33
        t += 4
    while t < t_count:
        a0 = a1 = a2 = a3 = _F32(0.0)
        for c in range(k):
            xv = x[t, c]
            a0 += _widen(w[i, c]) * xv
            a1 += _widen(w[i + 1, c]) * xv
            a2 += _widen(w[i + 2, c]) * xv
            a3 += _widen(w[i + 3, c]) * xv
        out[t, r] = a0
        out[t, r + 1] = a1
        out[t, r + 2] = a2
        out[t, r + 3] = a3
        t += 1


@nb.njit(parallel=True, cache=True, boundscheck=False, fastmath=FASTMATH)
def _gemm_kernel(x, w, out):
    """The same product in register tiles of 4 rows x 4 tokens (for T beyond a few tokens); the last N % 4 rows and
    T % 4 tokens in narrower tiles."""
    t_count, k = x.shape
    n = w.shape[0]
    for blk in nb.prange((n + 3) // 4):
        r = blk * 4
        if r + 4 > n:  # the last N % 4 rows
            for rr in range(r, n):
                _row_tokens(x, w, out, rr, 0, t_count, k)
            continue
        tile_rows4(x, w, r, out, r, t_count, k)


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
    if t_count <= panel:
        _gemm_kernel(x, w, out)
        return
    for t0 in range(0, t_count, panel):  # out rows of a panel are a C-contiguous block
        _gemm_kernel(x[t0:t0 + panel], w, out[t0:t0 + panel])


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
