"""Routed-expert forward (the MoE FFN) on the CPU: Numba kernels reading expert records in place.

The cpu executor's twin of the routed expert CUDA kernels; reference
:func:`freetoken.ops.moe_reference.moe_forward_reference`:
``y[t] = sum_j weights[t, j] * (down_e @ act(gate_e @ x[t] + gb_e, up_e @ x[t] + ub_e) + db_e)``, ``e = ids[t, j]``.
Public entry point: :func:`forward`. Bank layouts: :mod:`freetoken.formats.base`.

One call:

1. groups the (token, expert) pairs by unique expert; a duplicate id in one token's row becomes one pair whose weight
   is the sum of both (the two contributions are identical, so this is exact up to rounding);
2. gate/up: ``prange`` over (unique expert, block of 8 rows). Each gate and up row is read from memory once, decoded in
   registers and dotted with every token routed to the expert (groups of 4, 2, 1 tokens; later groups re-read the
   row from L1/L2); the activation is applied per (row, token) into ``h [pairs, I]``;
3. down: ``prange`` over contiguous ranges of output rows; each thread streams every unique expert's rows of its range
   (experts outer: one long stream per expert) and accumulates into the ``y`` rows it owns (no atomics, a
   deterministic order).

Every record byte is read once per call; nothing is dequantized into memory; fp32 accumulation throughout.

Implementation notes (measured on a 2-core Zen 5, AVX-512):

* The nibble formats (mxfp4/ds_fp4, nvfp4, q4_0) decode through a 16-entry float table held in one SIMD register. Their
  row-dot intrinsics are written in portable LLVM vector IR: load 16 bytes, split the nibbles, ``extractelement``
  from a ``<16 x float>`` table, which X86 lowers to one ``vpermps`` per 16 weights (two permutes and a blend with
  AVX2; other targets get a correct scalarised lookup), then FMAs into 4 vector accumulators per token. Plain Numba
  turned the table lookup into a gather and the arithmetic e2m1 decode into ~3x more instructions: compute-bound at a
  third of the memory bandwidth. The row loops software-prefetch 8 KiB ahead: at the DeepSeek-V3 shape that took
  mxfp4 from 60% (2 KiB ahead) to ~90% of the read bandwidth. A single token dots two rows per call (half the
  per-row overhead, which matters for 768-wide down rows).
* The hot path passes raw addresses (``uint64`` from :func:`addr`) instead of arrays. Numba reference-counts every
  array passed to a function, inlined ones included, with atomic updates on the array's shared header; with two
  threads that cost ~18 ns per row call, more than decoding a 768-wide fp4 row. :func:`forward` validates every
  shape first and keeps the arrays alive: nothing in the kernels checks bounds.
* A scalar ``fpext half`` compiles to ``vpinsrw`` + ``vcvtph2ps``, and ``vpinsrw`` merged into a register holding a
  vector accumulator: a false dependency that serialised every q4_0 block. q4_0 converts the two fp16 scales of a
  block pair with one vector ``vcvtph2ps`` instead (the odd tail block uses exact integer code).
* Everything lives in this one module: Numba's on-disk cache (``cache=True``) is invalidated by the kernel's own
  source file only, so kernels split across modules would keep stale machine code after an edit to a helper module.

K order: for the nibble formats each group of 32 K elements is processed as its 16 low nibbles, then its 16 high
nibbles ("block split"). For q4_0 that is the natural element order; for nvfp4/mxfp4/ds_fp4 (low nibble = even
element) the token vectors are permuted the same way once per call (:func:`block_split_perm`), and the gate/up kernel
writes ``h`` directly in the down matrix's order. bf16 and fp8_block use the natural order.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import ml_dtypes
import numba as nb
import numpy as np
from llvmlite import ir
from llvmlite.binding import llvm_version_info
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from freetoken.ops.constants import ACT_GPT_OSS, ACT_SWIGLU, GPT_OSS_ALPHA, GPT_OSS_LIMIT

__all__ = ["ACT_GPT_OSS", "ACT_SWIGLU", "FORMAT_CODES", "forward"]

# Format codes of the kernels (mxfp4 and ds_fp4 share banks and kernel).
FMT_BF16 = 0
FMT_FP8_BLOCK = 1
FMT_NVFP4 = 2
FMT_MXFP4 = 3
FMT_Q4_0 = 4
FORMAT_CODES = {"bf16": FMT_BF16, "fp8_block": FMT_FP8_BLOCK, "nvfp4": FMT_NVFP4, "mxfp4": FMT_MXFP4,
                "ds_fp4": FMT_MXFP4, "q4_0": FMT_Q4_0}
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
#: Rows of the gate/up matrices per work item.
ROWS_GATE_UP = 8
#: Software prefetch distance of the nibble-format row loops, in value bytes.
PREFETCH_BYTES = 8192

_F32 = np.float32
_U32 = np.uint32
_U64 = np.uint64


def block_split_perm(k: int) -> np.ndarray:
    """``p`` with ``ordered[j] = element[p[j]]`` for the e2m1 formats (K a multiple of 32)."""
    j = np.arange(k)
    blk, r = j // 32, j % 32
    return blk * 32 + np.where(r < 16, 2 * r, 2 * (r - 16) + 1)


# ------------------------------------------------------------------------------------------ raw memory intrinsics

_I32 = ir.IntType(32)
_I64 = ir.IntType(64)
_F32T = ir.FloatType()
# the prefetch intrinsic is mangled by its pointer type: opaque pointers since LLVM 15
_PREFETCH_NAME = "llvm.prefetch.p0" if llvm_version_info >= (15,) else "llvm.prefetch.p0i8"


@intrinsic
def addr(typingctx, arr):
    """Address of an array's first element as uint64 (the caller keeps the array alive)."""
    if not isinstance(arr, types.Array):
        return None

    def codegen(context, builder, signature, args):
        data = context.make_array(signature.args[0])(context, builder, args[0]).data
        return builder.ptrtoint(data, ir.IntType(64))
    return types.uint64(arr), codegen


