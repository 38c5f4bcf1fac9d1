"""The nibble formats' row dots (mxfp4/ds_fp4, nvfp4, q4_0) as intrinsics written in portable LLVM vector IR.

The nibble formats decode through a 16-entry float table held in one SIMD register. Their row-dot intrinsics load 16
bytes, split the nibbles, ``extractelement`` from a ``<16 x float>`` table, which X86 lowers to one ``vpermps`` per 16
weights (two permutes and a blend with AVX2; other targets get a correct scalarised lookup), then FMAs into 4 vector
accumulators per token. Plain Numba turned the table lookup into a gather and the arithmetic e2m1 decode into ~3x more
instructions: compute-bound at a third of the memory bandwidth. The row loops software-prefetch 8 KiB ahead: at the
DeepSeek-V3 shape that took mxfp4 from 60% (2 KiB ahead) to ~90% of the read bandwidth. A single token dots two rows
per call (half the per-row overhead, which matters for 768-wide down rows). (Measured on a 2-core Zen 5, AVX-512.)

A scalar ``fpext half`` compiles to ``vpinsrw`` + ``vcvtph2ps``, and ``vpinsrw`` merged into a register holding a
vector accumulator: a false dependency that serialised every q4_0 block. q4_0 converts the two fp16 scales of a block
pair with one vector ``vcvtph2ps`` instead (the odd tail block uses exact integer code).

K order: each group of 32 K elements is processed as its 16 low nibbles, then its 16 high nibbles ("block split"). For
q4_0 that is the natural element order; for nvfp4/mxfp4/ds_fp4 (low nibble = even element) the token vectors are in
:func:`freetoken.cpu_kernels.moe_rows.block_split_perm` order.

16 value bytes (32 weights) per step: nibbles looked up in a 16-entry float table (one variable permute each),
scaled, multiplied into 4 vector accumulators per (row, token) (two blocks per loop iteration: independent FMA
chains). Scales: mx: e8m0 byte -> 256-entry table, folded into the 16-entry table; nv: two e4m3 bytes -> table,
a per-lane multiply, the global applied once per row; q4: the fp16 pair of a block pair in one vcvtph2ps.
"""

from __future__ import annotations

from freetoken.cpu_kernels.lanes import lane_tree
from freetoken.cpu_kernels.moe_memory import PREFETCH_BYTES, PREFETCH_LOCALITY, declare_prefetch, typed_ptr
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

_I32 = ir.IntType(32)
_I64 = ir.IntType(64)
_F32T = ir.FloatType()
_V16I8 = ir.VectorType(ir.IntType(8), 16)
_V16I32 = ir.VectorType(_I32, 16)
_V16F = ir.VectorType(_F32T, 16)
_UNDEF16 = ir.Constant(_V16F, ir.Undefined)


def _lookup(builder, table, idx):
    """``table[idx]`` lane by lane: a build_vector of variable extracts, which X86 lowers to one vpermps."""
    out = _UNDEF16
    for i in range(16):
        k = builder.extract_element(idx, ir.Constant(_I32, i))
        out = builder.insert_element(out, builder.extract_element(table, k), ir.Constant(_I32, i))
    return out


def _f16_to_f32(builder, h16):
    """IEEE half bits (i16) -> float, exact, in scalar integer ops (q4_0's odd tail block). A scalar ``fpext half``
    compiles to vpinsrw + vcvtph2ps on x86, and vpinsrw merges into whatever register the allocator picks, in the
    kernels a vector accumulator: a false dependency behind the previous FMA."""
    def c(v):
        return ir.Constant(_I32, v)
    h = builder.zext(h16, _I32)
    em = builder.and_(h, c(0x7FFF))
    sign = builder.shl(builder.and_(h, c(0x8000)), c(16))
    shifted = builder.shl(em, c(13))
    normal = builder.add(shifted, c(0x38000000))  # rebias the exponent 15 -> 127
    infnan = builder.or_(shifted, c(0x7F800000))
    bits = builder.or_(builder.select(builder.icmp_unsigned(">=", em, c(0x7C00)), infnan, normal), sign)
    value = builder.bitcast(bits, _F32T)
    sub = builder.fmul(builder.uitofp(em, _F32T), ir.Constant(_F32T, 2.0 ** -24))  # subnormal: em * 2^-24
    sub = builder.select(builder.icmp_unsigned("!=", sign, c(0)), builder.fneg(sub), sub)
    return builder.select(builder.icmp_unsigned("<", em, c(0x400)), sub, value)


