"""Per-row dispatch of the reduced-activation row dots: the int8 dots (:mod:`freetoken.cpu_kernels.moe_int8`) of
the 4-bit formats, q8_0 and the k-quants, and the bf16 dots (:mod:`freetoken.cpu_kernels.moe_bf16act`) of bf16 and
fp8_block: the counterparts of the float path's ``row_dot*`` (:mod:`freetoken.cpu_kernels.moe_rows`), inlined by the
gate/up and down kernels (:func:`freetoken.cpu_kernels.moe_kernels.rows_dot`).

Token vectors are 8-bit rows ``xq = (qa, nc, dx, kp, cs)`` (:mod:`freetoken.cpu_kernels.q8_act`), or for
:data:`BF16_ACT_FORMATS` bf16 rows in ``qa`` (``kp`` bytes each), addressed by row index (``offs`` holds row indices
here, element offsets in the float path). K order as in the float path: q4_0 natural, the e2m1 formats block split,
bf16 and fp8_block natural.
"""

from __future__ import annotations

import numba as nb
import numpy as np
from freetoken.cpu_kernels.moe_bf16act import (
    bf16_bfa_dot1,
    bf16_bfa_dot2,
    bf16_bfa_dot4,
    fp8_bfa_dot1,
    fp8_bfa_dot2,
    fp8_bfa_dot4,
)
from freetoken.cpu_kernels.moe_int8 import (
    OFFSET,
    mx_q8_dot1,
    mx_q8_dot1x2,
    mx_q8_dot2,
    mx_q8_dot4,
    nv_q8_dot1,
    nv_q8_dot1x2,
    nv_q8_dot2,
    nv_q8_dot4,
    q4_q8_dot1,
    q4_q8_dot1x2,
    q4_q8_dot2,
    q4_q8_dot4,
    q8_q8_dot1,
    q8_q8_dot1x2,
    q8_q8_dot2,
    q8_q8_dot4,
)
from freetoken.cpu_kernels.moe_int8_kquant import OFFSETS as KQUANT_OFFSETS
from freetoken.cpu_kernels.moe_int8_kquant import kq_q8_dot1, kq_q8_dot1x2, kq_q8_dot2, kq_q8_dot4, kq_q8_repack16
from freetoken.cpu_kernels.moe_int8_tile import (
    k4_q8_tile,
    k6_q8_tile,
    mx_q8_repack16,
    mx_q8_tile,
    nv_q8_repack16,
    nv_q8_tile,
    q4_q8_repack16,
    q4_q8_tile,
)
from freetoken.cpu_kernels.moe_kquant import FMT_Q4_K, FMT_Q5_K, FMT_Q6_K
from freetoken.cpu_kernels.moe_memory import addr, load_f32
from freetoken.cpu_kernels.moe_rows import (
    E4M3_TABLE,
    E8M0_TABLE,
    FASTMATH,
    FMT_BF16,
    FMT_FP8_BLOCK,
    FMT_MXFP4,
    FMT_NVFP4,
    FMT_Q4_0,
    FMT_Q8_0,
    _fp8_row,
)

#: Format code -> the weight byte offset its activations' ``nc`` must carry: the formats with an int8 path.
Q8_OFFSETS = {FMT_Q4_0: OFFSET["q4"], FMT_MXFP4: OFFSET["mx"], FMT_NVFP4: OFFSET["nv"], FMT_Q8_0: OFFSET["q8"],
              **KQUANT_OFFSETS}

#: The formats whose reduced path takes bf16 token rows (:mod:`freetoken.cpu_kernels.moe_bf16act`): a row of K
#: values is 2 K bytes of bf16 bits in the rows of ``qa``, nothing in ``nc``, ``dx``, ``cs``.
BF16_ACT_FORMATS = (FMT_BF16, FMT_FP8_BLOCK)

_F32 = np.float32
_U64 = np.uint64


@nb.njit(error_model="numpy", inline="always")
def _row(e, rows, n):
    """Row n of matrix e in a bank of ``rows``-row matrices."""
    return _U64(e) * _U64(rows) + _U64(n)


@nb.njit(error_model="numpy", inline="always")
def _args(fmt, w, s, g, e, n, rows, k):
    """(value address, scale address, scale table address, global) of row n of matrix e, and its block count (the
    32-weight formats)."""
    row = _row(e, rows, n)
    nblk = _U64(k) >> _U64(5)
    if fmt == FMT_Q8_0:
        return w + row * nblk * _U64(32), s + row * nblk * _U64(2), addr(E8M0_TABLE), _F32(1.0), nblk
    wa = w + row * nblk * _U64(16)
    if fmt == FMT_MXFP4:
        return wa, s + row * nblk, addr(E8M0_TABLE), _F32(1.0), nblk
    if fmt == FMT_NVFP4:
        return wa, s + row * nblk * _U64(2), addr(E4M3_TABLE), load_f32(g, _U64(e)), nblk
    return wa, s + row * nblk * _U64(2), addr(E8M0_TABLE), _F32(1.0), nblk


