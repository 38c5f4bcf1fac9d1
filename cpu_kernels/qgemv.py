"""Dense ``out[T, N] = x[T, K] @ W[N, K].T`` on the CPU with ``W`` in GGUF Q8_0 / Q4_0 blocks
(:mod:`freetoken.models.qmatrix`) or GGUF k-quant super-blocks (Q4_K, Q5_K, Q6_K, IQ4_XS: the file's rows verbatim,
uint8 [N, K/256 * 144 / 176 / 210 / 136]): the quantized counterpart of :mod:`freetoken.cpu_kernels.gemv`.

* Few tokens (T <= :data:`freetoken.cpu_kernels.gemv.GEMV_MAX_TOKENS`), :func:`_qgemv_kernel`: a ``prange`` over
  blocks of output rows (tiny products on the calling thread); each row's blocks are read once per call (groups of
  4 tokens, then single tokens). Per block the 32 weights ``d * q`` are made in vector registers (Q4_0 nibbles
  unpacked in 8-bit lanes, :func:`_nibble`) and multiplied into 32 float32 lane sums per token, summed once at the
  end of the row (no horizontal sum per block). Measured on the 2-core Xeon (AVX-512, one thread) for a 1536 x 1024
  Q4_0 matrix and one token: 0.23-0.4 ms, 5-9x faster than the per-block dot products it replaces.
* More tokens, :func:`_qgemm_kernel`: a ``prange`` over tiles of :data:`QTILE_ROWS` block rows, each decoded once
  (exactly) into a float32 buffer of the thread and multiplied by every token of an L2-resident panel of ``x`` with
  the float product's micro-kernel (:mod:`freetoken.cpu_kernels.gemm_panel`): no dequantized copy of the whole
  matrix, and the same sums as the float product of the decoded values.

Each row's blocks are prefetched ``PREFETCH_BYTES`` ahead of their decode (1536 x 2048 matrices cycled through
120 MB, one token, 2 threads, AVX-512 EPYC: Q8_0 7.3 -> 15.3 GB/s, Q4_0 4.4 -> 8.8 GB/s; Q4_0 is then bound by its
decode arithmetic, 12.4 GB/s with the matrices in cache).

The k-quants decode with the expert kernels' intrinsics (:mod:`freetoken.cpu_kernels.moe_kquant`: one decode of
each format on the CPU, here addressing GGUF rows): few tokens, :func:`_kq_gemv_kernel` (each row's super-blocks
decoded once in registers for up to 4 tokens, two rows per call for a single token); more tokens, the tiles of
:func:`_qgemm_kernel` decoded by the same intrinsic into the thread's float32 buffer.

Accumulation is float32. The block rows travel as two views of one buffer: ``int16`` (the float16 scales: every
block starts at an even byte) and ``int8`` (the quants).
"""

from __future__ import annotations

import numba as nb
import numpy as np
from freetoken.cpu_kernels.fp8_dense import fp8_dequantize_rows, fp8_matmul_into
from freetoken.cpu_kernels.gemm_panel import PANEL_ROWS, TOKENS, panel_product, widen_panel
from freetoken.cpu_kernels.gemv import GEMV_MAX_TOKENS, PANEL_BYTES, ROWS, SERIAL_MACS
from freetoken.cpu_kernels.moe_kquant import (
    FMT_IQ4_XS,
    FMT_Q4_K,
    FMT_Q5_K,
    FMT_Q6_K,
    kq_decode,
    kq_dot1,
    kq_dot1x2,
    kq_dot4,
)
from freetoken.cpu_kernels.moe_memory import PREFETCH_BYTES, addr, prefetch
from freetoken.cpu_kernels.serial_copy import serial_copy
from freetoken.cpu_kernels.widen import FASTMATH, _widen
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from freetoken.formats.table import DENSE_BLOCKS

__all__ = ["KQUANT_BLOCK_BYTES", "QTILE_ROWS", "dequantize_rows", "qmatmul_into"]

#: Block rows per tile of the many-token product (decoded once into a float32 buffer of the thread, then used
#: by every token of the panel).
QTILE_ROWS = PANEL_ROWS

#: The k-quant storages: bytes per GGUF super-block of 256 weights.
KQUANT_BLOCK_BYTES = {name: nbytes for name, (weights, nbytes) in DENSE_BLOCKS.items() if weights == 256}
# Kernel codes of the storages: q8_0 and q4_0 (32-weight blocks, decoded here), the k-quants (their expert format
# codes, decoded by freetoken.cpu_kernels.moe_kquant).
_Q8_0, _Q4_0 = 0, 1
_KINDS = {"q8_0": _Q8_0, "q4_0": _Q4_0, "q4_k": FMT_Q4_K, "q5_k": FMT_Q5_K, "q6_k": FMT_Q6_K, "iq4_xs": FMT_IQ4_XS}

