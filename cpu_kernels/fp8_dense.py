"""Dense ``out[T, N] = x[T, K] @ W[N, K].T`` on the CPU with ``W`` in block-FP8 rows (storage ``fp8_block`` of
:mod:`freetoken.ops.dense`: each row its ceil(K/128) float32 scales, then its K e4m3fn codes; K a multiple of 16).

* Few tokens (T <= :data:`freetoken.cpu_kernels.gemv.GEMV_MAX_TOKENS`), :func:`_fp8_gemv_kernel`: a ``prange`` over
  blocks of :data:`~freetoken.cpu_kernels.gemv.ROWS` output rows (grouped: each group of rows reads its own slice of
  x, the per-head products of latent attention's absorbed ``kv_b_proj`` in one call); each row read once per call
  through the fp8 row dots of the expert forward (:mod:`freetoken.cpu_kernels.moe_fp8`: codes decoded 16 at a time
  with ``vcvtph2ps``, 16-lane partial sums per 128-block scaled lane by lane), 4 tokens per pass, then 2, then 1.
* More tokens, :func:`_fp8_gemm_kernel`: tiles of 16 rows decoded once (table lookup times the scale, the same
  float32 values as :func:`freetoken.models.qmatrix.dequantize_blocks`) into a float32 buffer of the thread and
  multiplied by every token of an L2-resident panel of ``x`` with the float product's micro-kernel
  (:mod:`freetoken.cpu_kernels.gemm_panel`), as the GGUF blocks are in :mod:`freetoken.cpu_kernels.qgemv`.

Accumulation is float32. The GEMV scales a block's sum (the decode is exact); the tiled product multiplies decoded
weights: the two round differently, by float32 rounding only.
"""

from __future__ import annotations

import numba as nb
import numpy as np
from freetoken.cpu_kernels.gemm_panel import PANEL_ROWS, TOKENS, panel_product, widen_panel
from freetoken.cpu_kernels.gemv import GEMV_MAX_TOKENS, PANEL_BYTES, ROWS, SERIAL_MACS
from freetoken.cpu_kernels.moe_fp8 import fp8_dot1, fp8_dot2, fp8_dot4
from freetoken.cpu_kernels.moe_memory import addr
from freetoken.cpu_kernels.serial_copy import serial_copy
from freetoken.cpu_kernels.widen import FASTMATH

from freetoken.formats.fp8_block import E4M3_VALUES

__all__ = ["fp8_dequantize_rows", "fp8_grouped_into", "fp8_matmul_into"]

#: Weights per scale along a row (FP8_BLOCK of freetoken.ops.dense).
BLOCK = 128
_U64 = np.uint64


