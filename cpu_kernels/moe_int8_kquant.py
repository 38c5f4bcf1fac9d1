"""Int8 row dots of the GGUF k-quants (q4_k, q5_k, q6_k, iq4_xs) against 8-bit activations, as LLVM IR intrinsics:
the k-quant counterpart of :mod:`freetoken.cpu_kernels.moe_int8` (q8_0, whose 32-weight blocks fit that module's
loop, runs there).

The float path (:mod:`freetoken.cpu_kernels.moe_kquant`) turns every weight into a float32 lane: 3-7 vector
instructions of decode per 16 weights, so two cores decode fewer bytes per second than the memory delivers (41-45% of
the read bandwidth at the Qwen3-30B-A3B expert shape, T = 1). Here a 256-weight super-block is read as four chunks of
64 weights in natural K order, each chunk's codes made into 64 bytes (two to four byte operations) and dotted with
the token's 8-bit activations (:mod:`freetoken.cpu_kernels.q8_act`: one scale per 32 values) by one ``vpdpbusd``
(AVX-512 VNNI) or ``vpmaddubsw`` + ``vpmaddwd`` (AVX2) into 16 int32 lanes, 4 products each:

* q4_k / q5_k: the unsigned code (0..15 / 0..31) is the byte; ``weight = d sc_j q - dmin m_j``, so a sub-block's dot
  is ``d sc_j (q . a) dx_j - dmin m_j dx_j sum(a)``. The activations are quantized with offset -1, which makes
  their ``cs`` the plain half-block sums; the min term is one 8-lane FMA per super-block and token;
* q6_k: the code q in 0..63 with the offset 32 removed in the integer domain (the accumulator starts at the
  activations' ``nc`` = -32 x lane sums, as the 4-bit formats do), one scale per 16 weights (4 lanes);
* iq4_xs: the 16 non-linear int8 values looked up per nibble (``vpshufb``); plus 128 as unsigned bytes with the
  ``nc`` correction (offset 128), or on AVX2 by the sign trick (|w|, a sign(w): ``vpmaddubsw`` saturates its int16
  pair sums with bytes up to 241), offset 0.

Per chunk and token the 16 lanes are converted once and multiplied into a float accumulator with a per-lane scale
vector (sub-block scale x activation block scale, made once per super-block and token); the row is reduced once
at the end (:func:`freetoken.cpu_kernels.lanes.lane_tree`). The integer part is exact on every path (avx512_vnni,
avx2, portable), so the one approximation against the float path is the 8-bit activation, as for the 4-bit
formats and in llama.cpp's k-quant dot products.

A prompt's expert with many tokens takes the panel micro-kernel instead (:mod:`freetoken.cpu_kernels.moe_int8_tile`):
:func:`kq_q8_repack16` decodes 16 rows of q4_k, q5_k or q6_k once into the panel layout (the same chunks as above,
transposed to rows in lanes) with the rows' scales (and q4_k/q5_k's mins), which the ``k4`` / ``k6`` tiles multiply
by 8 (AVX-512) or 4 (AVX2) tokens at a time. iq4_xs has no panel: its bytes plus 128 would saturate AVX2's
``vpmaddubsw`` against a broadcast activation, and the sign trick costs a byte operation per chunk and token; it runs
the row dots at every token count, as q8_0 does.

Intrinsics: ``kq_q8_dot<N>(code, w, s, row, k, qa, nc, dx, cs, kp, r_1, .., r_N)``: row ``row`` of a record bank
(quants from ``w``, headers from ``s``, the leading expert dimension folded into ``row``) dotted with the 8-bit token
rows ``r_t``; ``kq_q8_dot1x2``: rows ``row`` and ``row + 1`` with one token. ``code`` is a runtime format code
(:data:`CODES`), dispatched once per call. ``kq_q8_repack16(code, w, s, row, k, panel, pscale)``: rows ``row`` ..
``row + 15`` into a panel (:data:`PANEL_CODES`).
"""

from __future__ import annotations

from freetoken.cpu_kernels.lanes import lane_tree
from freetoken.cpu_kernels.moe_int8 import dot_u8_s8, lookup_bytes, q8_operands
from freetoken.cpu_kernels.moe_int8_tile import MIN_AT, PANEL_ROWS, transpose16
from freetoken.cpu_kernels.moe_kquant import (
    FMT_IQ4_XS,
    FMT_Q4_K,
    FMT_Q5_K,
    FMT_Q6_K,
    IQ4_VALUES,
    Rows,
    iq4_scales,
    k_scales,
    q6_scales,
    switch,
)
from freetoken.cpu_kernels.moe_memory import typed_ptr
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from freetoken.device.simd import simd_level