_F32 = np.float32


@intrinsic
def _nibble(typingctx, v, high):
    """A Q4_0 quant byte (int8) -> float32 of its low (``high`` False) or high nibble minus 8, computed in 8-bit
    lanes (Numba's integer arithmetic would widen to int64 and vectorise 4x narrower)."""
    if v != types.int8 or not isinstance(high, types.BooleanLiteral):
        return None
    hi = high.literal_value

    def codegen(context, builder, signature, args):
        i8 = ir.IntType(8)
        a = builder.lshr(args[0], ir.Constant(i8, 4)) if hi else builder.and_(args[0], ir.Constant(i8, 15))
        return builder.sitofp(builder.sub(a, ir.Constant(i8, 8)), ir.FloatType())
    return types.float32(v, high), codegen


@nb.njit(error_model="numpy", fastmath=FASTMATH, inline="always")
def _qrow1(q8, s16, r, x, t, nblk, acc, q4):
    """sum_i w[r, i] * x[t, i] for one row r of blocks: per block, the 32 weights d * q are made in registers and
    multiplied into 32 lane sums ``acc[0:32]`` (no per-block horizontal sum); the lanes are summed at the end."""
    for j in range(32):
        acc[j] = 0.0
    ahead = addr(q8) + np.uint64(r * q8.shape[1] + PREFETCH_BYTES)
    if q4:
        for b in range(nblk):
            prefetch(ahead + np.uint64(b * 18))
            d = _widen(s16[r, b * 9])
            o = b * 18 + 2
            xb = b * 32
            for j in range(16):
                byte = q8[r, o + j]
                acc[j] += (d * _nibble(byte, False)) * x[t, xb + j]
                acc[16 + j] += (d * _nibble(byte, True)) * x[t, xb + 16 + j]
    else:
        for b in range(nblk):
            prefetch(ahead + np.uint64(b * 34))
            d = _widen(s16[r, b * 17])
            o = b * 34 + 2
            xb = b * 32
            for j in range(32):
                acc[j] += (d * _F32(q8[r, o + j])) * x[t, xb + j]
    s = _F32(0.0)
    for j in range(32):
        s += acc[j]
    return s


@nb.njit(error_model="numpy", fastmath=FASTMATH, inline="always")
def _qrow4(q8, s16, r, x, t, nblk, acc, out, q4):
    """out[t:t+4, r]: :func:`_qrow1` for 4 tokens at once, each weight made once and used 4 times (lane sums
    ``acc[32 * u : 32 * u + 32]`` for token t + u)."""
    for j in range(128):
        acc[j] = 0.0
    ahead = addr(q8) + np.uint64(r * q8.shape[1] + PREFETCH_BYTES)
    if q4:
        for b in range(nblk):
            prefetch(ahead + np.uint64(b * 18))
            d = _widen(s16[r, b * 9])
            o = b * 18 + 2
            xb = b * 32
            for j in range(16):
                byte = q8[r, o + j]
                lo = d * _nibble(byte, False)
                hi = d * _nibble(byte, True)
                acc[j] += lo * x[t, xb + j]
                acc[16 + j] += hi * x[t, xb + 16 + j]
                acc[32 + j] += lo * x[t + 1, xb + j]
                acc[48 + j] += hi * x[t + 1, xb + 16 + j]
                acc[64 + j] += lo * x[t + 2, xb + j]
                acc[80 + j] += hi * x[t + 2, xb + 16 + j]
                acc[96 + j] += lo * x[t + 3, xb + j]
                acc[112 + j] += hi * x[t + 3, xb + 16 + j]
    else:
        for b in range(nblk):
            prefetch(ahead + np.uint64(b * 34))
            d = _widen(s16[r, b * 17])
            o = b * 34 + 2
            xb = b * 32
            for j in range(32):
                v = d * _F32(q8[r, o + j])
                acc[j] += v * x[t, xb + j]
                acc[32 + j] += v * x[t + 1, xb + j]
                acc[64 + j] += v * x[t + 2, xb + j]
                acc[96 + j] += v * x[t + 3, xb + j]
    for u in range(4):
        s = _F32(0.0)
        for j in range(32):
            s += acc[32 * u + j]
        out[t + u, r] = s