@nb.njit(error_model="numpy", parallel=True, cache=True, boundscheck=False)
def _fp8_gemv_kernel(x, rows, out, k, group_rows):
    """out[t, r] = row r . x[t, g*K:(g+1)*K] with g = r // group_rows, for every row and token; rows uint8
    [N, K + 4 * ceil(K/128)], x float32 [T, G*K] (G = N / group_rows; 1 for a plain product), out [T, N]."""
    t_count = x.shape[0]
    n, rb = rows.shape
    scales = _U64(4 * ((k + BLOCK - 1) // BLOCK))
    base, xa, kk, ts = addr(rows), addr(x), _U64(k), _U64(x.shape[1])  # ts: one token's x elements
    for blk in nb.prange((n + ROWS - 1) // ROWS):
        for r in range(blk * ROWS, min(blk * ROWS + ROWS, n)):
            s = base + _U64(r) * _U64(rb)
            w = s + scales
            g = _U64(r // group_rows) * kk
            t = 0
            while t_count - t >= 4:
                o = _U64(t) * ts + g
                y0, y1, y2, y3 = fp8_dot4(w, s, xa, o, o + ts, o + _U64(2) * ts, o + _U64(3) * ts, kk)
                out[t, r], out[t + 1, r], out[t + 2, r], out[t + 3, r] = y0, y1, y2, y3
                t += 4
            if t_count - t >= 2:
                o = _U64(t) * ts + g
                y0, y1 = fp8_dot2(w, s, xa, o, o + ts, kk)
                out[t, r], out[t + 1, r] = y0, y1
                t += 2
            if t < t_count:
                out[t, r] = fp8_dot1(w, s, xa, _U64(t) * ts + g, kk)


#: :func:`_fp8_gemv_kernel` without threads, for products below :data:`freetoken.cpu_kernels.gemv.SERIAL_MACS`.
_fp8_gemv_serial = serial_copy(_fp8_gemv_kernel)


@nb.njit(error_model="numpy", inline="always", fastmath=FASTMATH)
def _decode_row(rows, sc, r, k, table, dst, i):
    """dst[i, :K] = the float32 weights of row r: ``table[code] * scale`` (one float32 rounding); ``sc`` is
    ``rows`` viewed as float32 (a row's scales are its first ceil(K/128) values)."""
    nkb = (k + BLOCK - 1) // BLOCK
    for b in range(nkb):
        s = sc[r, b]
        j1 = min(k, (b + 1) * BLOCK)
        for j in range(b * BLOCK, j1):
            dst[i, j] = table[rows[r, 4 * nkb + j]] * s


@nb.njit(error_model="numpy", parallel=True, cache=True, boundscheck=False)
def _fp8_dequant_kernel(rows, sc, r0, table, out):
    """out[i] = the float32 weights of row r0 + i."""
    n_out, k = out.shape
    for i in nb.prange(n_out):
        _decode_row(rows, sc, r0 + i, k, table, out, i)


@nb.njit(error_model="numpy", parallel=True, cache=True, boundscheck=False, fastmath=FASTMATH)
def _fp8_gemm_kernel(x, rows, sc, table, out, nthreads):
    """out = x @ decoded(rows).T for many tokens: per thread, tiles of :data:`PANEL_ROWS` rows decoded once into a
    float32 buffer, transposed into a panel and multiplied by every token of ``x`` (an L2-resident panel)."""
    t_count, k = x.shape
    n = rows.shape[0]
    ntile = (n + PANEL_ROWS - 1) // PANEL_ROWS
    for wk in nb.prange(nthreads):
        w = np.zeros((PANEL_ROWS, k), np.float32)
        panel = np.empty((k, PANEL_ROWS), np.float32)
        toks = np.empty(TOKENS, np.int64)
        acc = np.empty((t_count, PANEL_ROWS), np.float32)
        for tile in range(wk * ntile // nthreads, (wk + 1) * ntile // nthreads):
            r0 = tile * PANEL_ROWS
            nr = min(PANEL_ROWS, n - r0)
            for i in range(nr):
                _decode_row(rows, sc, r0 + i, k, table, w, i)
            widen_panel(w, 0, panel)
            panel_product(x, panel, r0, nr, out, toks, acc)


def _aligned(rows: np.ndarray) -> np.ndarray:
    if rows.dtype != np.uint8 or rows.ndim != 2:
        raise TypeError(f"fp8 rows must be a uint8 matrix, got {rows.dtype} {list(rows.shape)}")
    if not rows.flags.c_contiguous or rows.ctypes.data % 4:
        rows = np.ascontiguousarray(rows).copy()  # the scales are read as float32
    return rows


def _gemv(x, rows, out, k, group_rows) -> None:
    if rows.shape[0] * k * x.shape[0] < SERIAL_MACS:
        _fp8_gemv_serial(x, rows, out, k, group_rows)
    else:
        _fp8_gemv_kernel(x, rows, out, k, group_rows)


def fp8_grouped_into(x: np.ndarray, rows: np.ndarray, out: np.ndarray) -> None:
    """``out[t, g] = x[t, g] @ decoded(rows[g*N:(g+1)*N]).T`` for every group g, with no shape checks (the caller's):
    x float32 [T, G, K] (K a multiple of 16), rows uint8 [G*N, K + 4 * ceil(K/128)], out float32 [T, G, N], all
    C-contiguous, T >= 1. Few tokens: one GEMV call for all groups; more: the tiled product per group."""
    rows = _aligned(rows)
    t_count, groups, k = x.shape
    n = out.shape[2]
    if t_count <= GEMV_MAX_TOKENS:
        _gemv(x.reshape(t_count, groups * k), rows, out.reshape(t_count, groups * n), k, n)
        return
    part = np.empty((t_count, n), np.float32)
    for g in range(groups):
        fp8_matmul_into(np.ascontiguousarray(x[:, g]), rows[g * n:(g + 1) * n], part)
        out[:, g] = part


def fp8_dequantize_rows(rows: np.ndarray, k: int, r0: int = 0, out: np.ndarray | None = None) -> np.ndarray:
    """Rows ``r0 .. r0 + len(out)`` as float32 [rows, K] in ``out`` (default: all rows from r0, a new array)."""
    rows = _aligned(rows)
    if out is None:
        out = np.empty((rows.shape[0] - r0, k), np.float32)
    if out.shape[0]:
        _fp8_dequant_kernel(rows, rows.view(np.float32), r0, E4M3_VALUES, out)
    return out


def fp8_matmul_into(x: np.ndarray, rows: np.ndarray, out: np.ndarray) -> None:
    """``out = x @ decoded(rows).T`` with no shape checks (the caller's): x float32 [T, K] (K a multiple of 16),
    rows uint8 [N, K + 4 * ceil(K/128)], out float32 [T, N], all C-contiguous, T >= 1."""
    rows = _aligned(rows)
    t_count, k = x.shape
    if t_count <= GEMV_MAX_TOKENS:
        _gemv(x, rows, out, k, rows.shape[0])
        return
    panel = max(4, PANEL_BYTES // (4 * max(1, k)) // 4 * 4)
    nthreads = nb.get_num_threads()
    sc = rows.view(np.float32)
    for t0 in range(0, t_count, panel):  # out rows of a panel are a C-contiguous block
        _fp8_gemm_kernel(x[t0:t0 + panel], rows, sc, E4M3_VALUES, out[t0:t0 + panel], nthreads)