def _typed_ptr(builder, address, lltype):
    return builder.inttoptr(address, lltype.as_pointer())


def _make_load(nbtype, lltype):
    def load(typingctx, address, index):
        if not (isinstance(address, types.Integer) and isinstance(index, types.Integer)):
            return None

        def codegen(context, builder, signature, args):
            a = context.cast(builder, args[0], signature.args[0], types.uint64)
            i = context.cast(builder, args[1], signature.args[1], types.intp)
            return builder.load(builder.gep(_typed_ptr(builder, a, lltype), [i]))
        return nbtype(address, index), codegen
    load.__name__ = load.__qualname__ = f"load_{nbtype}"
    return intrinsic(load)


@intrinsic
def prefetch(typingctx, address):
    """Software prefetch of the cache line at ``address`` (a hint: never faults)."""
    if not isinstance(address, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        a = context.cast(builder, args[0], signature.args[0], types.uint64)
        fn = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(ir.VoidType(), [ir.IntType(8).as_pointer(), _I32, _I32, _I32]),
            _PREFETCH_NAME)
        builder.call(fn, [_typed_ptr(builder, a, ir.IntType(8)), ir.Constant(_I32, 0), ir.Constant(_I32, 3),
                          ir.Constant(_I32, 1)])
        return context.get_dummy_value()
    return types.void(address), codegen


#: ``load_<t>(address, i)``: element ``i`` of the ``<t>`` array at ``address``.
load_u8 = _make_load(types.uint8, ir.IntType(8))
load_u16 = _make_load(types.uint16, ir.IntType(16))
load_i64 = _make_load(types.int64, ir.IntType(64))
load_f32 = _make_load(types.float32, ir.FloatType())


@intrinsic
def store_f32(typingctx, address, index, value):
    """``((float32 *) address)[index] = value``."""
    if not (isinstance(address, types.Integer) and isinstance(index, types.Integer) and value == types.float32):
        return None

    def codegen(context, builder, signature, args):
        a = context.cast(builder, args[0], signature.args[0], types.uint64)
        i = context.cast(builder, args[1], signature.args[1], types.intp)
        builder.store(args[2], builder.gep(_typed_ptr(builder, a, ir.FloatType()), [i]))
        return context.get_dummy_value()
    return types.void(address, index, value), codegen


