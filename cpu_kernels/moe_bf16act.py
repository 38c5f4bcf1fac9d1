"""bf16 and fp8_block expert rows dotted with bf16 token rows: the reduced-activation path of the two formats the
int8 dots do not cover (:func:`freetoken.cpu_kernels.moe_experts.uses_q8`).

Why. On one thread the float path read fp8_block at 47-50% of the memory bandwidth: per 16 weights it widens,
shifts, masks and converts (``vcvtph2ps``) and then does one FMA per token, and that work, not the memory, set the
pace. AVX512-BF16's ``vdpbf16ps`` multiplies 32 bf16 pairs and adds them into 16 float32 lanes in one instruction,
so with the tokens in bf16 (rounded once per call, to nearest even, by :func:`bf16_round_row`):

* fp8_block, per 64 code bytes: two ``vpermi2b`` table lookups (AVX512-VBMI; the tables are 128 bytes, the code's 7
  magnitude bits index them) give the low and the high byte of each code's bf16 value (every e4m3 value is a normal
  bf16 number, and e4m3fn's NaN codes give a bf16 NaN, so a NaN weight reaches the dot without a separate check),
  the code's sign bit is ORed into the high byte, two ``vpermt2b`` interleave the bytes into 2 x 32 bf16 weights in
  the natural order, then one ``vdpbf16ps`` per 32 weights and token; per 128-value block the sum is scaled once;
* bf16: the stored values are the operands: one load and one ``vdpbf16ps`` per 32 weights and token.

The numerics change in one place only: the token values are bf16 (relative rounding 2^-9 per value, the same order as
the int8 path's 8-bit blocks); the products of a bf16 weight (or e4m3 value) and a bf16 token are exact in float32.
Without those instructions (AVX2, AVX-512 without BF16 or VBMI, or the portable level) the same bf16 token rows feed
portable code, so that ``activations="q8"`` means the same arithmetic on every machine: fp8_block through
:mod:`freetoken.cpu_kernels.moe_fp8`'s decode with the tokens widened exactly, bf16 as plain Numba loops. Results
then differ between machines by float32 summation order only. Which implementation compiles is
:func:`freetoken.device.simd.bf16_dots`.

Measured (bench/bench_experts.py, Qwen3-30B-A3B's expert shape, T = 1, k = 8, 2-core AMD EPYC with AVX-512 + BF16,
prefetches into L2: :data:`freetoken.cpu_kernels.moe_memory.PREFETCH_LOCALITY`), ms per call and share of the read
bandwidth measured around it, two runs each:

=============  ==========================  ==========================  ==========================
format         one thread: bf16 tokens     one thread: float path      two threads: bf16 tokens
=============  ==========================  ==========================  ==========================
fp8_block      1.83 / 1.77 ms (76%, 74%)   3.79 / 2.97 ms (37%, 45%)   1.20 / 0.97 ms (96%, 84%)
bf16           3.36 / 3.41 ms (70%, 74%)   5.08 / 3.77 ms (55%, 66%)   2.38 / 1.95 ms (93%, 76%)
=============  ==========================  ==========================  ==========================

Compiled for Haswell (AVX2 only; the portable code): bf16 with bf16 tokens 2.9-3.2 ms (74-81%) against the float
path's 4.1-4.6 ms on one thread, so "auto" takes it; fp8_block's float path 3.1-3.5 ms (34-36%) against 3.9-4.3 ms
with bf16 tokens, so "auto" keeps the float path there (bound by the decode; 49-62% on two threads).
"""

from __future__ import annotations

import numba as nb
import numpy as np
from freetoken.cpu_kernels.lanes import broadcast, fmuladd, lane_tree
from freetoken.cpu_kernels.moe_fp8 import _signature as _fp8_signature
from freetoken.cpu_kernels.moe_memory import PREFETCH_BYTES, PREFETCH_LOCALITY, declare_prefetch, typed_ptr
from freetoken.cpu_kernels.moe_rows import FASTMATH, _bf16  # a stored bf16 value widened exactly
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from freetoken.device.simd import bf16_dots

_I8, _I16, _I32, _I64, _F32 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64), ir.FloatType()
_U32 = np.uint32
_F32N = np.float32
#: Values per fp8_block scale block along K.
BLOCK = 128


class _BFloat(ir.types._BaseFloatType):
    """LLVM's ``bfloat``, which llvmlite's IR builder does not define: the operand type of ``vdpbf16ps``."""

    intrinsic_name = "bf16"

    def __str__(self):
        return "bfloat"


