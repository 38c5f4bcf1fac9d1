"""Per-format row kernels of the CPU expert forward: one row of an expert matrix dotted with 1, 2 or 4 token vectors.

Format codes and decode tables, the bf16 row dots in plain Numba (they vectorise as written), and the per-row
dispatch over every format (``row_dot*``), which the gate/up and down kernels (:mod:`freetoken.cpu_kernels.moe_kernels`)
inline. The nibble formats' dots are LLVM IR intrinsics (:mod:`freetoken.cpu_kernels.moe_nibble`), fp8_block's too
(:mod:`freetoken.cpu_kernels.moe_fp8`), and q8_0's and the k-quants' (:mod:`freetoken.cpu_kernels.moe_kquant`);
every access goes through raw addresses (:mod:`freetoken.cpu_kernels.moe_memory`).

K order: bf16, fp8_block and the GGUF block formats (q8_0, the k-quants) read the natural element order; the nibble
formats read "block split" order (each group of 32 elements as its 16 low nibbles, then its 16 high nibbles), which
for nvfp4/mxfp4/ds_fp4 (low nibble = even element) is :func:`block_split_perm` of the elements.
"""

from __future__ import annotations

import ml_dtypes
import numba as nb
import numpy as np
from freetoken.cpu_kernels.moe_fp8 import fp8_dot1, fp8_dot2, fp8_dot4
from freetoken.cpu_kernels.moe_kquant import FMT_Q8_0, kq_dot1, kq_dot1x2, kq_dot2, kq_dot4
from freetoken.cpu_kernels.moe_memory import addr, load_f32, load_u16
from freetoken.cpu_kernels.moe_nibble import (
    mx_dot1,
    mx_dot1x2,
    mx_dot2,
    mx_dot4,
    nv_dot1,
    nv_dot1x2,
    nv_dot2,
    nv_dot4,
    q4_dot1,
    q4_dot1x2,
    q4_dot2,
    q4_dot4,
)

from freetoken.formats.table import KERNEL_CODES

# Format codes of the kernels (mxfp4 and ds_fp4 share banks and kernel; the GGUF block formats' codes, FMT_Q8_0 and
# up, come from freetoken.cpu_kernels.moe_kquant: every code >= FMT_Q8_0 is one of its formats).
FMT_BF16 = KERNEL_CODES["bf16"]
FMT_FP8_BLOCK = KERNEL_CODES["fp8_block"]
FMT_NVFP4 = KERNEL_CODES["nvfp4"]
FMT_MXFP4 = KERNEL_CODES["mxfp4"]
FMT_Q4_0 = KERNEL_CODES["q4_0"]
FORMAT_CODES = KERNEL_CODES
#: Formats whose K order is block split relative to the elements (token vectors and h permuted).
SPLIT_FORMATS = (FMT_NVFP4, FMT_MXFP4)

_CODES = np.arange(256, dtype=np.uint8)
#: e2m1 value of each 4-bit code (bit 3 is the sign).
E2M1_TABLE = _CODES[:16].view(ml_dtypes.float4_e2m1fn).astype(np.float32)
#: q4_0 quant value (q - 8) of each 4-bit code.
Q4_TABLE = np.arange(-8, 8, dtype=np.float32)
#: float32 value of each e4m3fn byte (0x7F/0xFF are NaN).
E4M3_TABLE = _CODES.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
#: float32 value of each e8m0 byte, 2^(e - 127) (255 is NaN).
E8M0_TABLE = _CODES.view(ml_dtypes.float8_e8m0fnu).astype(np.float32)

#: LLVM fast-math flags of every kernel: reassociation (vectorised reductions) and contraction (FMA). No nnan/ninf:
#: NaN and inf propagate as in the reference.
FASTMATH = {"reassoc", "contract", "nsz", "arcp"}
_F32 = np.float32
_U32 = np.uint32
_U64 = np.uint64


def block_split_perm(k: int) -> np.ndarray:
    """``p`` with ``ordered[j] = element[p[j]]`` for the e2m1 formats (K a multiple of 32)."""
    j = np.arange(k)
    blk, r = j // 32, j % 32
    return blk * 32 + np.where(r < 16, 2 * r, 2 * (r - 16) + 1)


# ------------------------------------------------------------------------------ bf16 (Numba) and fp8_block (IR)

@nb.njit(error_model="numpy", inline="always")
def _bf16(w16, i):
    return _U32(_U32(load_u16(w16, i)) << _U32(16)).view(_F32)