@nb.njit(error_model="numpy", inline="always")
def _fp8_args(w, s, e, n, rows, k):
    """(code address, first scale address) of row n of fp8_block matrix e (the float path's row arithmetic)."""
    src, sb, _ = _fp8_row(_U64(e), _U64(n), _U64(rows), _U64(k))
    return w + src, s + sb * _U64(4)


@nb.njit(error_model="numpy", inline="always")
def _bf16_row(w, e, n, rows, k):
    return w + _row(e, rows, n) * _U64(k) * _U64(2)


@nb.njit(error_model="numpy", inline="always")
def _at(kp, r):
    """Element offset of bf16 token row ``r`` (rows of ``kp`` bytes)."""
    return _U64(r) * (_U64(kp) >> _U64(1))


@nb.njit(error_model="numpy", fastmath=FASTMATH, inline="always")
def row_q8_dot1(fmt, w, s, g, e, n, rows, k, xq, r0):
    qa, nc, dx, kp, cs = xq
    if fmt == FMT_FP8_BLOCK:
        wa, sa = _fp8_args(w, s, e, n, rows, k)
        return fp8_bfa_dot1(wa, sa, qa, _at(kp, r0), _U64(k))
    if fmt == FMT_BF16:
        return bf16_bfa_dot1(_bf16_row(w, e, n, rows, k), qa, _at(kp, r0), _U64(k))
    if fmt >= FMT_Q4_K:
        return kq_q8_dot1(fmt, w, s, _row(e, rows, n), _U64(k), qa, nc, dx, cs, kp, r0)
    wa, sa, st, gv, nblk = _args(fmt, w, s, g, e, n, rows, k)
    if fmt == FMT_Q8_0:
        return q8_q8_dot1(wa, sa, st, gv, qa, nc, dx, kp, r0, nblk)
    if fmt == FMT_MXFP4:
        return mx_q8_dot1(wa, sa, st, gv, qa, nc, dx, kp, r0, nblk)
    if fmt == FMT_NVFP4:
        return nv_q8_dot1(wa, sa, st, gv, qa, nc, dx, kp, r0, nblk)
    return q4_q8_dot1(wa, sa, st, gv, qa, nc, dx, kp, r0, nblk)


@nb.njit(error_model="numpy", fastmath=FASTMATH, inline="always")
def row_q8_dot2(fmt, w, s, g, e, n, rows, k, xq, r0, r1):
    qa, nc, dx, kp, cs = xq
    if fmt == FMT_FP8_BLOCK:
        wa, sa = _fp8_args(w, s, e, n, rows, k)
        return fp8_bfa_dot2(wa, sa, qa, _at(kp, r0), _at(kp, r1), _U64(k))
    if fmt == FMT_BF16:
        return bf16_bfa_dot2(_bf16_row(w, e, n, rows, k), qa, _at(kp, r0), _at(kp, r1), _U64(k))
    if fmt >= FMT_Q4_K:
        return kq_q8_dot2(fmt, w, s, _row(e, rows, n), _U64(k), qa, nc, dx, cs, kp, r0, r1)
    wa, sa, st, gv, nblk = _args(fmt, w, s, g, e, n, rows, k)
    if fmt == FMT_Q8_0:
        return q8_q8_dot2(wa, sa, st, gv, qa, nc, dx, kp, r0, r1, nblk)
    if fmt == FMT_MXFP4:
        return mx_q8_dot2(wa, sa, st, gv, qa, nc, dx, kp, r0, r1, nblk)
    if fmt == FMT_NVFP4:
        return nv_q8_dot2(wa, sa, st, gv, qa, nc, dx, kp, r0, r1, nblk)
    return q4_q8_dot2(wa, sa, st, gv, qa, nc, dx, kp, r0, r1, nblk)


