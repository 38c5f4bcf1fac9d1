"""Int8 row dots of the 4-bit formats (q4_0, mxfp4/ds_fp4, nvfp4) and q8_0 against 8-bit activations, as LLVM IR
intrinsics (the k-quants': :mod:`freetoken.cpu_kernels.moe_int8_kquant`).

The float path (:mod:`freetoken.cpu_kernels.moe_nibble`) looks every nibble up in a 16-entry float table held in one
register: one ``vpermps`` per 16 weights with AVX-512, but without it LLVM splits the <16 x float> lookup into
scalar extracts and the kernels fall to ~5% of the memory bandwidth (measured on this project's AVX2 target). Here the
activations are quantized once per token to 8-bit blocks (:mod:`freetoken.cpu_kernels.q8_act`: one float scale per
32 values) and the weights are never widened to float:

* 16 value bytes of a block (32 weights) become 32 unsigned bytes ``[low nibbles | high nibbles]``: for q4_0 the
  nibble itself (weight = code - 8); for the e2m1 formats ``2 * value + 12`` through one ``vpshufb`` of a 16-byte
  table (weight = (byte - 12) / 2). So ``weight = (byte - OFFSET) * FACTOR`` with an integer byte in 0..24;
  q8_0's 32 stored int8 values are the block's bytes plus 128 (one ``vpxor``), or on AVX2 ``|w|`` with the
  activation byte given w's sign (:func:`q8_operands`);
* 4-byte groups of those bytes times the activation bytes are summed into int32 lanes: ``vpdpbusd`` (AVX-512 VNNI,
  two blocks per instruction) or ``vpmaddubsw`` + ``vpmaddwd`` (AVX2; no saturation: |pair sum| <= 2 * 24 * 127);
* the offset is removed exactly in the integer domain: the accumulator starts at ``-OFFSET * (sum of the lane's 4
  activation bytes)``, precomputed per token with the activations. The lanes then hold exact signed int8 dots;
* per two blocks the 16 int32 lanes are converted to float and multiplied into a float accumulator with their
  scales (weight block scale x activation block scale; nvfp4: per 16-element sub-block), the row's sum is reduced
  once at the end and multiplied by the format's constant factor (e2m1: 1/2; nvfp4: also the matrix's global).

The integer part is exact, so the three code paths (avx512_vnni, avx2, portable) produce the same int32 lanes; only
the float accumulation after it is rounded. Versus the float path the one approximation is the 8-bit activation
(relative step 1/127 of each 32-block's largest value), as in llama.cpp's q8_0 dot products.

Token vectors: ``qa`` int8 ``[rows, kp]``, ``nc`` int32 ``[rows, kp / 4]``, ``dx`` float32 ``[rows, kp / 32]`` with
``kp = 32 * (number of blocks rounded up to even)``: rows padded with zero blocks, so a two-block step never reads
past a row (the weights' odd tail block is loaded alone and its phantom partner gets scale 0).
"""

from __future__ import annotations

from freetoken.cpu_kernels.lanes import lane_tree
from freetoken.cpu_kernels.moe_memory import PREFETCH_BYTES, PREFETCH_LOCALITY, declare_prefetch, typed_ptr
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from freetoken.device.simd import simd_level

#: ``weight = (byte - OFFSET) * FACTOR`` per kind: q4 (q4_0), mx (mxfp4/ds_fp4, scale e8m0), nv (nvfp4, e4m3 scales
#: per 16 values and a per-matrix global), q8 (q8_0: the stored int8 plus 128, one ``vpxor``). AVX2 reads q8_0 by the
#: sign trick instead (|w| unsigned, the activation byte given w's sign: ``vpmaddubsw`` would saturate its int16 pair
#: sums with bytes up to 255 x 127), which needs no offset.
OFFSET = {"q4": 8, "mx": 12, "nv": 12, "q8": 0 if simd_level() == "avx2" else 128}
FACTOR = {"q4": 1.0, "mx": 0.5, "nv": 0.5, "q8": 1.0}
#: Value bytes per 32-weight block.
BLOCK_BYTES = {"q4": 16, "mx": 16, "nv": 16, "q8": 32}
#: e2m1 code -> 2 * value + 12 (bit 3 is the sign; -0 maps to 12 like +0).
E2M1_BYTES = [12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0]