def _lut_codegen(kind, ntok, nrow):
    """Arguments (uint64 after casting, but g): w (byte address of the first row's values), s (address of its first
    scale), tbl (16 float32), stab (256 float32 scale table), g (float32 global), x (float32 base), ``ntok`` element
    offsets into x, nblk (groups of 32 weights per row). ``nrow`` consecutive rows (contiguous in the banks).
    Returns ``nrow * ntok`` float32 dot products, row-major."""
    def codegen(context, builder, signature, args):
        sig_args = signature.args
        vals = [context.cast(builder, a, t, types.float32 if i == 4 else types.uint64)
                for i, (a, t) in enumerate(zip(args, sig_args, strict=True))]
        w, s, tbl, stab, g, x = vals[:6]
        xoffs, nblk = vals[6:6 + ntok], vals[6 + ntok]

        def const(v):
            return ir.Constant(_I64, v)

        wp0 = typed_ptr(builder, w, ir.IntType(8))
        sp0 = typed_ptr(builder, s, ir.IntType(16) if kind == "q4" else ir.IntType(8))
        scales_per_block = 2 if kind == "nv" else 1
        wps = [builder.gep(wp0, [builder.mul(nblk, const(16 * r))]) for r in range(nrow)]
        sps = [builder.gep(sp0, [builder.mul(nblk, const(scales_per_block * r))]) for r in range(nrow)]
        stp = typed_ptr(builder, stab, _F32T)
        xp = typed_ptr(builder, x, _F32T)
        table = builder.load(typed_ptr(builder, tbl, _V16F), align=4)
        fmuladd = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_V16F, [_V16F] * 3),
                                                 "llvm.fmuladd.v16f32")
        prefetch = declare_prefetch(builder.module)
        zero = ir.Constant(_V16F, [0.0] * 16)
        # accs[r][t][j]: row r, token t, j = 2 * (block parity) + (low/high nibble half)
        accs = [[[cgutils.alloca_once_value(builder, zero) for _ in range(4)] for _ in range(ntok)]
                for _ in range(nrow)]

        def vload(ptr, index):
            return builder.load(builder.bitcast(builder.gep(ptr, [index]), _V16F.as_pointer()), align=4)

        def block(r, b, parity, q4_scale=None):
            wp, sp = wps[r], sps[r]
            raw = builder.load(builder.bitcast(builder.gep(wp, [builder.mul(b, const(16))]), _V16I8.as_pointer()),
                               align=1)
            b32 = builder.zext(raw, _V16I32)
            lo_i = builder.and_(b32, ir.Constant(_V16I32, [15] * 16))
            hi_i = builder.lshr(b32, ir.Constant(_V16I32, [4] * 16))
            if kind == "nv":  # bytes 0-7 and 8-15 are two 16-element blocks with their own e4m3 scale
                si = builder.mul(b, const(2))
                s0 = builder.load(builder.gep(stp, [builder.zext(builder.load(builder.gep(sp, [si])), _I64)]))
                si = builder.add(si, const(1))
                s1 = builder.load(builder.gep(stp, [builder.zext(builder.load(builder.gep(sp, [si])), _I64)]))
                sv = builder.insert_element(_UNDEF16, s0, ir.Constant(_I32, 0))  # the global: once per row
                sv = builder.insert_element(sv, s1, ir.Constant(_I32, 1))
                sv = builder.shuffle_vector(sv, _UNDEF16, ir.Constant(_V16I32, [0] * 8 + [1] * 8))
                lo = builder.fmul(_lookup(builder, table, lo_i), sv)
                hi = builder.fmul(_lookup(builder, table, hi_i), sv)
            else:  # one scale per 32 weights, folded into the table
                if q4_scale is not None:
                    sv = q4_scale
                else:
                    sraw = builder.load(builder.gep(sp, [b]))
                    if kind == "mx":
                        sc = builder.load(builder.gep(stp, [builder.zext(sraw, _I64)]))
                    else:
                        sc = _f16_to_f32(builder, sraw)
                    sv = builder.insert_element(_UNDEF16, sc, ir.Constant(_I32, 0))
                    sv = builder.shuffle_vector(sv, _UNDEF16, ir.Constant(_V16I32, [0] * 16))
                ts = builder.fmul(table, sv)
                lo = _lookup(builder, ts, lo_i)
                hi = _lookup(builder, ts, hi_i)
            for t in range(ntok):
                xo = builder.add(xoffs[t], builder.mul(b, const(32)))
                x0 = vload(xp, xo)
                x1 = vload(xp, builder.add(xo, const(16)))
                for acc, v, xv in ((accs[r][t][2 * parity], lo, x0), (accs[r][t][2 * parity + 1], hi, x1)):
                    builder.store(builder.call(fmuladd, [v, xv, builder.load(acc)]), acc)

        with cgutils.for_range(builder, builder.lshr(nblk, const(1))) as loop:  # two blocks per iteration
            b = builder.mul(loop.index, const(2))
            b1 = builder.add(b, const(1))
            for r in range(nrow):
                ahead = builder.gep(wps[r], [builder.add(builder.mul(b, const(16)), const(PREFETCH_BYTES))])
                builder.call(prefetch, [ahead, ir.Constant(_I32, 0), ir.Constant(_I32, PREFETCH_LOCALITY),
                                        ir.Constant(_I32, 1)])
                if kind == "q4":  # both fp16 scales in one vector conversion (vmovd + vcvtph2ps)
                    v2h = ir.VectorType(ir.HalfType(), 2)
                    pair = builder.load(builder.bitcast(builder.gep(sps[r], [b]), v2h.as_pointer()), align=2)
                    pair = builder.fpext(pair, ir.VectorType(_F32T, 2))
                    und2 = ir.Constant(ir.VectorType(_F32T, 2), ir.Undefined)
                    block(r, b, 0, builder.shuffle_vector(pair, und2, ir.Constant(_V16I32, [0] * 16)))
                    block(r, b1, 1, builder.shuffle_vector(pair, und2, ir.Constant(_V16I32, [1] * 16)))
                else:
                    block(r, b, 0)
                    block(r, b1, 1)
        with builder.if_then(builder.icmp_unsigned("!=", builder.and_(nblk, const(1)), const(0))):
            for r in range(nrow):  # odd tail block
                block(r, builder.sub(nblk, const(1)), 0)
        sums = []
        for r in range(nrow):
            for t in range(ntok):
                a = [builder.load(p) for p in accs[r][t]]
                acc = builder.fadd(builder.fadd(a[0], a[1]), builder.fadd(a[2], a[3]))
                total = lane_tree(builder, acc)
                sums.append(builder.fmul(total, g) if kind == "nv" else total)
        if len(sums) == 1:
            return sums[0]
        return context.make_tuple(builder, signature.return_type, sums)
    return codegen