@nb.njit(error_model="numpy", fastmath=FASTMATH, inline="always")
def row_q8_dot4(fmt, w, s, g, e, n, rows, k, xq, r0, r1, r2, r3):
    qa, nc, dx, kp, cs = xq
    if fmt == FMT_FP8_BLOCK:
        wa, sa = _fp8_args(w, s, e, n, rows, k)
        return fp8_bfa_dot4(wa, sa, qa, _at(kp, r0), _at(kp, r1), _at(kp, r2), _at(kp, r3), _U64(k))
    if fmt == FMT_BF16:
        return bf16_bfa_dot4(_bf16_row(w, e, n, rows, k), qa, _at(kp, r0), _at(kp, r1), _at(kp, r2),
                             _at(kp, r3), _U64(k))
    if fmt >= FMT_Q4_K:
        return kq_q8_dot4(fmt, w, s, _row(e, rows, n), _U64(k), qa, nc, dx, cs, kp, r0, r1, r2, r3)
    wa, sa, st, gv, nblk = _args(fmt, w, s, g, e, n, rows, k)
    if fmt == FMT_Q8_0:
        return q8_q8_dot4(wa, sa, st, gv, qa, nc, dx, kp, r0, r1, r2, r3, nblk)
    if fmt == FMT_MXFP4:
        return mx_q8_dot4(wa, sa, st, gv, qa, nc, dx, kp, r0, r1, r2, r3, nblk)
    if fmt == FMT_NVFP4:
        return nv_q8_dot4(wa, sa, st, gv, qa, nc, dx, kp, r0, r1, r2, r3, nblk)
    return q4_q8_dot4(wa, sa, st, gv, qa, nc, dx, kp, r0, r1, r2, r3, nblk)


@nb.njit(error_model="numpy", fastmath=FASTMATH, inline="always")
def row_q8_dot1x2(fmt, w, s, g, e, n, rows, k, xq, r0):
    qa, nc, dx, kp, cs = xq
    if fmt >= FMT_Q4_K:
        return kq_q8_dot1x2(fmt, w, s, _row(e, rows, n), _U64(k), qa, nc, dx, cs, kp, r0)
    wa, sa, st, gv, nblk = _args(fmt, w, s, g, e, n, rows, k)
    if fmt == FMT_Q8_0:
        return q8_q8_dot1x2(wa, sa, st, gv, qa, nc, dx, kp, r0, nblk)
    if fmt == FMT_MXFP4:
        return mx_q8_dot1x2(wa, sa, st, gv, qa, nc, dx, kp, r0, nblk)
    if fmt == FMT_NVFP4:
        return nv_q8_dot1x2(wa, sa, st, gv, qa, nc, dx, kp, r0, nblk)
    return q4_q8_dot1x2(wa, sa, st, gv, qa, nc, dx, kp, r0, nblk)


@nb.njit(error_model="numpy", inline="always")
def panel_repack(fmt, w, s, g, e, n, rows, k, panel, pscale):
    """Rows ``n .. n + 15`` of matrix ``e`` into the int8 panel at address ``panel`` and its scales at ``pscale``
    (:mod:`freetoken.cpu_kernels.moe_int8_tile`)."""
    if fmt >= FMT_Q4_K:  # q4_k, q5_k, q6_k (the kernels ask for panels of these only)
        kq_q8_repack16(fmt, w, s, _row(e, rows, n), _U64(k), panel, pscale)
        return
    wa, sa, st, gv, nblk = _args(fmt, w, s, g, e, n, rows, k)
    if fmt == FMT_MXFP4:
        mx_q8_repack16(wa, sa, st, gv, nblk, panel, pscale)
    elif fmt == FMT_NVFP4:
        nv_q8_repack16(wa, sa, st, gv, nblk, panel, pscale)
    else:
        q4_q8_repack16(wa, sa, st, gv, nblk, panel, pscale)


@nb.njit(error_model="numpy", inline="always")
def panel_tile(fmt, panel, pscale, xq, toks, k, out):
    """The panel's 16 rows dotted with ``TILE_TOKENS`` 8-bit token rows (indices at address ``toks``) into float32
    ``out [TILE_TOKENS, 16]`` (addresses); the tiles read the token rows' half-block sums ``cs``
    (:mod:`freetoken.cpu_kernels.q8_act`)."""
    qa, _, dx, kp, cs = xq
    nblk = _U64(k) >> _U64(5)
    if fmt == FMT_MXFP4:
        mx_q8_tile(panel, pscale, qa, cs, dx, kp, toks, nblk, out)
    elif fmt == FMT_NVFP4:
        nv_q8_tile(panel, pscale, qa, cs, dx, kp, toks, nblk, out)
    elif fmt == FMT_Q4_K or fmt == FMT_Q5_K:
        k4_q8_tile(panel, pscale, qa, cs, dx, kp, toks, nblk, out)
    elif fmt == FMT_Q6_K:
        k6_q8_tile(panel, pscale, qa, cs, dx, kp, toks, nblk, out)
    else:
        q4_q8_tile(panel, pscale, qa, cs, dx, kp, toks, nblk, out)