_BFloat._create_instance()
_BF = _BFloat()
_V16F = ir.VectorType(_F32, 16)
_V32BF = ir.VectorType(_BF, 32)
_V64B = ir.VectorType(_I8, 64)


def _c(v, t=_I64):
    return ir.Constant(t, v)


def e4m3_bf16_bits() -> np.ndarray:
    """uint16 [128]: the bf16 bits of each e4m3fn magnitude code (sign bit clear); 0x7F (NaN) gives a quiet NaN."""
    out = np.zeros(128, np.uint16)
    for code in range(127):
        e, m = code >> 3, code & 7
        v = np.float32((m / 8) * 2.0 ** -6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7))
        out[code] = np.asarray(v, np.float32).view(np.uint32) >> 16  # exact: 4 significant bits at most
    out[0x7F] = 0x7FC0
    return out


_TABLE = e4m3_bf16_bits()
_LO = [int(v) & 0xFF for v in _TABLE]
_HI = [int(v) >> 8 for v in _TABLE]


def _interleave(half: int):
    """shufflevector mask: low bytes ``a[j]`` and high bytes ``b[j]`` of values 32 * half .. 32 * half + 31, paired."""
    return ir.Constant(ir.VectorType(_I32, 64), [i for j in range(32 * half, 32 * half + 32) for i in (j, 64 + j)])


def _hw_fp8_codegen(ntok):
    """``vdpbf16ps`` codegen; arguments as :mod:`freetoken.cpu_kernels.moe_fp8`'s dots with x holding bf16 bits."""
    def codegen(context, builder, signature, args):
        w, s, x, *offs, k = (context.cast(builder, a, t, types.uint64)
                             for a, t in zip(args, signature.args, strict=True))
        wp, sp = typed_ptr(builder, w, _I8), typed_ptr(builder, s, _F32)
        xps = [builder.gep(typed_ptr(builder, x, _I16), [o]) for o in offs]
        mod = builder.module
        lookup = cgutils.get_or_insert_function(mod, ir.FunctionType(_V64B, [_V64B] * 3),
                                                "llvm.x86.avx512.vpermi2var.qi.512")
        dot = cgutils.get_or_insert_function(mod, ir.FunctionType(_V16F, [_V16F, _V32BF, _V32BF]),
                                             "llvm.x86.avx512bf16.dpbf16ps.512")
        fma, prefetch = fmuladd(builder), declare_prefetch(mod)
        lo_tab = [ir.Constant(_V64B, _LO[:64]), ir.Constant(_V64B, _LO[64:])]
        hi_tab = [ir.Constant(_V64B, _HI[:64]), ir.Constant(_V64B, _HI[64:])]
        sign = ir.Constant(_V64B, [0x80] * 64)
        zero = ir.Constant(_V16F, [0.0] * 16)
        accs = [cgutils.alloca_once_value(builder, zero) for _ in range(ntok)]
        parts = [[cgutils.alloca_once(builder, _V16F) for _ in range(2)] for _ in range(ntok)]

        def weights(raw, halves):
            """The bf16 weights of 64 codes (``raw``), as ``halves`` vectors of 32."""
            lo = builder.call(lookup, [lo_tab[0], raw, lo_tab[1]])
            hi = builder.or_(builder.call(lookup, [hi_tab[0], raw, hi_tab[1]]), builder.and_(raw, sign))
            return [builder.bitcast(builder.shuffle_vector(lo, hi, _interleave(h)), _V32BF) for h in range(halves)]

        def dots(ws, at):
            """Each token's 32 values from ``at`` (then ``at + 32``) times ``ws``, into its partial sums."""
            for h, wv in enumerate(ws):
                for t in range(ntok):
                    xv = builder.load(builder.bitcast(builder.gep(xps[t], [builder.add(at, _c(32 * h))]),
                                                      _V32BF.as_pointer()), align=2)
                    p = parts[t][h]
                    builder.store(builder.call(dot, [builder.load(p), wv, xv]), p)

        nkb = builder.lshr(builder.add(k, _c(BLOCK - 1)), _c(7))
        with cgutils.for_range(builder, nkb) as loop:
            kb = loop.index
            base = builder.mul(kb, _c(BLOCK))
            for line in (0, 64):
                builder.call(prefetch, [builder.gep(wp, [builder.add(base, _c(PREFETCH_BYTES + line))]),
                                        _c(0, _I32), _c(PREFETCH_LOCALITY, _I32), _c(1, _I32)])
            for pair in parts:
                for p in pair:
                    builder.store(zero, p)
            rest = builder.sub(k, base)
            with builder.if_else(builder.icmp_unsigned(">=", rest, _c(BLOCK))) as (whole, tail):
                with whole:  # the common case: two chunks of 64 codes
                    for ch in (0, 64):
                        at = builder.add(base, _c(ch))
                        raw = builder.load(builder.bitcast(builder.gep(wp, [at]), _V64B.as_pointer()), align=1)
                        dots(weights(raw, 2), at)
                with tail:  # the row's last block: 32, 64 or 96 codes (K is a multiple of 32), 32 at a time
                    with cgutils.for_range(builder, builder.lshr(rest, _c(5))) as cl:
                        at = builder.add(base, builder.mul(cl.index, _c(32)))
                        v32 = ir.VectorType(_I8, 32)
                        raw32 = builder.load(builder.bitcast(builder.gep(wp, [at]), v32.as_pointer()), align=1)
                        raw = builder.shuffle_vector(raw32, ir.Constant(v32, [0] * 32),
                                                     ir.Constant(ir.VectorType(_I32, 64), list(range(64))))
                        dots(weights(raw, 1), at)
            sc = broadcast(builder, builder.load(builder.gep(sp, [kb])))
            for t in range(ntok):
                block_sum = builder.fadd(builder.load(parts[t][0]), builder.load(parts[t][1]))
                builder.store(builder.call(fma, [block_sum, sc, builder.load(accs[t])]), accs[t])
        sums = [lane_tree(builder, builder.load(a)) for a in accs]
        return sums[0] if ntok == 1 else context.make_tuple(builder, signature.return_type, sums)
    return codegen