def _lut_signature(kind, ntok, nrow, args):
    if not (all(isinstance(t, types.Integer) for i, t in enumerate(args) if i != 4) and args[4] == types.float32):
        return None
    n = ntok * nrow
    ret = types.float32 if n == 1 else types.UniTuple(types.float32, n)
    return ret(*args), _lut_codegen(kind, ntok, nrow)


def _lut_intrinsics(kind):
    """The dot intrinsics of one nibble format: 1, 2, 4 tokens x 1 row, and 1 token x 2 rows (explicit arities:
    intrinsics take no *args)."""
    def dot1(typingctx, w, s, tbl, stab, g, x, o0, nblk):
        return _lut_signature(kind, 1, 1, (w, s, tbl, stab, g, x, o0, nblk))

    def dot2(typingctx, w, s, tbl, stab, g, x, o0, o1, nblk):
        return _lut_signature(kind, 2, 1, (w, s, tbl, stab, g, x, o0, o1, nblk))

    def dot4(typingctx, w, s, tbl, stab, g, x, o0, o1, o2, o3, nblk):
        return _lut_signature(kind, 4, 1, (w, s, tbl, stab, g, x, o0, o1, o2, o3, nblk))

    def dot1x2(typingctx, w, s, tbl, stab, g, x, o0, nblk):
        return _lut_signature(kind, 1, 2, (w, s, tbl, stab, g, x, o0, nblk))

    out = []
    for f in (dot1, dot2, dot4, dot1x2):
        f.__name__ = f.__qualname__ = f"{kind}_{f.__name__}"
        out.append(intrinsic(f))
    return out


#: ``<kind>_dot<N>(w, s, tbl, stab, g, x, o_1, ..., o_N, nblk)``: ``nblk`` groups of 32 weights (16 value bytes each
#: from address ``w``, scales from address ``s``) dotted with the N float32 vectors at ``x + 4 * o_t`` (block-split
#: order); returns N float32 (a tuple when N > 1). ``<kind>_dot1x2(..., o_1, nblk)``: rows ``w`` and the next one
#: with one vector (half the per-row overhead: the single-token path).
mx_dot1, mx_dot2, mx_dot4, mx_dot1x2 = _lut_intrinsics("mx")
nv_dot1, nv_dot2, nv_dot4, nv_dot1x2 = _lut_intrinsics("nv")
q4_dot1, q4_dot2, q4_dot4, q4_dot1x2 = _lut_intrinsics("q4")
