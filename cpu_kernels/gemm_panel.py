"""The many-token dense product's micro-kernel: 16 output rows x a tile of tokens, rows in vector lanes.

:func:`freetoken.cpu_kernels.gemv.tile_rows4` (4 rows x 4 tokens, each of the 16 accumulators a vector along K)
leaves Numba's vectoriser 8 loads and a horizontal sum per 16 FMAs and reaches ~70 GFLOP/s on two AVX-512 cores.
Here, as in a BLAS micro-kernel, the lanes are the 16 rows: a thread widens a 16-row panel of the weights once into
float32 ``[K][16]`` (:func:`widen_panel`, L1/L2 resident), then per K step ONE panel load feeds ``TOKENS`` FMAs whose
second operand is a token's x value broadcast (folded into the FMA as a memory operand): no horizontal sums, about
one load per FMA, and the accumulators (``TOKENS`` vectors) stay in registers.

Accumulation is float32 in K order per (row, token), one FMA per weight.
"""

from __future__ import annotations

import numba as nb
import numpy as np
from freetoken.cpu_kernels.moe_int8_tile import transpose16
from freetoken.cpu_kernels.moe_memory import addr, typed_ptr
from freetoken.cpu_kernels.widen import FASTMATH, _widen
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from freetoken.device.simd import simd_level

#: Rows per panel: the float32 lanes of one 512-bit vector.
PANEL_ROWS = 16
#: K values per micro-kernel call: the panel's slice (16 KiB) stays in L1 while the token tiles pass, and a tile's
#: x slices (TOKENS x 1 KiB) with it.
KC = 256
#: Tokens per micro-kernel call: accumulators that fit the vector registers with the panel's load (AVX-512: 32
#: registers of 16 lanes; AVX2: 16 of 8, a 16-lane vector takes two).
TOKENS = {"avx512_vnni": 12, "avx2": 6}.get(simd_level(), 4)

_F32, _I32, _I64 = ir.FloatType(), ir.IntType(32), ir.IntType(64)


def _codegen(ntok):
    def codegen(context, builder, signature, args):
        panel, x, k, k0, kc, toks, acc = (context.cast(builder, a, t, types.uint64)
                                          for a, t in zip(args, signature.args, strict=True))
        v16f = ir.VectorType(_F32, 16)
        fmuladd = cgutils.get_or_insert_function(builder.module, ir.FunctionType(v16f, [v16f] * 3),
                                                 "llvm.fmuladd.v16f32")
        pp = builder.gep(typed_ptr(builder, panel, v16f), [k0])
        tp = typed_ptr(builder, toks, _I64)
        ap = typed_ptr(builder, acc, v16f)
        rows = [builder.load(builder.gep(tp, [ir.Constant(_I64, t)])) for t in range(ntok)]
        xps = [builder.gep(typed_ptr(builder, builder.add(x, builder.mul(r, builder.mul(k, ir.Constant(_I64, 4)))),
                                     _F32), [k0]) for r in rows]
        accs = [cgutils.alloca_once_value(builder, builder.load(builder.gep(ap, [r]), align=4)) for r in rows]
        undef1 = ir.Constant(ir.VectorType(_F32, 1), ir.Undefined)
        zeros = ir.Constant(ir.VectorType(_I32, 16), [0] * 16)
        with cgutils.for_range(builder, kc) as loop:
            c = loop.index
            wv = builder.load(builder.gep(pp, [c]), align=4)
            for t in range(ntok):
                xv = builder.load(builder.gep(xps[t], [c]))
                b = builder.shuffle_vector(builder.insert_element(undef1, xv, ir.Constant(_I32, 0)), undef1, zeros)
                builder.store(builder.call(fmuladd, [wv, b, builder.load(accs[t])]), accs[t])
        for t in range(ntok):  # a repeated token (a short tile) stores the same value twice
            builder.store(builder.load(accs[t]), builder.gep(ap, [rows[t]]), align=4)
        return context.get_dummy_value()
    return codegen


@intrinsic
def panel_tile(typingctx, panel, x, k, k0, kc, toks, acc):
    """``acc[toks[t], r] += sum_{c = k0}^{k0 + kc - 1} panel[c, r] * x[toks[t], c]`` for ``TOKENS`` token rows
    (indices at address ``toks``; a repeated index is computed twice and stored once) and the panel's 16 rows.
    Addresses: panel float32 [k, 16], x float32 rows of k values, acc float32 [tokens, 16]."""
    args = (panel, x, k, k0, kc, toks, acc)
    if not all(isinstance(a, types.Integer) for a in args):
        return None
    return types.void(*args), _codegen(TOKENS)


#: Token rows of :func:`panel_tile4`.
SHORT_TOKENS = 4


@intrinsic
def panel_tile4(typingctx, panel, x, k, k0, kc, toks, acc):
    """:func:`panel_tile` for ``SHORT_TOKENS`` token rows: short tiles (the few query heads of a decode step)
    without computing padding rows."""
    args = (panel, x, k, k0, kc, toks, acc)
    if not all(isinstance(a, types.Integer) for a in args):
        return None
    return types.void(*args), _codegen(SHORT_TOKENS)


