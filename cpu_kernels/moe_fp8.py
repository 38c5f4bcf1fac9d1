"""fp8_block row dots of the CPU expert forward as LLVM IR intrinsics: one row of e4m3 bytes (one float32 scale per
128 x 128 block) dotted with 1, 2 or 4 float32 token vectors.

The plain-Numba loops they replace (a ``vcvtph2ps`` decode the vectoriser found, but one horizontal sum per 128
values and token, and the scale applied to a scalar) read fp8 experts at ~30% of the memory bandwidth. Here, per 16
bytes: sign-extend to 16-bit lanes, shift and mask so that exponent and mantissa sit in a half's fields and the sign
in bit 15 (the value times 2^-8, exact for subnormals too), ``vcvtph2ps``, one FMA per token into two alternating
16-lane partial sums per scale block; the block's sum times its scale (times 256) is added lane by lane into the
token's accumulator, and the 16 lanes are added up once per row. 0x7F / 0xFF (e4m3fn's NaN) make the row's dot
NaN, as in the reference: one compare per 64 bytes finds them (a select per 16 decoded values made a
one-thread T = 1 call 1.17x slower: 3.75 against 3.20 ms at the Qwen3-30B-A3B shape, bench/bench_experts.py).
The same code reading bf16 token rows (``x_kind`` "bf16": each value widened exactly) is the portable twin of the
bf16-token dots (:mod:`freetoken.cpu_kernels.moe_bf16act`), where the CPU lacks AVX512-BF16.
"""

from __future__ import annotations

from freetoken.cpu_kernels.lanes import lane_tree
from freetoken.cpu_kernels.moe_memory import PREFETCH_BYTES, PREFETCH_LOCALITY, declare_prefetch, typed_ptr
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

_I8, _I16, _I32, _I64, _F32 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64), ir.FloatType()
_V16F = ir.VectorType(_F32, 16)
_V16H = ir.VectorType(_I16, 16)
#: Values per scale block along K.
BLOCK = 128


def _c(v, t=_I64):
    return ir.Constant(t, v)


def _splat16(builder, x):
    undef1 = ir.Constant(ir.VectorType(_F32, 1), ir.Undefined)
    return builder.shuffle_vector(builder.insert_element(undef1, x, _c(0, _I32)), undef1,
                                  ir.Constant(ir.VectorType(_I32, 16), [0] * 16))


def _decode16(builder, wp, at):
    """IR: the 16 e4m3 bytes at ``wp[at]`` (i8*) as float32 lanes divided by 256: each byte sign-extended to 16 bits
    and shifted left by 7 puts the sign in bit 15 and exponent and mantissa in the half's fields, with a copy of the
    sign in bit 14 (the exponent's top bit, always 0 here) that one AND clears. e4m3fn's NaN (0x7F, 0xFF) decodes to
    a finite value here: :func:`_nan_bytes` finds them, a block at a time."""
    raw = builder.load(builder.bitcast(builder.gep(wp, [at]), ir.VectorType(_I8, 16).as_pointer()), align=1)
    half = builder.and_(builder.shl(builder.sext(raw, _V16H), ir.Constant(_V16H, [7] * 16)),
                        ir.Constant(_V16H, [0xBFFF] * 16))
    return builder.fpext(builder.bitcast(half, ir.VectorType(ir.HalfType(), 16)), _V16F)


def _nan_bytes(builder, wp, at, n: int):
    """IR: i1, whether any of the ``n`` bytes at ``wp[at]`` is e4m3fn's NaN (exponent and mantissa all ones): one
    compare per ``n`` bytes instead of a select per 16 decoded values."""
    vt = ir.VectorType(_I8, n)
    raw = builder.load(builder.bitcast(builder.gep(wp, [at]), vt.as_pointer()), align=1)
    hit = builder.icmp_unsigned("==", builder.and_(raw, ir.Constant(vt, [0x7F] * n)), ir.Constant(vt, [0x7F] * n))
    return builder.icmp_unsigned("!=", builder.bitcast(hit, ir.IntType(n)), ir.Constant(ir.IntType(n), 0))


def _load_x(builder, xp, at, x_kind):
    """IR: the 16 token values at ``xp[at]`` as float32 lanes: float32 as stored, bf16 bits widened exactly."""
    if x_kind == "f32":
        return builder.load(builder.bitcast(builder.gep(xp, [at]), _V16F.as_pointer()), align=4)
    raw = builder.load(builder.bitcast(builder.gep(xp, [at]), _V16H.as_pointer()), align=2)
    v32 = ir.VectorType(_I32, 16)
    return builder.bitcast(builder.shl(builder.zext(raw, v32), ir.Constant(v32, [16] * 16)), _V16F)


