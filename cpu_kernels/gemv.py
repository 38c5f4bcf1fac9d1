"""Dense ``out[T, N] = x[T, K] @ W[N, K].T`` on the CPU (the decoder's non-expert projections), and the small
per-token ops around them (RMSNorm, RoPE, MoE routing: re-exported from :mod:`~freetoken.cpu_kernels.rms_norm`,
:mod:`~freetoken.cpu_kernels.rope` and :mod:`~freetoken.cpu_kernels.routing`) as single Numba calls.

Public entry point of the products: :func:`gemv`. ``W`` is float32, float16 or bf16 (``uint16`` bits or
``ml_dtypes.bfloat16``); ``x`` and ``out`` are float32; accumulation is float32 (reassociated: vector lanes, FMA).

* Few tokens (T <= :data:`GEMV_MAX_TOKENS`): bound by reading the weights (two flops per weight and token). A
  ``prange`` over blocks of output rows (below :data:`SERIAL_MACS` multiply-adds the same loops on the calling
  thread); each row is read from memory once per token, widened to float32 in registers (bf16: a 16-bit shift; f16:
  ``vcvtph2ps``). K a multiple of 16 (nearly every model), :func:`_gemv16_kernel`: 8 rows per explicit-vector call
  (:func:`_dot_rows8`: 16-lane sums per row, the 8 rows' lanes added up together in one fixed order). Other K,
  :func:`_gemv_kernel`: Numba's loop vectoriser over each row (tokens in groups of 4, 2, 1). On a 2-core Zen 5 the
  vectoriser's kernel took 150-175 us for bf16 4096 x 192 (the bundled model's lm_head, L2-resident: ~10 GB/s,
  ~130 cycles per 192-value row) in most processes and 17-33 us in a few, without a cause we could pin down (its
  per-row horizontal sums and loop guards are the candidates); the explicit kernel took 19-25 us in every process,
  and 1.3-2x less than the vectoriser's at K = 1024-2048 measured in one process.
* More tokens, :func:`_gemm_kernel`: compute bound. A ``prange`` over 16-row panels of the weights, each widened
  once into float32 and multiplied by every token with the micro-kernel of :mod:`~freetoken.cpu_kernels.gemm_panel`
  (rows in vector lanes, one panel load per ``TOKENS`` FMAs); tokens in panels of about 1 MiB of ``x``.

One kernel source serves the three storage types: it is compiled per weight dtype, and float16 (which Numba cannot
type) travels as its ``int16`` bits, bf16 as ``uint16`` bits.
"""

from __future__ import annotations

import numba as nb
import numpy as np
from freetoken.cpu_kernels.gemm_panel import PANEL_ROWS, TOKENS, panel_product, widen_panel
from freetoken.cpu_kernels.lanes import F32, I32, I64, KINDS, V16F, fmuladd, lane_sums4, load_widened, row_ptr
from freetoken.cpu_kernels.moe_memory import PREFETCH_BYTES, addr, declare_prefetch, typed_ptr
from freetoken.cpu_kernels.rms_norm import rms_norm_rows
from freetoken.cpu_kernels.rope import rope_rows
from freetoken.cpu_kernels.routing import softmax_topk_rows
from freetoken.cpu_kernels.serial_copy import serial_copy
from freetoken.cpu_kernels.widen import FASTMATH, _widen
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

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


@nb.njit(error_model="numpy", fastmath=FASTMATH, inline="always")
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


#: Weight rows one :func:`_dot_rows8` call dots with a token.
LANE_ROWS = 8