@nb.njit(error_model="numpy", fastmath=FASTMATH, inline="always")
def _bf16_dot1(w16, src, x, o0, n):
    a0 = _F32(0.0)
    for i in range(n):
        a0 += _bf16(w16, src + i) * load_f32(x, o0 + i)
    return a0


@nb.njit(error_model="numpy", fastmath=FASTMATH, inline="always")
def _bf16_dot2(w16, src, x, o0, o1, n):
    a0 = a1 = _F32(0.0)
    for i in range(n):
        v = _bf16(w16, src + i)
        a0 += v * load_f32(x, o0 + i)
        a1 += v * load_f32(x, o1 + i)
    return a0, a1


@nb.njit(error_model="numpy", fastmath=FASTMATH, inline="always")
def _bf16_dot4(w16, src, x, o0, o1, o2, o3, n):
    a0 = a1 = a2 = a3 = _F32(0.0)
    for i in range(n):
        v = _bf16(w16, src + i)
        a0 += v * load_f32(x, o0 + i)
        a1 += v * load_f32(x, o1 + i)
        a2 += v * load_f32(x, o2 + i)
        a3 += v * load_f32(x, o3 + i)
    return a0, a1, a2, a3


@nb.njit(error_model="numpy", inline="always")
def _fp8_row(e, n, rows, k):
    """(first value index, first scale index, scale blocks per row) of row n of matrix e."""
    nkb = (k + _U64(127)) >> _U64(7)
    return (e * rows + n) * k, (e * ((rows + _U64(127)) >> _U64(7)) + (n >> _U64(7))) * nkb, nkb


@nb.njit(error_model="numpy", fastmath=FASTMATH, inline="always")
def _fp8_dot1(w8, s32, e, n, rows, k, x, o0):
    src, sb, _ = _fp8_row(e, n, rows, k)
    return fp8_dot1(w8 + src, s32 + sb * _U64(4), x, o0, k)


@nb.njit(error_model="numpy", fastmath=FASTMATH, inline="always")
def _fp8_dot2(w8, s32, e, n, rows, k, x, o0, o1):
    src, sb, _ = _fp8_row(e, n, rows, k)
    return fp8_dot2(w8 + src, s32 + sb * _U64(4), x, o0, o1, k)


@nb.njit(error_model="numpy", fastmath=FASTMATH, inline="always")
def _fp8_dot4(w8, s32, e, n, rows, k, x, o0, o1, o2, o3):
    src, sb, _ = _fp8_row(e, n, rows, k)
    return fp8_dot4(w8 + src, s32 + sb * _U64(4), x, o0, o1, o2, o3, k)


# ---------------------------------------------------------------------------------------------------- dispatch
# Row ``n`` of matrix ``e`` ([rows, k]) of a format, dotted with token vectors at element offsets ``o_t`` of the
# float32 array at address ``x`` (in the format's K order). ``w``, ``s``, ``g``: addresses of the matrix's value bank,
# scale bank and nvfp4 globals float32 [E] (a dummy where the format has none). ``fmt`` is a runtime value: the
# branches are per row, the loops inside them are format-specific.

@nb.njit(error_model="numpy", fastmath=FASTMATH, inline="always")
def _row(e, rows, n, k):
    return _U64(e) * _U64(rows) + _U64(n), k >> _U64(5)


@nb.njit(error_model="numpy", fastmath=FASTMATH, inline="always")
def row_dot1(fmt, w, s, g, e, n, rows, k, x, o0):
    k, o0 = _U64(k), _U64(o0)
    row, nblk = _row(e, rows, n, k)
    if fmt == FMT_MXFP4:
        res = mx_dot1(w + row * nblk * _U64(16), s + row * nblk, addr(E2M1_TABLE), addr(E8M0_TABLE), _F32(1.0), x,
                      o0, nblk)
    elif fmt == FMT_NVFP4:
        res = nv_dot1(w + row * nblk * _U64(16), s + row * nblk * _U64(2), addr(E2M1_TABLE), addr(E4M3_TABLE),
                      load_f32(g, _U64(e)), x, o0, nblk)
    elif fmt == FMT_Q4_0:
        res = q4_dot1(w + row * nblk * _U64(16), s + row * nblk * _U64(2), addr(Q4_TABLE), addr(E8M0_TABLE),
                      _F32(1.0), x, o0, nblk)
    elif fmt >= FMT_Q8_0:
        res = kq_dot1(fmt, False, w, s, row, k, x, o0)
    elif fmt == FMT_BF16:
        res = _bf16_dot1(w, row * k, x, o0, k)
    else:
        res = _fp8_dot1(w, s, _U64(e), _U64(n), _U64(rows), k, x, o0)
    return res