def _codegen(ntok, x_kind="f32"):
    """Arguments (uint64): w (the row's first value byte), s (its first float32 scale), x (token rows: float32, or
    with ``x_kind`` "bf16" bf16 bits), ``ntok`` element offsets of the tokens in x, k (values per row, a multiple of
    16)."""
    def codegen(context, builder, signature, args):
        w, s, x, *offs, k = (context.cast(builder, a, t, types.uint64)
                             for a, t in zip(args, signature.args, strict=True))
        wp, sp = typed_ptr(builder, w, _I8), typed_ptr(builder, s, _F32)
        xps = [builder.gep(typed_ptr(builder, x, _F32 if x_kind == "f32" else _I16), [o]) for o in offs]
        fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_V16F, [_V16F] * 3),
                                             "llvm.fmuladd.v16f32")
        prefetch = declare_prefetch(builder.module)
        zero = ir.Constant(_V16F, [0.0] * 16)
        accs = [cgutils.alloca_once_value(builder, zero) for _ in range(ntok)]
        parts = [[cgutils.alloca_once(builder, _V16F) for _ in range(2)] for _ in range(ntok)]
        nkb = builder.lshr(builder.add(k, _c(BLOCK - 1)), _c(7))
        nan = cgutils.alloca_once_value(builder, ir.Constant(ir.IntType(1), 0))  # a NaN byte seen in the row

        def chunk(at, parity):
            f = _decode16(builder, wp, at)
            for t in range(ntok):
                xv = _load_x(builder, xps[t], at, x_kind)
                p = parts[t][parity]
                builder.store(builder.call(fma, [f, xv, builder.load(p)]), p)

        with cgutils.for_range(builder, nkb) as loop:
            kb = loop.index
            base = builder.mul(kb, _c(BLOCK))
            for line in (0, 64):  # both cache lines of the block, PREFETCH_BYTES ahead
                builder.call(prefetch, [builder.gep(wp, [builder.add(base, _c(PREFETCH_BYTES + line))]),
                                        _c(0, _I32), _c(PREFETCH_LOCALITY, _I32), _c(1, _I32)])
            for pair in parts:
                for p in pair:
                    builder.store(zero, p)
            chunks = builder.lshr(builder.sub(k, base), _c(4))
            full = builder.icmp_unsigned(">=", chunks, _c(BLOCK // 16))
            with builder.if_else(full) as (whole, tail):
                with whole:  # the common case, unrolled: 8 chunks of 16
                    for c in range(BLOCK // 16):
                        chunk(builder.add(base, _c(16 * c)), c % 2)
                    for half in (0, 64):
                        builder.store(builder.or_(builder.load(nan), _nan_bytes(builder, wp, builder.add(
                            base, _c(half)), 64)), nan)
                with tail:  # the row's last, shorter block
                    with cgutils.for_range(builder, chunks) as cl:
                        at = builder.add(base, builder.mul(cl.index, _c(16)))
                        chunk(at, 0)
                        builder.store(builder.or_(builder.load(nan), _nan_bytes(builder, wp, at, 16)), nan)
            sc = _splat16(builder, builder.fmul(builder.load(builder.gep(sp, [kb])), ir.Constant(_F32, 256.0)))
            for t in range(ntok):
                block_sum = builder.fadd(builder.load(parts[t][0]), builder.load(parts[t][1]))
                builder.store(builder.call(fma, [block_sum, sc, builder.load(accs[t])]), accs[t])
        sums = []
        any_nan = builder.load(nan)
        for t in range(ntok):  # a NaN weight makes the dot NaN (as NaN times any value would)
            sums.append(builder.select(any_nan, ir.Constant(_F32, float("nan")),
                                       lane_tree(builder, builder.load(accs[t]))))  # halves, pairwise
        if ntok == 1:
            return sums[0]
        return context.make_tuple(builder, signature.return_type, sums)
    return codegen


def _signature(ntok, args, x_kind="f32"):
    if not all(isinstance(a, types.Integer) for a in args):
        return None
    ret = types.float32 if ntok == 1 else types.UniTuple(types.float32, ntok)
    return ret(*args), _codegen(ntok, x_kind)


@intrinsic
def fp8_dot1(typingctx, w, s, x, o0, k):
    """Row (value bytes at ``w``, float32 block scales at ``s``) . token at element offset ``o0`` of ``x``."""
    return _signature(1, (w, s, x, o0, k))


@intrinsic
def fp8_dot2(typingctx, w, s, x, o0, o1, k):
    """:func:`fp8_dot1` for two tokens (each value decoded once)."""
    return _signature(2, (w, s, x, o0, o1, k))


@intrinsic
def fp8_dot4(typingctx, w, s, x, o0, o1, o2, o3, k):
    """:func:`fp8_dot1` for four tokens."""
    return _signature(4, (w, s, x, o0, o1, o2, o3, k))