_I8 = ir.IntType(8)
_I16 = ir.IntType(16)
_I32 = ir.IntType(32)
_I64 = ir.IntType(64)
_F32 = ir.FloatType()


def _vec(t, n):
    return ir.VectorType(t, n)


def _c32(v):
    return ir.Constant(_I32, v)


def _mask(idx):
    return ir.Constant(_vec(_I32, len(idx)), list(idx))


def _fn(builder, name, ret, args):
    return cgutils.get_or_insert_function(builder.module, ir.FunctionType(ret, args), name)


def _concat(builder, a, b):
    n = a.type.count
    return builder.shuffle_vector(a, b, _mask(range(2 * n)))


def _half(builder, v, which):
    n = v.type.count // 2
    return builder.shuffle_vector(v, ir.Constant(v.type, ir.Undefined), _mask(range(which * n, (which + 1) * n)))


def lookup_bytes(builder, level, table16, idx):
    """``table16[idx]`` per byte lane (``idx`` in 0..15): ``vpshufb`` per 128-bit lane on x86."""
    n = idx.type.count
    if level == "avx512_vnni" and n == 64:
        rep = builder.shuffle_vector(table16, table16, _mask(list(range(16)) * 4))
        return builder.call(_fn(builder, "llvm.x86.avx512.pshuf.b.512", _vec(_I8, 64), [_vec(_I8, 64)] * 2),
                            [rep, idx])
    if level in ("avx2", "avx512_vnni"):
        rep = builder.shuffle_vector(table16, table16, _mask(list(range(16)) * 2))
        f = _fn(builder, "llvm.x86.avx2.pshuf.b", _vec(_I8, 32), [_vec(_I8, 32)] * 2)
        parts = [builder.call(f, [rep, _half(builder, idx, i)]) for i in range(n // 32)]
        return parts[0] if len(parts) == 1 else _concat(builder, parts[0], parts[1])
    out = ir.Constant(idx.type, ir.Undefined)  # portable: one variable extract per lane
    for i in range(n):
        out = builder.insert_element(out, builder.extract_element(table16, builder.extract_element(idx, _c32(i))),
                                     _c32(i))
    return out


def dot_u8_s8(builder, level, acc, w, a):
    """``acc[i] + sum_{j<4} w[4i + j] * a[4i + j]`` (w unsigned, a signed bytes; 64 bytes -> 16 int32 lanes)."""
    v16i32 = _vec(_I32, 16)
    if level == "avx512_vnni":
        f = _fn(builder, "llvm.x86.avx512.vpdpbusd.512", v16i32, [v16i32] * 3)
        return builder.call(f, [acc, builder.bitcast(w, v16i32), builder.bitcast(a, v16i32)])
    if level == "avx2":
        ub = _fn(builder, "llvm.x86.avx2.pmadd.ub.sw", _vec(_I16, 16), [_vec(_I8, 32)] * 2)
        wd = _fn(builder, "llvm.x86.avx2.pmadd.wd", _vec(_I32, 8), [_vec(_I16, 16)] * 2)
        ones = ir.Constant(_vec(_I16, 16), [1] * 16)
        parts = [builder.call(wd, [builder.call(ub, [_half(builder, w, i), _half(builder, a, i)]), ones])
                 for i in range(2)]
        return builder.add(acc, _concat(builder, parts[0], parts[1]))
    prod = builder.mul(builder.zext(w, _vec(_I32, 64)), builder.sext(a, _vec(_I32, 64)))  # portable
    for j in range(4):
        acc = builder.add(acc, builder.shuffle_vector(prod, ir.Constant(prod.type, ir.Undefined),
                                                      _mask(range(j, 64, 4))))
    return acc


def _i64(v):
    return ir.Constant(_I64, v)


def weight_bytes(builder, kind, level, wp, b, tail):
    """[lo A | hi A | lo B | hi B]: the unsigned weight bytes (``weight = (byte - OFFSET) * FACTOR``) of blocks b,
    b + 1 of the row whose value bytes start at ``wp`` (i8*); B is zero when ``tail``. q8: [A | B], the stored
    signed bytes (:func:`q8_operands` makes them unsigned)."""
    v64i8 = _vec(_I8, 64)
    if kind == "q8":
        ptr = builder.gep(wp, [builder.mul(b, _i64(32))])
        if tail:
            raw32 = builder.load(builder.bitcast(ptr, _vec(_I8, 32).as_pointer()), align=1)
            return _concat(builder, raw32, ir.Constant(_vec(_I8, 32), [0] * 32))
        return builder.load(builder.bitcast(ptr, v64i8.as_pointer()), align=1)
    ptr = builder.gep(wp, [builder.mul(b, _i64(16))])
    if tail:
        raw16 = builder.load(builder.bitcast(ptr, _vec(_I8, 16).as_pointer()), align=1)
        raw = _concat(builder, raw16, ir.Constant(_vec(_I8, 16), [0] * 16))
    else:
        raw = builder.load(builder.bitcast(ptr, _vec(_I8, 32).as_pointer()), align=1)
    dup = builder.shuffle_vector(raw, raw, _mask(list(range(16)) * 2 + list(range(16, 32)) * 2))
    lo = builder.and_(dup, ir.Constant(v64i8, [15] * 64))
    hi = builder.lshr(dup, ir.Constant(v64i8, [4] * 64))
    sel = ir.Constant(_vec(ir.IntType(1), 64), ([1] * 16 + [0] * 16) * 2)
    nib = builder.select(sel, lo, hi)
    return nib if kind == "q4" else lookup_bytes(builder, level, ir.Constant(_vec(_I8, 16), E2M1_BYTES), nib)


def q8_operands(builder, level, w, a):
    """(unsigned weight bytes, signed activation bytes) whose :func:`dot_u8_s8` is the signed dot of q8_0's stored
    bytes ``w`` with ``a``: AVX2 ``(|w|, a * sign(w))`` (pair sums stay within int16: |w| <= 128, |a| <= 127;
    w = -128 gives byte 128 and -a, still exact), otherwise ``(w + 128, a)`` with the ``OFFSET`` 128 correction
    already in the accumulator."""
    if level != "avx2":
        return builder.xor(w, ir.Constant(w.type, [-128] * w.type.count)), a
    neg = builder.icmp_signed("<", w, ir.Constant(w.type, [0] * w.type.count))
    zero = ir.Constant(a.type, [0] * a.type.count)
    return builder.select(neg, builder.sub(zero, w), w), builder.select(neg, builder.sub(zero, a), a)


def weight_scales(builder, kind, sp, stp, b, tail):
    """q4/mx: <2 x float> block scales of blocks b, b + 1; nv: <4 x float> sub-block scales (the phantom block
    after a ``tail`` block gets 0). ``sp``: the row's first scale (i16* for q4, i8* otherwise); ``stp``: the
    byte -> float table (float*)."""
    if kind in ("q4", "q8"):
        v2h = _vec(ir.HalfType(), 2)
        if tail:
            h = builder.bitcast(builder.load(builder.gep(sp, [b])), ir.HalfType())
            pair = builder.insert_element(ir.Constant(v2h, [0.0, 0.0]), h, _c32(0))
        else:
            pair = builder.load(builder.bitcast(builder.gep(sp, [b]), v2h.as_pointer()), align=2)
        return builder.fpext(pair, _vec(_F32, 2))
    n = 2 if kind == "mx" else 4
    first = b if kind == "mx" else builder.mul(b, _i64(2))
    out = ir.Constant(_vec(_F32, n), [0.0] * n)
    for i in range(n // 2 if tail else n):
        byte = builder.load(builder.gep(sp, [builder.add(first, _i64(i))]))
        out = builder.insert_element(out, builder.load(builder.gep(stp, [builder.zext(byte, _I64)])), _c32(i))
    return out


def _codegen(kind, ntok, nrow, level):
    """Arguments (uint64 after casting): w (value bytes of the first row), s (its first scale), stab (256 float32:
    scale byte -> float; unused by q4), g (float32 global, nv), qa, nc, dx (token arrays), kp (bytes per token row
    of qa), ``ntok`` token row indices, nblk (32-weight blocks per weight row). ``nrow`` consecutive rows. Returns
    ``nrow * ntok`` float32 dot products, row-major."""
    def codegen(context, builder, signature, args):
        vals = [context.cast(builder, a, t, types.float32 if i == 3 else types.uint64)
                for i, (a, t) in enumerate(zip(args, signature.args, strict=True))]
        w, s, stab, g, qa, nc, dx, kp = vals[:8]
        rows_idx, nblk = vals[8:8 + ntok], vals[8 + ntok]

        def const(v):
            return ir.Constant(_I64, v)

        v16f, v16i32, v64i8 = _vec(_F32, 16), _vec(_I32, 16), _vec(_I8, 64)
        zero16f = ir.Constant(v16f, [0.0] * 16)
        scales_per_block = 2 if kind == "nv" else 1
        wp0 = typed_ptr(builder, w, _I8)
        sp0 = typed_ptr(builder, s, _I16 if kind in ("q4", "q8") else _I8)
        wps = [builder.gep(wp0, [builder.mul(nblk, const(BLOCK_BYTES[kind] * r))]) for r in range(nrow)]
        sps = [builder.gep(sp0, [builder.mul(nblk, const(scales_per_block * r))]) for r in range(nrow)]
        stp = typed_ptr(builder, stab, _F32)
        qas, ncs, dxs = [], [], []
        for r in rows_idx:
            base = builder.mul(r, kp)  # byte offset of the token row in qa and nc; dx rows are kp / 8 bytes
            qas.append(typed_ptr(builder, builder.add(qa, base), _I8))
            ncs.append(typed_ptr(builder, builder.add(nc, base), _I8))
            dxs.append(typed_ptr(builder, builder.add(dx, builder.lshr(base, const(3))), _F32))
        fmuladd = _fn(builder, "llvm.fmuladd.v16f32", v16f, [v16f] * 3)
        prefetch = declare_prefetch(builder.module)
        # accs[r][t][parity]: two accumulators per (row, token), alternating two-block steps
        accs = [[[cgutils.alloca_once_value(builder, zero16f) for _ in range(2)] for _ in range(ntok)]
                for _ in range(nrow)]

        def step(b, parity, tail=False):
            for r in range(nrow):
                if not tail:
                    ahead = builder.gep(wps[r], [builder.add(builder.mul(b, const(BLOCK_BYTES[kind])),
                                                             const(PREFETCH_BYTES))])
                    builder.call(prefetch, [ahead, _c32(0), _c32(PREFETCH_LOCALITY), _c32(1)])
                wv = weight_bytes(builder, kind, level, wps[r], b, tail)
                if kind == "q8" and level != "avx2":
                    wv, _ = q8_operands(builder, level, wv, None)
                sw = weight_scales(builder, kind, sps[r], stp, b, tail)
                for t in range(ntok):
                    a = builder.load(builder.bitcast(builder.gep(qas[t], [builder.mul(b, const(32))]),
                                                     v64i8.as_pointer()), align=1)
                    corr = builder.load(builder.bitcast(builder.gep(ncs[t], [builder.mul(b, const(32))]),
                                                        v16i32.as_pointer()), align=4)
                    wt = wv
                    if kind == "q8" and level == "avx2":
                        wt, a = q8_operands(builder, level, wv, a)
                    lanes = builder.sitofp(dot_u8_s8(builder, level, corr, wt, a), v16f)
                    dpair = builder.load(builder.bitcast(builder.gep(dxs[t], [b]), _vec(_F32, 2).as_pointer()),
                                         align=4)
                    if kind == "nv":
                        sc = builder.fmul(sw, builder.shuffle_vector(dpair, dpair, _mask([0, 0, 1, 1])))
                        sc = builder.shuffle_vector(sc, sc, _mask([0, 0, 1, 1, 0, 0, 1, 1, 2, 2, 3, 3, 2, 2, 3, 3]))
                    else:
                        sc = builder.fmul(sw, dpair)
                        sc = builder.shuffle_vector(sc, sc, _mask([0] * 8 + [1] * 8))
                    acc = accs[r][t][parity]
                    builder.store(builder.call(fmuladd, [lanes, sc, builder.load(acc)]), acc)

        with cgutils.for_range(builder, builder.lshr(nblk, const(2))) as loop:  # four blocks per iteration
            b = builder.mul(loop.index, const(4))
            step(b, 0)
            step(builder.add(b, const(2)), 1)
        rest = builder.and_(nblk, const(3))
        b_rest = builder.sub(nblk, rest)
        with builder.if_then(builder.icmp_unsigned(">=", rest, const(2))):
            step(b_rest, 0)
        with builder.if_then(builder.icmp_unsigned("!=", builder.and_(rest, const(1)), const(0))):
            step(builder.sub(nblk, const(1)), 1, tail=True)
        factor = ir.Constant(_F32, FACTOR[kind])
        if kind == "nv":
            factor = builder.fmul(factor, g)
        sums = []
        for r in range(nrow):
            for t in range(ntok):
                acc = builder.fadd(builder.load(accs[r][t][0]), builder.load(accs[r][t][1]))
                sums.append(builder.fmul(lane_tree(builder, acc), factor))
        if len(sums) == 1:
            return sums[0]
        return context.make_tuple(builder, signature.return_type, sums)
    return codegen


def _signature(kind, ntok, nrow, args):
    if not (all(isinstance(t, types.Integer) for i, t in enumerate(args) if i != 3) and args[3] == types.float32):
        return None
    n = ntok * nrow
    ret = types.float32 if n == 1 else types.UniTuple(types.float32, n)
    return ret(*args), _codegen(kind, ntok, nrow, simd_level())


def _intrinsics(kind):
    """1, 2, 4 tokens x 1 row and 1 token x 2 rows (explicit arities: intrinsics take no *args)."""
    def dot1(typingctx, w, s, stab, g, qa, nc, dx, kp, r0, nblk):
        return _signature(kind, 1, 1, (w, s, stab, g, qa, nc, dx, kp, r0, nblk))

    def dot2(typingctx, w, s, stab, g, qa, nc, dx, kp, r0, r1, nblk):
        return _signature(kind, 2, 1, (w, s, stab, g, qa, nc, dx, kp, r0, r1, nblk))

    def dot4(typingctx, w, s, stab, g, qa, nc, dx, kp, r0, r1, r2, r3, nblk):
        return _signature(kind, 4, 1, (w, s, stab, g, qa, nc, dx, kp, r0, r1, r2, r3, nblk))

    def dot1x2(typingctx, w, s, stab, g, qa, nc, dx, kp, r0, nblk):
        return _signature(kind, 1, 2, (w, s, stab, g, qa, nc, dx, kp, r0, nblk))

    out = []
    for f in (dot1, dot2, dot4, dot1x2):
        f.__name__ = f.__qualname__ = f"{kind}_q8_{f.__name__}"
        out.append(intrinsic(f))
    return out


#: ``<kind>_q8_dot<N>(w, s, stab, g, qa, nc, dx, kp, r_1, ..., r_N, nblk)``: a weight row of ``nblk`` 32-weight
#: blocks (value bytes from address ``w``, scales from ``s``) dotted with the 8-bit token rows ``r_t`` of (qa, nc,
#: dx); N float32 (a tuple when N > 1). ``<kind>_q8_dot1x2(..., r_1, nblk)``: rows ``w`` and the next one, one token.
q4_q8_dot1, q4_q8_dot2, q4_q8_dot4, q4_q8_dot1x2 = _intrinsics("q4")
mx_q8_dot1, mx_q8_dot2, mx_q8_dot4, mx_q8_dot1x2 = _intrinsics("mx")
nv_q8_dot1, nv_q8_dot2, nv_q8_dot4, nv_q8_dot1x2 = _intrinsics("nv")
q8_q8_dot1, q8_q8_dot2, q8_q8_dot4, q8_q8_dot1x2 = _intrinsics("q8")