@nb.njit(error_model="numpy", fastmath=FASTMATH, inline="always")
def row_dot2(fmt, w, s, g, e, n, rows, k, x, o0, o1):
    k, o0, o1 = _U64(k), _U64(o0), _U64(o1)
    row, nblk = _row(e, rows, n, k)
    if fmt == FMT_MXFP4:
        res = mx_dot2(w + row * nblk * _U64(16), s + row * nblk, addr(E2M1_TABLE), addr(E8M0_TABLE), _F32(1.0), x,
                      o0, o1, nblk)
    elif fmt == FMT_NVFP4:
        res = nv_dot2(w + row * nblk * _U64(16), s + row * nblk * _U64(2), addr(E2M1_TABLE), addr(E4M3_TABLE),
                      load_f32(g, _U64(e)), x, o0, o1, nblk)
    elif fmt == FMT_Q4_0:
        res = q4_dot2(w + row * nblk * _U64(16), s + row * nblk * _U64(2), addr(Q4_TABLE), addr(E8M0_TABLE),
                      _F32(1.0), x, o0, o1, nblk)
    elif fmt >= FMT_Q8_0:
        res = kq_dot2(fmt, False, w, s, row, k, x, o0, o1)
    elif fmt == FMT_BF16:
        res = _bf16_dot2(w, row * k, x, o0, o1, k)
    else:
        res = _fp8_dot2(w, s, _U64(e), _U64(n), _U64(rows), k, x, o0, o1)
    return res


@nb.njit(error_model="numpy", fastmath=FASTMATH, inline="always")
def row_dot4(fmt, w, s, g, e, n, rows, k, x, o0, o1, o2, o3):
    k, o0, o1, o2, o3 = _U64(k), _U64(o0), _U64(o1), _U64(o2), _U64(o3)
    row, nblk = _row(e, rows, n, k)
    if fmt == FMT_MXFP4:
        res = mx_dot4(w + row * nblk * _U64(16), s + row * nblk, addr(E2M1_TABLE), addr(E8M0_TABLE), _F32(1.0), x,
                      o0, o1, o2, o3, nblk)
    elif fmt == FMT_NVFP4:
        res = nv_dot4(w + row * nblk * _U64(16), s + row * nblk * _U64(2), addr(E2M1_TABLE), addr(E4M3_TABLE),
                      load_f32(g, _U64(e)), x, o0, o1, o2, o3, nblk)
    elif fmt == FMT_Q4_0:
        res = q4_dot4(w + row * nblk * _U64(16), s + row * nblk * _U64(2), addr(Q4_TABLE), addr(E8M0_TABLE),
                      _F32(1.0), x, o0, o1, o2, o3, nblk)
    elif fmt >= FMT_Q8_0:
        res = kq_dot4(fmt, False, w, s, row, k, x, o0, o1, o2, o3)
    elif fmt == FMT_BF16:
        res = _bf16_dot4(w, row * k, x, o0, o1, o2, o3, k)
    else:
        res = _fp8_dot4(w, s, _U64(e), _U64(n), _U64(rows), k, x, o0, o1, o2, o3)
    return res


@nb.njit(error_model="numpy", fastmath=FASTMATH, inline="always")
def row_dot1x2(fmt, w, s, g, e, n, rows, k, x, o0):
    """Rows n and n + 1 with one token vector: (dot_n, dot_n+1). Nibble and GGUF block formats only."""
    k, o0 = _U64(k), _U64(o0)
    row, nblk = _row(e, rows, n, k)
    if fmt == FMT_MXFP4:
        res = mx_dot1x2(w + row * nblk * _U64(16), s + row * nblk, addr(E2M1_TABLE), addr(E8M0_TABLE), _F32(1.0),
                        x, o0, nblk)
    elif fmt == FMT_NVFP4:
        res = nv_dot1x2(w + row * nblk * _U64(16), s + row * nblk * _U64(2), addr(E2M1_TABLE), addr(E4M3_TABLE),
                        load_f32(g, _U64(e)), x, o0, nblk)
    elif fmt == FMT_Q4_0:
        res = q4_dot1x2(w + row * nblk * _U64(16), s + row * nblk * _U64(2), addr(Q4_TABLE), addr(E8M0_TABLE),
                        _F32(1.0), x, o0, nblk)
    elif fmt >= FMT_Q8_0:
        res = kq_dot1x2(fmt, False, w, s, row, k, x, o0)
    else:  # unreachable: the kernels pair rows for these formats only (bf16 already streams at full speed)
        res = _F32(np.nan), _F32(np.nan)
    return res