# --------------------------------------------------------------------------------- nibble formats: LLVM vector IR
# 16 value bytes (32 weights) per step: nibbles looked up in a 16-entry float table (one variable permute each),
# scaled, multiplied into 4 vector accumulators per (row, token) (two blocks per loop iteration: independent FMA
# chains). Scales: mx: e8m0 byte -> 256-entry table, folded into the 16-entry table; nv: two e4m3 bytes -> table,
# a per-lane multiply, the global applied once per row; q4: the fp16 pair of a block pair in one vcvtph2ps.

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

        wp0 = _typed_ptr(builder, w, ir.IntType(8))
        sp0 = _typed_ptr(builder, s, ir.IntType(16) if kind == "q4" else ir.IntType(8))
        scales_per_block = 2 if kind == "nv" else 1
        wps = [builder.gep(wp0, [builder.mul(nblk, const(16 * r))]) for r in range(nrow)]
        sps = [builder.gep(sp0, [builder.mul(nblk, const(scales_per_block * r))]) for r in range(nrow)]
        stp = _typed_ptr(builder, stab, _F32T)
        xp = _typed_ptr(builder, x, _F32T)
        table = builder.load(_typed_ptr(builder, tbl, _V16F), align=4)
        fmuladd = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_V16F, [_V16F] * 3),
                                                 "llvm.fmuladd.v16f32")
        prefetch = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(ir.VoidType(), [ir.IntType(8).as_pointer(), _I32, _I32, _I32]),
            _PREFETCH_NAME)
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
                builder.call(prefetch, [ahead, ir.Constant(_I32, 0), ir.Constant(_I32, 3), ir.Constant(_I32, 1)])
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
                for width in (8, 4, 2, 1):  # tree reduction of the 16 lanes
                    sh = builder.shuffle_vector(acc, _UNDEF16, ir.Constant(
                        _V16I32, [width + i for i in range(width)] + [0] * (16 - width)))
                    acc = builder.fadd(acc, sh)
                total = builder.extract_element(acc, ir.Constant(_I32, 0))
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


# ------------------------------------------------------------------------------------ bf16 and fp8_block: Numba

@nb.njit(inline="always")
def _bf16(w16, i):
    return _U32(_U32(load_u16(w16, i)) << _U32(16)).view(_F32)


@nb.njit(inline="always")
def _e4m3(w8, i):
    """e4m3fn byte -> float32 in vectorisable integer/float arithmetic (subnormals and NaN exact)."""
    b = _U32(load_u8(w8, i))
    mag = _U32(b & _U32(0x7F))
    normal = _U32(_U32(mag << _U32(20)) + _U32(120 << 23)).view(_F32)
    v = _F32(mag) * _F32(1.0 / 512.0) if mag < _U32(8) else normal  # exponent 0: m * 2^-9
    v = _F32(np.nan) if mag == _U32(0x7F) else v
    return -v if b >= _U32(0x80) else v


@nb.njit(fastmath=FASTMATH, inline="always")
def _bf16_dot1(w16, src, x, o0, n):
    a0 = _F32(0.0)
    for i in range(n):
        a0 += _bf16(w16, src + i) * load_f32(x, o0 + i)
    return a0


@nb.njit(fastmath=FASTMATH, inline="always")
def _bf16_dot2(w16, src, x, o0, o1, n):
    a0 = a1 = _F32(0.0)
    for i in range(n):
        v = _bf16(w16, src + i)
        a0 += v * load_f32(x, o0 + i)
        a1 += v * load_f32(x, o1 + i)
    return a0, a1


@nb.njit(fastmath=FASTMATH, inline="always")
def _bf16_dot4(w16, src, x, o0, o1, o2, o3, n):
    a0 = a1 = a2 = a3 = _F32(0.0)
    for i in range(n):
        v = _bf16(w16, src + i)
        a0 += v * load_f32(x, o0 + i)
        a1 += v * load_f32(x, o1 + i)
        a2 += v * load_f32(x, o2 + i)
        a3 += v * load_f32(x, o3 + i)
    return a0, a1, a2, a3


@nb.njit(inline="always")
def _fp8_row(e, n, rows, k):
    """(first value index, first scale index, scale blocks per row) of row n of matrix e."""
    nkb = (k + _U64(127)) >> _U64(7)
    return (e * rows + n) * k, (e * ((rows + _U64(127)) >> _U64(7)) + (n >> _U64(7))) * nkb, nkb