@intrinsic
def _dot_rows8(typingctx, x, w, w_bytes, n16, out, sample):
    """``out[i] = sum_c x[c] * widen(w_i[c])`` for the 8 weight rows ``w_i`` (``w_bytes`` apart from address ``w``, of
    ``sample``'s type) and the float32 token ``x`` (``16 n16`` values at its address); ``out``: address of 8
    float32. Rows one after the other (the matrix read in memory order), each into two 16-lane sums (even and odd
    chunks: two FMA chains) added lane by lane; the 8 rows' lanes then added up 4 rows at a time in
    :func:`~freetoken.cpu_kernels.lanes.lane_sums4`'s fixed order (no horizontal sum per row). Every cache line
    is prefetched ``PREFETCH_BYTES`` ahead of its load: one sequential stream per thread left the hardware
    prefetchers short of DRAM's bandwidth (f16 1536x1024 matrices cycled through 144 MB, 2 threads, AVX-512 EPYC:
    8.8-9.6 GB/s without, 17-20 GB/s with, numpy's one-thread sum 14-15 GB/s)."""
    if sample not in KINDS or not all(isinstance(a, types.Integer) for a in (x, w, w_bytes, n16, out)):
        return None

    def codegen(context, builder, signature, args):
        x_, w_, wb_, n_, o_ = (context.cast(builder, a, t, types.uint64)
                               for a, t in zip(args[:5], signature.args[:5], strict=True))
        kind = KINDS[signature.args[5]]
        xp = typed_ptr(builder, x_, V16F)
        fma = fmuladd(builder)
        zero = ir.Constant(V16F, [0.0] * 16)
        two = ir.Constant(I64, 2)
        pairs = builder.udiv(n_, two)
        last = builder.sub(n_, ir.Constant(I64, 1))
        sums = []
        prefetch = declare_prefetch(builder.module)
        chunk_bytes = 64 if kind == "f32" else 32  # 16 stored values
        for i in range(LANE_ROWS):  # row after row: the matrix is read in memory order
            row_at = builder.add(w_, builder.mul(wb_, ir.Constant(I64, i)))
            rp = row_ptr(builder, kind, row_at)
            even, odd = (cgutils.alloca_once_value(builder, zero) for _ in range(2))
            with cgutils.for_range(builder, pairs) as loop:
                c0 = builder.mul(loop.index, two)
                ahead = builder.add(row_at, builder.add(builder.mul(c0, ir.Constant(I64, chunk_bytes)),
                                                        ir.Constant(I64, PREFETCH_BYTES)))
                for line in range(0, 2 * chunk_bytes, 64):  # the cache lines of this pair's chunks, further on
                    builder.call(prefetch, [typed_ptr(builder, builder.add(ahead, ir.Constant(I64, line)),
                                                      ir.IntType(8)),
                                            ir.Constant(I32, 0), ir.Constant(I32, 3), ir.Constant(I32, 1)])
                for a, c in ((even, c0), (odd, builder.add(c0, ir.Constant(I64, 1)))):
                    xv = builder.load(builder.gep(xp, [c]), align=4)
                    builder.store(builder.call(fma, [load_widened(builder, kind, rp, c), xv, builder.load(a)]), a)
            with builder.if_then(builder.icmp_unsigned("!=", builder.mul(pairs, two), n_)):  # odd n16: the last
                xv = builder.load(builder.gep(xp, [last]), align=4)
                builder.store(builder.call(fma, [load_widened(builder, kind, rp, last), xv, builder.load(even)]),
                              even)
            sums.append(builder.fadd(builder.load(even), builder.load(odd)))
        op = typed_ptr(builder, o_, F32)
        for quad in range(LANE_ROWS // 4):
            four = lane_sums4(builder, sums[4 * quad:4 * quad + 4])
            for i in range(4):
                builder.store(builder.extract_element(four, ir.Constant(I32, i)),
                              builder.gep(op, [ir.Constant(I64, 4 * quad + i)]))
        return context.get_dummy_value()
    return types.void(x, w, w_bytes, n16, out, sample), codegen


@nb.njit(error_model="numpy", parallel=True, cache=True, boundscheck=False, fastmath=FASTMATH)
def _gemv16_kernel(x, w, out):
    """:func:`_gemv_kernel` for K a multiple of 16: rows in groups of :data:`LANE_ROWS` through :func:`_dot_rows8`
    (explicit vector IR: no per-row horizontal sum, no alias-checked loop; the last N % 8 rows as there)."""
    t_count, k = x.shape
    n = w.shape[0]
    n16 = k // 16
    row_bytes = np.uint64(k * w.itemsize)
    for blk in nb.prange((n + ROWS - 1) // ROWS):
        r = blk * ROWS
        r_end = min(r + ROWS, n)
        while r + LANE_ROWS <= r_end:
            for t in range(t_count):
                _dot_rows8(addr(x) + np.uint64(t * k * 4), addr(w) + np.uint64(r) * row_bytes, row_bytes, n16,
                           addr(out) + np.uint64((t * n + r) * 4), w[0, 0])
            r += LANE_ROWS
        for rr in range(r, r_end):
            _row_tokens(x, w, out, rr, 0, t_count, k)


#: :func:`_gemv16_kernel` on the calling thread.
_gemv16_serial = serial_copy(_gemv16_kernel)


@nb.njit(error_model="numpy", parallel=True, cache=True, boundscheck=False, fastmath=FASTMATH)
def _gemv_kernel(x, w, out):
    """out[t, r] = sum_i widen(w[r, i]) * x[t, i]; x [T, K], w [N, K], out [T, N], all C-contiguous."""
    t_count, k = x.shape
    n = w.shape[0]
    for blk in nb.prange((n + ROWS - 1) // ROWS):
        for r in range(blk * ROWS, min(blk * ROWS + ROWS, n)):
            _row_tokens(x, w, out, r, 0, t_count, k)


#: :func:`_gemv_kernel` compiled without threads (``prange`` runs as ``range``): the same loops, the same sums.
_gemv_serial = serial_copy(_gemv_kernel)


@nb.njit(error_model="numpy", parallel=True, cache=True, boundscheck=False, fastmath=FASTMATH)
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
        lanes = x.shape[1] % 16 == 0  # nearly every model: the explicit-vector kernel
        if w.size * t_count < SERIAL_MACS:
            (_gemv16_serial if lanes else _gemv_serial)(x, w, out)
        else:
            (_gemv16_kernel if lanes else _gemv_kernel)(x, w, out)
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