@nb.njit(error_model="numpy", parallel=True, cache=True, boundscheck=False, fastmath=FASTMATH)
def _qgemv_kernel(x, s16, q8, out, q4):
    """out[t, r] = sum over blocks and lanes of d * q * x; x [T, K], s16/q8 the block rows [N, *], out [T, N]."""
    t_count, k = x.shape
    n = q8.shape[0]
    nblk = k // 32
    for blk in nb.prange((n + ROWS - 1) // ROWS):
        acc = np.empty(128, np.float32)
        for r in range(blk * ROWS, min(blk * ROWS + ROWS, n)):
            t = 0
            while t_count - t >= 4:
                _qrow4(q8, s16, r, x, t, nblk, acc, out, q4)
                t += 4
            while t < t_count:
                out[t, r] = _qrow1(q8, s16, r, x, t, nblk, acc, q4)
                t += 1


#: :func:`_qgemv_kernel` without threads, for products below :data:`freetoken.cpu_kernels.gemv.SERIAL_MACS`.
_qgemv_serial = serial_copy(_qgemv_kernel)


@nb.njit(error_model="numpy", parallel=True, cache=True, boundscheck=False, fastmath=FASTMATH)
def _kq_gemv_kernel(x, q8, out, kind):
    """out[t, r] = the k-quant row r of ``q8`` (GGUF super-blocks) dotted with x[t]: a ``prange`` over blocks of
    ``ROWS`` rows; 4 tokens per row read, then one at a time (a single token: two rows per read)."""
    t_count, k = x.shape
    n = q8.shape[0]
    wa, xa = addr(q8), addr(x)
    for blk in nb.prange((n + ROWS - 1) // ROWS):
        r = blk * ROWS
        r_end = min(r + ROWS, n)
        while r < r_end:
            if t_count == 1 and r + 1 < r_end:
                out[0, r], out[0, r + 1] = kq_dot1x2(kind, True, wa, wa, r, k, xa, 0)
                r += 2
                continue
            t = 0
            while t_count - t >= 4:
                a = kq_dot4(kind, True, wa, wa, r, k, xa, t * k, (t + 1) * k, (t + 2) * k, (t + 3) * k)
                for u in range(4):
                    out[t + u, r] = a[u]
                t += 4
            while t < t_count:
                out[t, r] = kq_dot1(kind, True, wa, wa, r, k, xa, t * k)
                t += 1
            r += 1


#: :func:`_kq_gemv_kernel` without threads, for products below :data:`freetoken.cpu_kernels.gemv.SERIAL_MACS`.
_kq_gemv_serial = serial_copy(_kq_gemv_kernel)


@nb.njit(error_model="numpy", parallel=True, cache=True, boundscheck=False)
def _dequant_kernel(s16, q8, r0, out, kind):
    """out[i] = the float32 weights of block row r0 + i (exact: d * q)."""
    rows, k = out.shape
    if kind >= FMT_Q4_K:
        for i in nb.prange(rows):
            kq_decode(kind, True, addr(q8), addr(q8), r0 + i, k, addr(out[i]))
        return
    q4 = kind == _Q4_0
    bb = 18 if q4 else 34
    hw = bb // 2
    for i in nb.prange(rows):
        r = r0 + i
        for b in range(k // 32):
            d = _widen(s16[r, b * hw])
            o = b * bb + 2
            if q4:
                for j in range(16):
                    byte = np.int32(q8[r, o + j]) & 0xFF
                    out[i, b * 32 + j] = d * _F32((byte & 15) - 8)
                    out[i, b * 32 + 16 + j] = d * _F32((byte >> 4) - 8)
            else:
                for j in range(32):
                    out[i, b * 32 + j] = d * _F32(q8[r, o + j])


@nb.njit(error_model="numpy", fastmath=FASTMATH, inline="always")
def _dequant_row(s16, q8, r, dst, i, nblk, kind):
    """dst[i, :] = the float32 weights of block row r (exact)."""
    if kind >= FMT_Q4_K:
        kq_decode(kind, True, addr(q8), addr(q8), r, dst.shape[1], addr(dst[i]))
    elif kind == _Q4_0:
        for b in range(nblk):
            d = _widen(s16[r, b * 9])
            o = b * 18 + 2
            for j in range(16):
                byte = q8[r, o + j]
                dst[i, b * 32 + j] = d * _nibble(byte, False)
                dst[i, b * 32 + 16 + j] = d * _nibble(byte, True)
    else:
        for b in range(nblk):
            d = _widen(s16[r, b * 17])
            o = b * 34 + 2
            for j in range(32):
                dst[i, b * 32 + j] = d * _F32(q8[r, o + j])


@nb.njit(error_model="numpy", parallel=True, cache=True, boundscheck=False, fastmath=FASTMATH)
def _qgemm_kernel(x, s16, q8, out, kind, nthreads):
    """out = x @ dequantize(blocks).T for many tokens: a ``prange`` over tiles of :data:`QTILE_ROWS` block rows;
    each tile is decoded once (exactly) into a float32 buffer of the thread, transposed into a panel and multiplied
    by every token of ``x`` (an L2-resident panel) with the float product's micro-kernel
    (:func:`freetoken.cpu_kernels.gemm_panel.panel_product`): the same sums as the float product of the decoded
    values."""
    t_count, k = x.shape
    n = q8.shape[0]
    nblk = k // 32
    ntile = (n + QTILE_ROWS - 1) // QTILE_ROWS
    for wk in nb.prange(nthreads):
        w = np.zeros((QTILE_ROWS, k), np.float32)
        panel = np.empty((k, QTILE_ROWS), np.float32)
        toks = np.empty(TOKENS, np.int64)
        acc = np.empty((t_count, QTILE_ROWS), np.float32)
        for tile in range(wk * ntile // nthreads, (wk + 1) * ntile // nthreads):
            r0 = tile * QTILE_ROWS
            rows = min(QTILE_ROWS, n - r0)
            for i in range(rows):
                _dequant_row(s16, q8, r0 + i, w, i, nblk, kind)
            widen_panel(w, 0, panel)
            panel_product(x, panel, r0, rows, out, toks, acc)


def _views(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    if blocks.dtype != np.uint8 or blocks.ndim != 2:
        raise TypeError(f"blocks must be a uint8 matrix, got {blocks.dtype} {list(blocks.shape)}")
    if not blocks.flags.c_contiguous or blocks.ctypes.data % 2:
        blocks = np.ascontiguousarray(blocks).copy()  # the int16 view needs an even base
    return blocks.view(np.int16), blocks.view(np.int8)


def dequantize_rows(blocks: np.ndarray, kind: str, k: int, r0: int = 0, out: np.ndarray | None = None) -> np.ndarray:
    """Block rows ``r0 .. r0 + len(out)`` of ``kind`` ("q8_0", "q4_0", "q4_k", "q5_k", "q6_k", "iq4_xs";
    "fp8_block" rows go to :mod:`freetoken.cpu_kernels.fp8_dense`) as float32 [rows, K] in ``out`` (default: all
    rows from r0, a new array; its rows C-contiguous)."""
    if kind == "fp8_block":
        return fp8_dequantize_rows(blocks, k, r0, out)
    s16, q8 = _views(blocks)
    if out is None:
        out = np.empty((blocks.shape[0] - r0, k), np.float32)
    if out.shape[0]:
        _dequant_kernel(s16, q8, r0, out, _KINDS[kind])
    return out


def qmatmul_into(x: np.ndarray, blocks: np.ndarray, kind: str, out: np.ndarray) -> None:
    """``out = x @ dequantize(blocks).T`` with no shape checks (the caller's): x float32 [T, K] (K a multiple of 32;
    of 256 for the k-quants), blocks uint8 [N, K/32 * bytes] of ``kind`` ("q8_0", "q4_0"; the k-quants "q4_k",
    "q5_k", "q6_k", "iq4_xs": [N, K/256 * :data:`KQUANT_BLOCK_BYTES`]), out float32 [T, N], all C-contiguous, T >= 1
    ("fp8_block" rows go to :mod:`freetoken.cpu_kernels.fp8_dense`)."""
    if kind == "fp8_block":
        fp8_matmul_into(x, blocks, out)
        return
    code = _KINDS[kind]
    s16, q8 = _views(blocks)
    t_count, k = x.shape
    if t_count <= GEMV_MAX_TOKENS:
        serial = blocks.shape[0] * k * t_count < SERIAL_MACS
        if code >= FMT_Q4_K:
            (_kq_gemv_serial if serial else _kq_gemv_kernel)(x, q8, out, code)
        elif serial:
            _qgemv_serial(x, s16, q8, out, code == _Q4_0)
        else:
            _qgemv_kernel(x, s16, q8, out, code == _Q4_0)
        return
    panel = max(4, PANEL_BYTES // (4 * max(1, k)) // 4 * 4)
    nthreads = nb.get_num_threads()
    for t0 in range(0, t_count, panel):  # out rows of a panel are a C-contiguous block
        _qgemm_kernel(x[t0:t0 + panel], s16, q8, out[t0:t0 + panel], code, nthreads)