def _hw_bf16_codegen(ntok):
    """``vdpbf16ps`` codegen of a bf16 row: arguments w (the row's first value), x (bf16 token rows), ``ntok``
    element offsets, k (a multiple of 32)."""
    def codegen(context, builder, signature, args):
        w, x, *offs, k = (context.cast(builder, a, t, types.uint64) for a, t in zip(args, signature.args, strict=True))
        wp = typed_ptr(builder, w, _I16)
        xps = [builder.gep(typed_ptr(builder, x, _I16), [o]) for o in offs]
        mod = builder.module
        dot = cgutils.get_or_insert_function(mod, ir.FunctionType(_V16F, [_V16F, _V32BF, _V32BF]),
                                             "llvm.x86.avx512bf16.dpbf16ps.512")
        prefetch = declare_prefetch(mod)
        zero = ir.Constant(_V16F, [0.0] * 16)
        accs = [[cgutils.alloca_once_value(builder, zero) for _ in range(2)] for _ in range(ntok)]

        def step(at, parity):
            wv = builder.load(builder.bitcast(builder.gep(wp, [at]), _V32BF.as_pointer()), align=2)
            for t in range(ntok):
                xv = builder.load(builder.bitcast(builder.gep(xps[t], [at]), _V32BF.as_pointer()), align=2)
                a = accs[t][parity]
                builder.store(builder.call(dot, [builder.load(a), wv, xv]), a)

        groups = builder.lshr(k, _c(7))  # 128 values (256 bytes) at a time
        with cgutils.for_range(builder, groups) as loop:
            base = builder.mul(loop.index, _c(128))
            pf = builder.bitcast(builder.gep(wp, [builder.add(base, _c(PREFETCH_BYTES // 2))]), _I8.as_pointer())
            for line in range(4):
                builder.call(prefetch, [builder.gep(pf, [_c(64 * line)]), _c(0, _I32), _c(PREFETCH_LOCALITY, _I32),
                                        _c(1, _I32)])
            for c in range(4):
                step(builder.add(base, _c(32 * c)), c % 2)
        done = builder.shl(groups, _c(7))
        with cgutils.for_range(builder, builder.lshr(builder.sub(k, done), _c(5))) as loop:
            step(builder.add(done, builder.mul(loop.index, _c(32))), 0)
        sums = [lane_tree(builder, builder.fadd(builder.load(a), builder.load(b))) for a, b in accs]
        return sums[0] if ntok == 1 else context.make_tuple(builder, signature.return_type, sums)
    return codegen


def _signature(ntok, args, codegen):
    if not all(isinstance(a, types.Integer) for a in args):
        return None
    ret = types.float32 if ntok == 1 else types.UniTuple(types.float32, ntok)
    return ret(*args), codegen(ntok)


_HW = bf16_dots()


def _fp8(ntok, args):
    return _signature(ntok, args, _hw_fp8_codegen) if _HW else _fp8_signature(ntok, args, "bf16")


@intrinsic
def fp8_bfa_dot1(typingctx, w, s, x, o0, k):
    """fp8_block row (codes at ``w``, float32 block scales at ``s``) . the bf16 token at element offset ``o0`` of
    ``x``."""
    return _fp8(1, (w, s, x, o0, k))


@intrinsic
def fp8_bfa_dot2(typingctx, w, s, x, o0, o1, k):
    """:func:`fp8_bfa_dot1` for two tokens (each code decoded once)."""
    return _fp8(2, (w, s, x, o0, o1, k))


@intrinsic
def fp8_bfa_dot4(typingctx, w, s, x, o0, o1, o2, o3, k):
    """:func:`fp8_bfa_dot1` for four tokens."""
    return _fp8(4, (w, s, x, o0, o1, o2, o3, k))


@intrinsic
def _hw_bf16_dot1(typingctx, w, x, o0, k):
    return _signature(1, (w, x, o0, k), _hw_bf16_codegen)


@intrinsic
def _hw_bf16_dot2(typingctx, w, x, o0, o1, k):
    return _signature(2, (w, x, o0, o1, k), _hw_bf16_codegen)


@intrinsic
def _hw_bf16_dot4(typingctx, w, x, o0, o1, o2, o3, k):
    return _signature(4, (w, x, o0, o1, o2, o3, k), _hw_bf16_codegen)


# ---- portable bf16 x bf16 rows: plain loops the vectoriser handles (float32 FMAs of exactly widened values) ----


@nb.njit(error_model="numpy", fastmath=FASTMATH, inline="always")
def _bf16_dot1(w, x, o0, k):
    a0 = _F32N(0.0)
    for i in range(k):
        a0 += _bf16(w, i) * _bf16(x, o0 + i)
    return a0


@nb.njit(error_model="numpy", fastmath=FASTMATH, inline="always")
def _bf16_dot2(w, x, o0, o1, k):
    a0 = a1 = _F32N(0.0)
    for i in range(k):
        v = _bf16(w, i)
        a0 += v * _bf16(x, o0 + i)
        a1 += v * _bf16(x, o1 + i)
    return a0, a1


@nb.njit(error_model="numpy", fastmath=FASTMATH, inline="always")
def _bf16_dot4(w, x, o0, o1, o2, o3, k):
    a0 = a1 = a2 = a3 = _F32N(0.0)
    for i in range(k):
        v = _bf16(w, i)
        a0 += v * _bf16(x, o0 + i)
        a1 += v * _bf16(x, o1 + i)
        a2 += v * _bf16(x, o2 + i)
        a3 += v * _bf16(x, o3 + i)
    return a0, a1, a2, a3


#: bf16 row (values at ``w``) . bf16 tokens at element offsets ``o_t`` of ``x``, K values (a multiple of 32).
bf16_bfa_dot1 = _hw_bf16_dot1 if _HW else _bf16_dot1
bf16_bfa_dot2 = _hw_bf16_dot2 if _HW else _bf16_dot2
bf16_bfa_dot4 = _hw_bf16_dot4 if _HW else _bf16_dot4


@nb.njit(error_model="numpy", boundscheck=False, nogil=True)
def bf16_round_row(x, t, out):
    """Row ``t`` of ``x`` float32 [T, K] rounded to bf16 (to nearest, ties to even; NaN stays a quiet NaN of the
    same sign, infinities stay) into row t of ``out`` (int8 [.., 2 K]: the bits, little-endian). Not inlined: the
    kernels calling it use fast-math, this must not."""
    o16 = out[t].view(np.uint16)
    for j in range(x.shape[1]):
        u = _F32N(x[t, j]).view(_U32)
        if (u & _U32(0x7FFFFFFF)) > _U32(0x7F800000):
            b = (u >> _U32(16)) | _U32(0x40)
        else:
            b = (u + _U32(0x7FFF) + ((u >> _U32(16)) & _U32(1))) >> _U32(16)
        o16[j] = np.uint16(b)