def _emit_widen(builder, kind, w, k, stride, rows, panel):
    """IR: rows ``0 .. rows - 1`` (``stride`` bytes apart from address ``w``; the rest zero) of a 16-row block,
    widened to float32 and transposed into ``panel [k - k % 16, 16]`` in 16 x 16 register blocks."""
    elem = {"f32": _F32, "bf16": ir.IntType(16), "f16": ir.HalfType()}[kind]
    v16e, v16f = ir.VectorType(elem, 16), ir.VectorType(_F32, 16)
    wps = [typed_ptr(builder, builder.add(w, builder.mul(stride, ir.Constant(_I64, r))), v16e)
           for r in range(PANEL_ROWS)]
    pp = typed_ptr(builder, panel, v16f)
    zero = ir.Constant(v16f, [0.0] * 16)
    with cgutils.for_range(builder, builder.lshr(k, ir.Constant(_I64, 4))) as loop:
        j = loop.index
        vecs = []
        for r in range(PANEL_ROWS):
            slot = cgutils.alloca_once_value(builder, zero)
            with builder.if_then(builder.icmp_unsigned("<", ir.Constant(_I64, r), rows)):
                v = builder.load(builder.gep(wps[r], [j]), align=2)
                if kind == "f16":
                    v = builder.fpext(v, v16f)
                elif kind == "bf16":
                    v = builder.bitcast(builder.shl(builder.zext(v, ir.VectorType(_I32, 16)),
                                                    ir.Constant(ir.VectorType(_I32, 16), [16] * 16)), v16f)
                builder.store(v, slot)
            vecs.append(builder.load(slot))
        for c, col in enumerate(transpose16(builder, vecs)):
            at = builder.add(builder.mul(j, ir.Constant(_I64, 16)), ir.Constant(_I64, c))
            builder.store(col, builder.gep(pp, [at]), align=4)


_KINDS = {types.float32: "f32", types.uint16: "bf16", types.int16: "f16"}
_SIZES = {"f32": 4, "bf16": 2, "f16": 2}


@intrinsic
def _widen16(typingctx, w, k, rows, panel, sample):
    """Rows ``0 .. rows - 1`` (the rest zero) of the 16-row weight block at address ``w`` (``k`` values per row)
    widened and transposed into ``panel [k - k % 16, 16]``; the stored type is ``sample``'s (a weight)."""
    if sample not in _KINDS or not all(isinstance(a, types.Integer) for a in (w, k, rows, panel)):
        return None

    def codegen(context, builder, signature, args):
        w_, k_, rows_, panel_ = (context.cast(builder, a, t, types.uint64)
                                 for a, t in zip(args[:4], signature.args[:4], strict=True))
        kind = _KINDS[sample]
        _emit_widen(builder, kind, w_, k_, builder.mul(k_, ir.Constant(_I64, _SIZES[kind])), rows_, panel_)
        return context.get_dummy_value()
    return types.void(w, k, rows, panel, sample), codegen


@intrinsic
def widen16_strided(typingctx, w, k, stride, rows, panel, sample):
    """As the 16-row widen of :func:`widen_panel`, for rows ``stride`` bytes apart (a strided view, e.g. one kv
    head's keys in a paged KV block): rows ``0 .. rows - 1`` of ``k`` values from address ``w`` into
    ``panel [k - k % 16, 16]``, the rest zero; the stored type is ``sample``'s."""
    if sample not in _KINDS or not all(isinstance(a, types.Integer) for a in (w, k, stride, rows, panel)):
        return None

    def codegen(context, builder, signature, args):
        w_, k_, stride_, rows_, panel_ = (context.cast(builder, a, t, types.uint64)
                                          for a, t in zip(args[:5], signature.args[:5], strict=True))
        _emit_widen(builder, _KINDS[sample], w_, k_, stride_, rows_, panel_)
        return context.get_dummy_value()
    return types.void(w, k, stride, rows, panel, sample), codegen


@nb.njit(error_model="numpy", inline="always", fastmath=FASTMATH)
def widen_panel(w, r0, panel):
    """``panel[c, r] = widen(w[r0 + r, c])`` for the 16 rows from ``r0`` (rows past the matrix: 0): 16 x 16
    blocks transposed in registers, the last K % 16 columns one by one."""
    n, k = w.shape
    rows = min(PANEL_ROWS, n - r0)
    if k >= 16:
        _widen16(addr(w) + np.uint64(r0 * k * w.itemsize), k, rows, addr(panel), w[0, 0])
    for c in range(k - k % 16, k):
        for r in range(rows):
            panel[c, r] = _widen(w[r0 + r, c])
        for r in range(rows, PANEL_ROWS):
            panel[c, r] = np.float32(0.0)


@nb.njit(error_model="numpy", inline="always", fastmath=FASTMATH)
def panel_product(x, panel, r0, rows, out, toks, acc):
    """``out[:, r0:r0 + rows] = x @ panel[:, :rows]``: every token of ``x`` (float32 [T, K], C-contiguous) through
    the micro-kernel in K slices of ``KC`` and tiles of ``TOKENS``; ``toks`` int64 [TOKENS] and ``acc`` float32
    [>= T, 16] are the thread's scratch."""
    t_count, k = x.shape
    xa = addr(x)
    for t in range(t_count):
        for r in range(PANEL_ROWS):
            acc[t, r] = np.float32(0.0)
    for k0 in range(0, k, KC):
        for t0 in range(0, t_count, TOKENS):
            nt = min(TOKENS, t_count - t0)
            for i in range(TOKENS):
                toks[i] = t0 + min(i, nt - 1)
            panel_tile(addr(panel), xa, k, k0, min(KC, k - k0), addr(toks), addr(acc))
    for t in range(t_count):
        for r in range(rows):
            out[t, r0 + r] = acc[t, r]