@nb.njit(fastmath=FASTMATH, inline="always")
def _fp8_dot1(w8, s32, e, n, rows, k, x, o0):
    src, sb, nkb = _fp8_row(e, n, rows, k)
    a0 = _F32(0.0)
    for kb in range(nkb):  # one 128-column scale block at a time
        prefetch(w8 + src + (kb << _U64(7)) + _U64(PREFETCH_BYTES))
        p0 = _F32(0.0)
        for i in range(kb << _U64(7), min((kb + _U64(1)) << _U64(7), k)):
            p0 += _e4m3(w8, src + i) * load_f32(x, o0 + i)
        a0 += p0 * load_f32(s32, sb + kb)
    return a0


@nb.njit(fastmath=FASTMATH, inline="always")
def _fp8_dot2(w8, s32, e, n, rows, k, x, o0, o1):
    src, sb, nkb = _fp8_row(e, n, rows, k)
    a0 = a1 = _F32(0.0)
    for kb in range(nkb):
        prefetch(w8 + src + (kb << _U64(7)) + _U64(PREFETCH_BYTES))
        p0 = p1 = _F32(0.0)
        for i in range(kb << _U64(7), min((kb + _U64(1)) << _U64(7), k)):
            v = _e4m3(w8, src + i)
            p0 += v * load_f32(x, o0 + i)
            p1 += v * load_f32(x, o1 + i)
        sc = load_f32(s32, sb + kb)
        a0 += p0 * sc
        a1 += p1 * sc
    return a0, a1


@nb.njit(fastmath=FASTMATH, inline="always")
def _fp8_dot4(w8, s32, e, n, rows, k, x, o0, o1, o2, o3):
    src, sb, nkb = _fp8_row(e, n, rows, k)
    a0 = a1 = a2 = a3 = _F32(0.0)
    for kb in range(nkb):
        prefetch(w8 + src + (kb << _U64(7)) + _U64(PREFETCH_BYTES))
        p0 = p1 = p2 = p3 = _F32(0.0)
        for i in range(kb << _U64(7), min((kb + _U64(1)) << _U64(7), k)):
            v = _e4m3(w8, src + i)
            p0 += v * load_f32(x, o0 + i)
            p1 += v * load_f32(x, o1 + i)
            p2 += v * load_f32(x, o2 + i)
            p3 += v * load_f32(x, o3 + i)
        sc = load_f32(s32, sb + kb)
        a0 += p0 * sc
        a1 += p1 * sc
        a2 += p2 * sc
        a3 += p3 * sc
    return a0, a1, a2, a3


# ---------------------------------------------------------------------------------------------------- dispatch
# Row ``n`` of matrix ``e`` ([rows, k]) of a format, dotted with token vectors at element offsets ``o_t`` of the
# float32 array at address ``x`` (in the format's K order). ``w``, ``s``, ``g``: addresses of the matrix's value bank,
# scale bank and nvfp4 globals float32 [E] (a dummy where the format has none). ``fmt`` is a runtime value: the
# branches are per row, the loops inside them are format-specific.

@nb.njit(fastmath=FASTMATH, inline="always")
def _row(e, rows, n, k):
    return _U64(e) * _U64(rows) + _U64(n), k >> _U64(5)


@nb.njit(fastmath=FASTMATH, inline="always")
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
    elif fmt == FMT_BF16:
        res = _bf16_dot1(w, row * k, x, o0, k)
    else:
        res = _fp8_dot1(w, s, _U64(e), _U64(n), _U64(rows), k, x, o0)
    return res


@nb.njit(fastmath=FASTMATH, inline="always")
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
    elif fmt == FMT_BF16:
        res = _bf16_dot2(w, row * k, x, o0, o1, k)
    else:
        res = _fp8_dot2(w, s, _U64(e), _U64(n), _U64(rows), k, x, o0, o1)
    return res


@nb.njit(fastmath=FASTMATH, inline="always")
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
    elif fmt == FMT_BF16:
        res = _bf16_dot4(w, row * k, x, o0, o1, o2, o3, k)
    else:
        res = _fp8_dot4(w, s, _U64(e), _U64(n), _U64(rows), k, x, o0, o1, o2, o3)
    return res


