"""Dense ``out[T, N] = x[T, K] @ W[N, K].T`` on the CPU with ``W`` in GGUF Q8_0 / Q4_0 blocks
(:mod:`freetoken.models.qmatrix`): the quantized counterpart of :mod:`freetoken.cpu_kernels.gemv`.

* Few tokens (T <= :data:`freetoken.cpu_kernels.gemv.GEMV_MAX_TOKENS`), :func:`_qgemv_kernel`: a ``prange`` over
  blocks of output rows; each row's blocks are read once per call (groups of 4 tokens, then single tokens: later
  groups re-read the row from L1). Per block and token the integer quants are dotted with ``x`` in float32 and the
  sum is scaled by the block's ``d`` once; accumulation is float32.
* More tokens: row chunks are dequantized (exactly) into one reused float32 buffer and multiplied by the tiled
  float32 kernel of :mod:`freetoken.cpu_kernels.gemv`.

The block rows travel as two views of one buffer: ``int16`` (the float16 scales: every block starts at an even
byte) and ``int8`` (the quants).
"""

from __future__ import annotations

import numba as nb
import numpy as np
from freetoken.cpu_kernels.gemv import FASTMATH, GEMV_MAX_TOKENS, ROWS, _widen, matmul_into

__all__ = ["QCHUNK_ELEMENTS", "dequantize_rows", "qmatmul_into"]

#: Weights dequantized per chunk of the many-token product (bounds the float32 buffer: 16 MiB).
QCHUNK_ELEMENTS = 1 << 22

_F32 = np.float32


@nb.njit(fastmath=FASTMATH, inline="always")
def _block_dot(q8, r, o, x, t, xb, q4):
    """sum_j q_j * x[t, xb + j] over one block's 32 quants (bytes from q8[r, o]); q4: nibbles minus 8."""
    c = _F32(0.0)
    if q4:
        for j in range(16):
            byte = np.int32(q8[r, o + j]) & 0xFF
            c += _F32((byte & 15) - 8) * x[t, xb + j] + _F32((byte >> 4) - 8) * x[t, xb + 16 + j]
    else:
        for j in range(32):
            c += _F32(q8[r, o + j]) * x[t, xb + j]
    return c


@nb.njit(fastmath=FASTMATH, inline="always")
def _qrow_tokens(x, s16, q8, out, r, t_count, nblk, q4):
    bb = 18 if q4 else 34
    hw = bb // 2
    t = 0
    while t_count - t >= 4:
        a0 = a1 = a2 = a3 = _F32(0.0)
        for b in range(nblk):
            d = _widen(s16[r, b * hw])
            o = b * bb + 2
            xb = b * 32
            a0 += d * _block_dot(q8, r, o, x, t, xb, q4)
            a1 += d * _block_dot(q8, r, o, x, t + 1, xb, q4)
            a2 += d * _block_dot(q8, r, o, x, t + 2, xb, q4)
            a3 += d * _block_dot(q8, r, o, x, t + 3, xb, q4)
        out[t, r] = a0
        out[t + 1, r] = a1
        out[t + 2, r] = a2
        out[t + 3, r] = a3
        t += 4
    while t < t_count:
        a0 = _F32(0.0)
        for b in range(nblk):
            a0 += _widen(s16[r, b * hw]) * _block_dot(q8, r, b * bb + 2, x, t, b * 32, q4)
        out[t, r] = a0
        t += 1


@nb.njit(parallel=True, cache=True, boundscheck=False, fastmath=FASTMATH)
def _qgemv_kernel(x, s16, q8, out, q4):
    """out[t, r] = sum over blocks d * (q . x); x [T, K], s16/q8 the block rows [N, *], out [T, N]."""
    t_count, k = x.shape
    n = q8.shape[0]
    nblk = k // 32
    for blk in nb.prange((n + ROWS - 1) // ROWS):
        for r in range(blk * ROWS, min(blk * ROWS + ROWS, n)):
            _qrow_tokens(x, s16, q8, out, r, t_count, nblk, q4)


@nb.njit(parallel=True, cache=True, boundscheck=False)
def _dequant_kernel(s16, q8, r0, out, q4):
    """out[i] = the float32 weights of block row r0 + i (exact: d * q)."""
    rows, k = out.shape
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


def _views(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    if blocks.dtype != np.uint8 or blocks.ndim != 2:
        raise TypeError(f"blocks must be a uint8 matrix, got {blocks.dtype} {list(blocks.shape)}")
    if not blocks.flags.c_contiguous or blocks.ctypes.data % 2:
        blocks = np.ascontiguousarray(blocks).copy()  # the int16 view needs an even base
    return blocks.view(np.int16), blocks.view(np.int8)


def dequantize_rows(blocks: np.ndarray, kind: str, k: int, r0: int = 0, out: np.ndarray | None = None) -> np.ndarray:
    """Block rows ``r0 .. r0 + len(out)`` of ``kind`` ("q8_0" / "q4_0") as float32 [rows, K] in ``out`` (default:
    all rows from r0, a new array)."""
    s16, q8 = _views(blocks)
    if out is None:
        out = np.empty((blocks.shape[0] - r0, k), np.float32)
    if out.shape[0]:
        _dequant_kernel(s16, q8, r0, out, kind == "q4_0")
    return out


def qmatmul_into(x: np.ndarray, blocks: np.ndarray, kind: str, out: np.ndarray) -> None:
    """``out = x @ dequantize(blocks).T`` with no shape checks (the caller's): x float32 [T, K] (K a multiple of 32),
    blocks uint8 [N, K/32 * bytes] of ``kind``, out float32 [T, N], all C-contiguous, T >= 1."""
    q4 = kind == "q4_0"
    s16, q8 = _views(blocks)
    t_count, k = x.shape
    if t_count <= GEMV_MAX_TOKENS:
        _qgemv_kernel(x, s16, q8, out, q4)
        return
    n = blocks.shape[0]
    rows = max(1, QCHUNK_ELEMENTS // max(1, k))
    buf = np.empty((min(rows, n), k), np.float32)
    tmp = np.empty((t_count, min(rows, n)), np.float32) if rows < n else out
    for r0 in range(0, n, rows):
        r1 = min(n, r0 + rows)
        wc = buf[:r1 - r0]
        _dequant_kernel(s16, q8, r0, wc, q4)
        if tmp is out:
            matmul_into(x, wc, out)
        else:
            y = tmp[:, :r1 - r0] if r1 - r0 == tmp.shape[1] else np.empty((t_count, r1 - r0), np.float32)
            matmul_into(x, wc, y)
            out[:, r0:r1] = y