#: The formats these dots read.
CODES = (FMT_Q4_K, FMT_Q5_K, FMT_Q6_K, FMT_IQ4_XS)
#: The offset each format's activations are quantized with (:mod:`freetoken.cpu_kernels.q8_act`): -1 makes ``cs``
#: the plain sums the q4_k/q5_k min term reads; q6_k's codes carry 32; iq4_xs's looked-up values 128 (0 on AVX2).
OFFSETS = {FMT_Q4_K: -1, FMT_Q5_K: -1, FMT_Q6_K: 32, FMT_IQ4_XS: 0 if simd_level() == "avx2" else 128}
#: Formats whose dot has the min term (read from ``cs``, accumulator started at zero instead of ``nc``).
_WITH_MIN = (FMT_Q4_K, FMT_Q5_K)
#: The formats with a panel (:func:`kq_q8_repack16`).
PANEL_CODES = (FMT_Q4_K, FMT_Q5_K, FMT_Q6_K)

_I8, _I32, _I64, _F32 = ir.IntType(8), ir.IntType(32), ir.IntType(64), ir.FloatType()
_V16F, _V8F = ir.VectorType(_F32, 16), ir.VectorType(_F32, 8)
_V16I32, _V64I8, _V32I8 = ir.VectorType(_I32, 16), ir.VectorType(_I8, 64), ir.VectorType(_I8, 32)


def _c(v, t=_I64):
    return ir.Constant(t, v)


def _mask(idx):
    return ir.Constant(ir.VectorType(_I32, len(idx)), list(idx))


def _shuffle(b, u, v, idx):
    return b.shuffle_vector(u, v, _mask(idx))


def _load(b, p, off, vt, align=1):
    """``vt`` at byte offset ``off`` (i64 value or Python int) of the i8* ``p``."""
    off = _c(off) if isinstance(off, int) else off
    return b.load(b.bitcast(b.gep(p, [off]), vt.as_pointer()), align=align)


def _b8(value):
    return ir.Constant(_V32I8, [value] * 32)


def _chunks(b, fmt, wp, level):
    """The four 64-weight chunks of a super-block whose quants start at ``wp`` (i8*): ``<64 x i8>`` in natural K
    order, unsigned codes (q4_k, q5_k, q6_k), iq4_xs's values plus 128 (or, on AVX2, its signed values)."""
    if fmt in (FMT_Q4_K, FMT_Q5_K):
        q5 = fmt == FMT_Q5_K
        qh = _load(b, wp, 0, _V32I8) if q5 else None  # bit j of qh[i]: the fifth bit of weight 32 j + i
        for g in range(4):
            qs = _load(b, wp, (32 if q5 else 0) + 32 * g, _V32I8)
            lo, hi = b.and_(qs, _b8(15)), b.lshr(qs, _b8(4))  # sub-blocks 2g and 2g + 1
            if q5:
                lo = b.or_(lo, b.shl(b.and_(b.lshr(qh, _b8(2 * g)), _b8(1)), _b8(4)))
                hi = b.or_(hi, b.shl(b.and_(b.lshr(qh, _b8(2 * g + 1)), _b8(1)), _b8(4)))
            yield _shuffle(b, lo, hi, range(64))
        return
    if fmt == FMT_Q6_K:  # ql[128], qh[64]: half h covers weights 128 h .. 128 h + 127 (see moe_kquant._decode_q6_k)
        for h in range(2):
            qla, qlb = _load(b, wp, 64 * h, _V32I8), _load(b, wp, 64 * h + 32, _V32I8)
            qh = _load(b, wp, 128 + 32 * h, _V32I8)
            parts = []
            for i in range(4):  # quarter i: low (i < 2) or high nibbles of qla (i even) or qlb, bits 2i, 2i + 1 of qh
                ql = qla if i % 2 == 0 else qlb
                nib = b.and_(ql, _b8(15)) if i < 2 else b.lshr(ql, _b8(4))
                high = b.shl(b.and_(b.lshr(qh, _b8(2 * i)), _b8(3)), _b8(4))
                parts.append(b.or_(nib, high))
            yield _shuffle(b, parts[0], parts[1], range(64))
            yield _shuffle(b, parts[2], parts[3], range(64))
        return
    # iq4_xs: qs[16 j: 16 j + 16] holds sub-block j, low nibbles first
    shifted = [v + 128 for v in IQ4_VALUES] if level != "avx2" else list(IQ4_VALUES)
    table = ir.Constant(ir.VectorType(_I8, 16), [v - 256 if v > 127 else v for v in shifted])
    for g in range(4):
        q = _load(b, wp, 32 * g, _V32I8)
        lo, hi = b.and_(q, _b8(15)), b.lshr(q, _b8(4))
        nib = _shuffle(b, lo, hi, [*range(16), *range(32, 48), *range(16, 32), *range(48, 64)])
        yield lookup_bytes(b, level, table, nib)