@nb.njit(fastmath=FASTMATH, inline="always")
def row_dot1x2(fmt, w, s, g, e, n, rows, k, x, o0):
    """Rows n and n + 1 with one token vector: (dot_n, dot_n+1). Nibble formats only."""
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
    else:  # unreachable: the kernels pair rows for the nibble formats only (bf16 already streams at full speed)
        res = _F32(np.nan), _F32(np.nan)
    return res


@nb.njit(fastmath=FASTMATH, inline="always")
def rows_dot(fmt, w, s, g, e, n, nr, rows, k, x, offs, npairs, acc):
    """Rows ``n .. n + nr - 1`` of matrix ``e`` dotted with the vectors at ``offs[:npairs]`` (int64 address) into
    ``acc[r * npairs + q]`` (float32 address). ``nr`` is 1, or 2 with a single vector (the T = 1 path); tokens go in
    groups of 4, 2, 1."""
    if nr == 2:
        r2 = row_dot1x2(fmt, w, s, g, e, n, rows, k, x, load_i64(offs, 0))
        store_f32(acc, 0, r2[0])
        store_f32(acc, 1, r2[1])
        return
    q = 0
    while npairs - q >= 4:
        r4 = row_dot4(fmt, w, s, g, e, n, rows, k, x, load_i64(offs, q), load_i64(offs, q + 1),
                      load_i64(offs, q + 2), load_i64(offs, q + 3))
        store_f32(acc, q, r4[0])
        store_f32(acc, q + 1, r4[1])
        store_f32(acc, q + 2, r4[2])
        store_f32(acc, q + 3, r4[3])
        q += 4
    if npairs - q >= 2:
        r2 = row_dot2(fmt, w, s, g, e, n, rows, k, x, load_i64(offs, q), load_i64(offs, q + 1))
        store_f32(acc, q, r2[0])
        store_f32(acc, q + 1, r2[1])
        q += 2
    if npairs - q >= 1:
        store_f32(acc, q, row_dot1(fmt, w, s, g, e, n, rows, k, x, load_i64(offs, q)))


# ------------------------------------------------------------------------------------------------------ kernels

@nb.njit(cache=True)
def _group_pairs(ids, weights, num_experts):
    """Unique experts (ascending) and their tokens; duplicate (token, expert) pairs merged by summing weights.

    Returns ``uniq [U]``, ``poff [U + 1]`` (pairs of ``uniq[u]`` are ``poff[u]:poff[u + 1]``), ``ptok [P]``,
    ``pw [P]`` (float32) and ``bad``: -1, or the flat position ``t * k + j`` of the first out-of-range id.
    """
    t_count, k = ids.shape
    m = t_count * k
    keys = np.empty(m, np.int64)
    for t in range(t_count):
        for j in range(k):
            e = ids[t, j]
            if e < 0 or e >= num_experts:
                return (np.empty(0, np.int32), np.empty(1, np.int32), np.empty(0, np.int32),
                        np.empty(0, np.float32), np.int64(t * k + j))
            keys[t * k + j] = np.int64(e) * t_count + t
    order = np.argsort(keys, kind="mergesort")
    uniq = np.empty(m, np.int32)
    poff = np.empty(m + 1, np.int32)
    ptok = np.empty(m, np.int32)
    pw = np.empty(m, np.float32)
    u = -1
    p = -1
    prev_key = np.int64(-1)
    for q in range(m):
        i = order[q]
        key = keys[i]
        w = weights[i // k, i % k]
        if key == prev_key:
            pw[p] += w
            continue
        e = key // t_count
        p += 1
        if u < 0 or e != uniq[u]:
            u += 1
            uniq[u] = e
            poff[u] = p
        ptok[p] = key % t_count
        pw[p] = w
        prev_key = key
    poff[u + 1] = p + 1
    return uniq[:u + 1], poff[:u + 2], ptok[:p + 1], pw[:p + 1], np.int64(-1)


@nb.njit(inline="always")
def _activation(g, u, act):
    if act == ACT_SWIGLU:
        return g / (_F32(1.0) + np.exp(-g)) * u
    lim = _F32(GPT_OSS_LIMIT)
    g = lim if g > lim else g  # comparisons written so that NaN passes through, as np.minimum/np.clip do
    u = lim if u > lim else (-lim if u < -lim else u)
    return (u + _F32(1.0)) * g / (_F32(1.0) + np.exp(_F32(-GPT_OSS_ALPHA) * g))


@nb.njit(parallel=True, nogil=True, cache=True, boundscheck=False, fastmath=FASTMATH)
def _gate_up_kernel(fmt, gate, up, gb, ub, has_bias, act, uniq, poff, ptok, xa, hidden, inter, hperm, h, nthreads):
    """h[p, hperm[n]] = act(gate_e[n] . x[ptok[p]] + gb, up_e[n] . x[ptok[p]] + ub) for the pairs p of each e.

    ``gate``/``up``: addresses (values, scales, globals) of the matrices' banks; ``gb``/``ub``: addresses of the
    float32 [E, I] biases; ``xa``: address of the float32 [T, H] tokens in K order."""
    gw, gs, gg = gate
    uw, us, ug = up
    n_uniq = uniq.shape[0]
    nrb = (inter + ROWS_GATE_UP - 1) // ROWS_GATE_UP
    nitems = n_uniq * nrb
    pair_rows = fmt == FMT_MXFP4 or fmt == FMT_NVFP4 or fmt == FMT_Q4_0  # two rows per call for a single token
    max_pairs = 2  # >= 2: the two-row single-token path
    for ui in range(n_uniq):
        max_pairs = max(max_pairs, poff[ui + 1] - poff[ui])
    for wk in nb.prange(nthreads):
        accg = np.empty(max_pairs, np.float32)
        accu = np.empty(max_pairs, np.float32)
        offs = np.empty(max_pairs, np.int64)
        accg_a, accu_a, offs_a = addr(accg), addr(accu), addr(offs)
        for it in range(wk * nitems // nthreads, (wk + 1) * nitems // nthreads):
            ui = it // nrb
            r0 = (it % nrb) * ROWS_GATE_UP
            r_end = min(inter, r0 + ROWS_GATE_UP)
            e = uniq[ui]
            p0 = poff[ui]
            npairs = poff[ui + 1] - p0
            for q in range(npairs):
                offs[q] = ptok[p0 + q] * hidden
            n = r0
            while n < r_end:
                nr = 2 if pair_rows and npairs == 1 and n + 1 < r_end else 1
                for m in range(2):  # one inlined call site for gate and up: half the compile time
                    if m == 0:
                        w, s, g, acc = gw, gs, gg, accg_a
                    else:
                        w, s, g, acc = uw, us, ug, accu_a
                    rows_dot(fmt, w, s, g, e, n, nr, inter, hidden, xa, offs_a, npairs, acc)
                for rr in range(nr):
                    gbias = load_f32(gb, e * inter + n + rr) if has_bias else _F32(0.0)
                    ubias = load_f32(ub, e * inter + n + rr) if has_bias else _F32(0.0)
                    col = hperm[n + rr]
                    for q in range(npairs):
                        i = rr * npairs + q
                        h[p0 + q, col] = _activation(accg[i] + gbias, accu[i] + ubias, act)
                n += nr


@nb.njit(parallel=True, nogil=True, cache=True, boundscheck=False, fastmath=FASTMATH)
def _down_kernel(fmt, down, db, has_bias, uniq, poff, ptok, pw, h, hidden, inter, out, nthreads):
    """out[t, r] = sum over pairs p of token t: pw[p] * (down_e[r] . h[p] + db[e, r]); ``down``: bank addresses,
    ``db``: address of the float32 [E, H] biases."""
    dw, ds, dg = down
    ha = addr(h)
    n_uniq = uniq.shape[0]
    t_count = out.shape[0]
    pair_rows = fmt == FMT_MXFP4 or fmt == FMT_NVFP4 or fmt == FMT_Q4_0  # two rows per call for a single token
    max_pairs = 2  # >= 2: the two-row single-token path
    for ui in range(n_uniq):
        max_pairs = max(max_pairs, poff[ui + 1] - poff[ui])
    for wk in nb.prange(nthreads):
        acc = np.empty(max_pairs, np.float32)
        offs = np.empty(max_pairs, np.int64)
        acc_a, offs_a = addr(acc), addr(offs)
        # each worker owns a contiguous range of output rows (whole 16-row groups: 64-byte lines of out, even
        # counts for the row pairs); experts outer: one long stream per expert
        r0 = wk * (hidden // 16) // nthreads * 16
        r1 = (wk + 1) * (hidden // 16) // nthreads * 16
        for t in range(t_count):
            for r in range(r0, r1):
                out[t, r] = 0.0
        for ui in range(n_uniq):
            e = uniq[ui]
            p0 = poff[ui]
            npairs = poff[ui + 1] - p0
            for q in range(npairs):
                offs[q] = (p0 + q) * inter
            r = r0
            while r < r1:
                nr = 2 if pair_rows and npairs == 1 and r + 1 < r1 else 1
                rows_dot(fmt, dw, ds, dg, e, r, nr, hidden, inter, ha, offs_a, npairs, acc_a)
                for rr in range(nr):
                    bias = load_f32(db, e * hidden + r + rr) if has_bias else _F32(0.0)
                    for q in range(npairs):
                        out[ptok[p0 + q], r + rr] += pw[p0 + q] * (acc[rr * npairs + q] + bias)
                r += nr


# ------------------------------------------------------------------------------------------------------- launcher

@functools.cache
def _layout(fmt_name: str, hidden: int, inter: int, bias: bool):
    from freetoken.formats import RecordLayout, get

    layout = RecordLayout(get(fmt_name), hidden, inter, bias)
    specs = tuple((s.name, np.dtype(s.dtype), tuple(s.shape)) for s in layout.bank_specs())
    return specs


@functools.cache
def _perm(n: int, split: bool) -> np.ndarray:
    return (block_split_perm(n) if split else np.arange(n)).astype(np.int64)


@functools.cache
def _inverse_perm(n: int, split: bool) -> np.ndarray:
    return np.argsort(_perm(n, split)).astype(np.int64)


def _matrix_args(banks: dict, m: str) -> tuple[int, int, int]:
    """Addresses of one matrix's (values, scales, globals) banks, 0 where the format has none. Addresses rather than
    arrays: one kernel signature for every format and for read-only (memory-mapped) banks, which Numba would
    otherwise type and compile separately."""
    return tuple(banks[f"{m}.{b}"].ctypes.data if f"{m}.{b}" in banks else 0 for b in "wsg")


def _check_array(name, a, dtype, shape=None, ndim=None, contiguous=True):
    if not isinstance(a, np.ndarray):
        raise ValueError(f"{name}: expected a numpy array, got {type(a).__name__}")
    if a.dtype != dtype:
        raise ValueError(f"{name}: expected dtype {np.dtype(dtype)}, got {a.dtype}")
    if ndim is not None and a.ndim != ndim:
        raise ValueError(f"{name}: expected {ndim} dimensions, got shape {list(a.shape)}")
    if shape is not None and tuple(a.shape) != tuple(shape):
        raise ValueError(f"{name}: expected shape {list(shape)}, got {list(a.shape)}")
    if contiguous and not a.flags.c_contiguous:
        raise ValueError(f"{name}: must be C-contiguous")


def forward(fmt_name: str, x: np.ndarray, ids: np.ndarray, weights: np.ndarray, banks: dict, hidden: int,
            inter: int, act_code: int, out: np.ndarray, prepared: PreparedBanks | None = None) -> None:
    """Routed-expert forward on the CPU, reading the record banks in place.

    Parameters
    ----------
    fmt_name : one of ``bf16, fp8_block, nvfp4, mxfp4, ds_fp4, q4_0``
    x : float32 [T, H], C-contiguous activations
    ids : int32 [T, k] indices into the leading dimension of every bank (experts or cache slots); repeats allowed
        (the same expert twice in a row counts twice)
    weights : float32 [T, k] routing weights (any sign, any sum)
    banks : record banks (``RecordLayout(fmt, hidden, inter, bias).quantize(...)``), leading dimension E; biases
        ``gate.b``/``up.b`` [E, I] and ``down.b`` [E, H] (float32) are applied when present
    hidden, inter : H and I (multiples of 32)
    act_code : ``ACT_SWIGLU`` (0) or ``ACT_GPT_OSS`` (1)
    out : float32 [T, H], C-contiguous, overwritten with the weighted sum of the experts' outputs
    prepared : :func:`prepare` of these banks (skips re-validating them on every call)
    """
    if act_code not in (ACT_SWIGLU, ACT_GPT_OSS):
        raise ValueError(f"act_code must be {ACT_SWIGLU} (swiglu) or {ACT_GPT_OSS} (gpt_oss), got {act_code}")
    act_code = int(act_code)  # plain ints and addresses: one compiled signature per kernel
    p = prepared if prepared is not None else prepare(fmt_name, banks, hidden, inter)
    hidden, inter = p.hidden, p.inter
    _check_array("x", x, np.float32, ndim=2)
    t_count = x.shape[0]
    if x.shape[1] != hidden or t_count < 1:
        raise ValueError(f"x: expected shape [T >= 1, {hidden}], got {list(x.shape)}")
    _check_array("ids", ids, np.int32, ndim=2, contiguous=False)
    if ids.shape[0] != t_count or ids.shape[1] < 1:
        raise ValueError(f"ids: expected shape [{t_count}, k >= 1], got {list(ids.shape)}")
    _check_array("weights", weights, np.float32, shape=ids.shape, contiguous=False)
    ids, weights = np.ascontiguousarray(ids), np.ascontiguousarray(weights)
    _check_array("out", out, np.float32, shape=(t_count, hidden))

    uniq, poff, ptok, pw, bad = _group_pairs(ids, weights, p.num_experts)
    if bad >= 0:
        t, j = divmod(int(bad), ids.shape[1])
        raise ValueError(f"ids[{t}, {j}] = {int(ids[t, j])} is out of range: the banks hold {p.num_experts} experts")

    split = p.fmt in SPLIT_FORMATS
    xs = np.ascontiguousarray(x[:, _perm(hidden, True)]) if split else x
    h = np.empty((pw.shape[0], inter), np.float32)
    nthreads = nb.get_num_threads()
    # p.banks, xs and the biases stay referenced here while the kernels read them through their addresses
    _gate_up_kernel(p.fmt, p.gate, p.up, p.gb, p.ub, p.has_bias, act_code, uniq, poff, ptok, xs.ctypes.data, hidden,
                    inter, _inverse_perm(inter, split), h, nthreads)
    _down_kernel(p.fmt, p.down, p.db, p.has_bias, uniq, poff, ptok, pw, h, hidden, inter, out, nthreads)


class PreparedBanks(NamedTuple):
    """Validated record banks with their kernel arguments (addresses), made once by :func:`prepare`."""

    fmt: int
    hidden: int
    inter: int
    has_bias: bool
    num_experts: int
    gate: tuple
    up: tuple
    down: tuple
    gb: int
    ub: int
    db: int
    banks: dict  # keeps the arrays alive while their addresses are used


def prepare(fmt_name: str, banks: dict, hidden: int, inter: int) -> PreparedBanks:
    """Check ``banks`` against the ``fmt_name`` record layout of ``hidden`` x ``inter`` once; the result can be
    passed to :func:`forward` for every later call on the same (unmodified) banks."""
    if fmt_name not in FORMAT_CODES:
        raise ValueError(f"unknown expert format {fmt_name!r}; known: {', '.join(FORMAT_CODES)}")
    hidden, inter = int(hidden), int(inter)
    if hidden < 32 or inter < 32 or hidden % 32 or inter % 32:
        raise ValueError(f"hidden and inter must be positive multiples of 32, got {hidden} and {inter}")
    has_bias = "gate.b" in banks or "up.b" in banks or "down.b" in banks
    num_experts = None
    for name, dtype, shape in _layout(fmt_name, hidden, inter, has_bias):
        a = banks.get(name)
        if a is None:
            raise ValueError(f"banks: {fmt_name} record is missing {name!r} (have {sorted(banks)})")
        if num_experts is None:
            num_experts = a.shape[0] if isinstance(a, np.ndarray) and a.ndim else 0
        _check_array(f"banks[{name!r}]", a, dtype, shape=(num_experts, *shape))
    if num_experts < 1:
        raise ValueError("banks: no experts")
    gate, up, down = (_matrix_args(banks, m) for m in ("gate", "up", "down"))
    gb, ub, db = (banks[f"{m}.b"].ctypes.data if has_bias else 0 for m in ("gate", "up", "down"))
    return PreparedBanks(FORMAT_CODES[fmt_name], hidden, inter, has_bias, int(num_experts), gate, up, down,
                         gb, ub, db, dict(banks))