def _codegen(ntok, nrow, level):
    """Arguments (integers): code, w, s, row, k, qa, nc, dx, cs, kp, ``ntok`` token row indices. Returns
    ``nrow * ntok`` float32 dot products, row-major."""
    def codegen(context, builder, signature, args):
        b = builder
        code = context.cast(b, args[0], signature.args[0], types.int64)
        w, s, row, k, qa, nc, dx, cs, kp, *toks = (context.cast(b, a, t, types.uint64)
                                                   for a, t in zip(args[1:], signature.args[1:], strict=True))
        # token row t: qa bytes and nc (int32 per 4 bytes) at t * kp bytes, dx (float per 32) at t * kp / 8, cs
        # (int32 per 16) at t * kp / 4
        tok_ptrs = []
        for r in toks:
            base = b.mul(r, kp)
            tok_ptrs.append(tuple(typed_ptr(b, b.add(addr, off), _I8) for addr, off in (
                (qa, base), (nc, base), (dx, b.lshr(base, _c(3))), (cs, b.lshr(base, _c(2))))))
        fma = cgutils.get_or_insert_function(b.module, ir.FunctionType(_V16F, [_V16F] * 3), "llvm.fmuladd.v16f32")
        zero16 = ir.Constant(_V16F, [0.0] * 16)
        zero8 = ir.Constant(_V8F, [0.0] * 8)

        def emit(fmt):
            rows = Rows(b, fmt, False, w, s, row, k, nrow)
            accs = [[[cgutils.alloca_once_value(b, zero16) for _ in range(2)] for _ in range(ntok)]
                    for _ in range(nrow)]
            signed = fmt == FMT_IQ4_XS and level == "avx2"
            with cgutils.for_range(b, rows.nblk) as loop:
                sb = loop.index
                qbase = b.mul(sb, _c(256))  # the super-block's first activation byte (and nc byte offset)
                dx8, mt16 = [], []
                for _, _, dx_t, cs_t in tok_ptrs:
                    d8 = _load(b, dx_t, b.mul(sb, _c(32)), _V8F, align=4)
                    dx8.append(d8)
                    if fmt in _WITH_MIN:  # dx_j * sum(a_j), lanes 8..15 zero
                        c16 = _load(b, cs_t, b.mul(sb, _c(64)), _V16I32, align=4)
                        bs8 = b.sitofp(b.add(_shuffle(b, c16, c16, range(0, 16, 2)),
                                             _shuffle(b, c16, c16, range(1, 16, 2))), _V8F)
                        mt16.append(_shuffle(b, b.fmul(d8, bs8), zero8, range(16)))
                for r in range(nrow):
                    rows.prefetch(r, sb, 1)
                    sp, wp = rows.pointers(r, sb)
                    if fmt in _WITH_MIN:
                        sc, ndm = k_scales(b, sp)  # d sc_j, -dmin m_j
                        ndm16 = _shuffle(b, ndm, zero8, range(16))
                    elif fmt == FMT_Q6_K:
                        sc = q6_scales(b, sp)  # <16 x float>, one per 16 weights
                    else:
                        sc = iq4_scales(b, sp)
                    prods = []
                    for t in range(ntok):
                        if fmt == FMT_Q6_K:
                            prods.append(b.fmul(sc, _shuffle(b, dx8[t], dx8[t], [j // 2 for j in range(16)])))
                        else:
                            prods.append(b.fmul(sc, dx8[t]))
                        if fmt in _WITH_MIN:
                            acc = accs[r][t][1]
                            b.store(b.call(fma, [ndm16, mt16[t], b.load(acc)]), acc)
                    for g, wv in enumerate(_chunks(b, fmt, wp, level)):
                        for t, (qa_t, nc_t, _, _) in enumerate(tok_ptrs):
                            a = _load(b, qa_t, b.add(qbase, _c(64 * g)), _V64I8)
                            init = ir.Constant(_V16I32, [0] * 16) if fmt in _WITH_MIN else \
                                _load(b, nc_t, b.add(qbase, _c(64 * g)), _V16I32, align=4)
                            wt = wv
                            if signed:
                                wt, a = q8_operands(b, level, wv, a)
                            lanes = b.sitofp(dot_u8_s8(b, level, init, wt, a), _V16F)
                            if fmt == FMT_Q6_K:
                                scale = _shuffle(b, prods[t], prods[t], [4 * g + j // 4 for j in range(16)])
                            else:
                                scale = _shuffle(b, prods[t], prods[t], [2 * g + j // 8 for j in range(16)])
                            acc = accs[r][t][g % 2]
                            b.store(b.call(fma, [lanes, scale, b.load(acc)]), acc)
            return [lane_tree(b, b.fadd(b.load(accs[r][t][0]), b.load(accs[r][t][1])))
                    for r in range(nrow) for t in range(ntok)]

        sums = switch(b, code, ntok * nrow, emit, CODES)
        return sums[0] if len(sums) == 1 else context.make_tuple(b, signature.return_type, sums)
    return codegen


def _signature(ntok, nrow, args):
    if not all(isinstance(t, types.Integer) for t in args):
        return None
    n = ntok * nrow
    ret = types.float32 if n == 1 else types.UniTuple(types.float32, n)
    return ret(*args), _codegen(ntok, nrow, simd_level())


@intrinsic
def kq_q8_dot1(typingctx, code, w, s, row, k, qa, nc, dx, cs, kp, r0):
    return _signature(1, 1, (code, w, s, row, k, qa, nc, dx, cs, kp, r0))


@intrinsic
def kq_q8_dot2(typingctx, code, w, s, row, k, qa, nc, dx, cs, kp, r0, r1):
    return _signature(2, 1, (code, w, s, row, k, qa, nc, dx, cs, kp, r0, r1))


@intrinsic
def kq_q8_dot4(typingctx, code, w, s, row, k, qa, nc, dx, cs, kp, r0, r1, r2, r3):
    return _signature(4, 1, (code, w, s, row, k, qa, nc, dx, cs, kp, r0, r1, r2, r3))


@intrinsic
def kq_q8_dot1x2(typingctx, code, w, s, row, k, qa, nc, dx, cs, kp, r0):
    return _signature(1, 2, (code, w, s, row, k, qa, nc, dx, cs, kp, r0))


def _repack_codegen(level):
    """Arguments (integers): code, w, s, row, k, panel, pscale. Rows ``row .. row + 15`` into the panel layout of
    :mod:`freetoken.cpu_kernels.moe_int8_tile` ([block][chunk][row][4 bytes]) and their scales: per 32-value block
    ``d sc_j`` (q4_k, q5_k; their ``-dmin m_j`` at vector ``MIN_AT * nblk + block``) or per 16 values ``d scale``
    (q6_k: two vectors per block)."""
    def codegen(context, builder, signature, args):
        b = builder
        code = context.cast(b, args[0], signature.args[0], types.int64)
        w, s, row, k, panel, pscale = (context.cast(b, a, t, types.uint64)
                                       for a, t in zip(args[1:], signature.args[1:], strict=True))
        pp = typed_ptr(b, panel, _V16I32)
        ps = typed_ptr(b, pscale, _V16F)
        nblk32 = b.lshr(k, _c(5))

        def rows_vector(values, lane):
            """Lane ``lane`` of each row's scale vector, as one vector over the 16 rows."""
            out = ir.Constant(_V16F, ir.Undefined)
            for r, v in enumerate(values):
                out = b.insert_element(out, b.extract_element(v, ir.Constant(_I32, lane)), ir.Constant(_I32, r))
            return out

        def emit(fmt):
            rows = Rows(b, fmt, False, w, s, row, k, PANEL_ROWS)
            with cgutils.for_range(b, rows.nblk) as loop:
                sb = loop.index
                chunks, scales, mins = [], [], []
                for r in range(PANEL_ROWS):
                    sp, wp = rows.pointers(r, sb)
                    chunks.append([b.bitcast(v, _V16I32) for v in _chunks(b, fmt, wp, level)])
                    if fmt in _WITH_MIN:
                        sc, ndm = k_scales(b, sp)
                        scales.append(sc)
                        mins.append(ndm)
                    else:
                        scales.append(q6_scales(b, sp))
                for g in range(4):  # blocks 2g, 2g + 1 of the super-block: 16 chunks of 4 values
                    cols = transpose16(b, [chunks[r][g] for r in range(PANEL_ROWS)])
                    first = b.mul(b.add(b.mul(sb, _c(8)), _c(2 * g)), _c(8))
                    for c in range(16):
                        b.store(cols[c], b.gep(pp, [b.add(first, _c(c))]), align=4)
                nsc = 16 if fmt == FMT_Q6_K else 8  # scale vectors per super-block: 2 or 1 per block
                for j in range(nsc):
                    b.store(rows_vector(scales, j), b.gep(ps, [b.add(b.mul(sb, _c(nsc)), _c(j))]), align=4)
                if mins:
                    for j in range(8):
                        at = b.add(b.mul(nblk32, _c(MIN_AT)), b.add(b.mul(sb, _c(8)), _c(j)))
                        b.store(rows_vector(mins, j), b.gep(ps, [at]), align=4)
            return []

        switch(b, code, 0, emit, PANEL_CODES)
        return context.get_dummy_value()
    return codegen


@intrinsic
def kq_q8_repack16(typingctx, code, w, s, row, k, panel, pscale):
    args = (code, w, s, row, k, panel, pscale)
    if not all(isinstance(t, types.Integer) for t in args):
        return None
    return types.void(*args), _repack_codegen(simd_level())
