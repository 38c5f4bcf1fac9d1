"""The GGUF block formats' float row dots (q8_0, q4_k, q5_k, q6_k, iq4_xs) as LLVM IR intrinsics: one decode per
format, shared by the expert row dots (:mod:`freetoken.cpu_kernels.moe_rows`, record banks) and the dense products
(:mod:`freetoken.cpu_kernels.qgemv`, verbatim GGUF rows).

A block (32 weights for q8_0, a 256-weight super-block for the k-quants) is a header (the scale bytes) and its quants;
bank layouts: :mod:`freetoken.formats.base`. Per block the decode unpacks the header once into vectors of per
sub-block float scales (the 6-bit scales and mins of q4_k/q5_k, the int8 scales of q6_k, the 6-bit scales of iq4_xs:
a handful of vector shifts and masks, no scalar loop), then turns each 16 consecutive weights into one
``<16 x float>`` in natural K order: 16 quant bytes widened to int32 lanes, nibbles/high bits masked and shifted in,
converted, and the sub-block's scale (and q5_k's min) applied lane-wise with one FMA; q4_k and iq4_xs look their
nibbles up in a 16-entry table of the sub-block's values made once per sub-block (one ``vpermps`` per 16 weights, as
the nibble formats do, :mod:`freetoken.cpu_kernels.moe_nibble`). The weights of a block are made once per row and
multiplied into 2-4 vector accumulators per (row, token): no horizontal sum before the end of the row, every weight
decoded once per row and call whatever the number of tokens (up to 4 per read). Natural K order everywhere: the
token vectors are never permuted.

Why IR rather than Numba loops: Numba's integer arithmetic widens the quant bytes to int64 and vectorises 4x
narrower (:mod:`freetoken.cpu_kernels.qgemv` writes its nibble unpack as an intrinsic for that reason), a table lookup
becomes a gather (:mod:`freetoken.cpu_kernels.moe_nibble`), and a loop per sub-block reduces per sub-block (a
horizontal sum per 32 weights and token). Here 16 weights cost 3 (q4_k, iq4_xs) to 7 (q6_k) vector instructions of
decode and one FMA per token.

Each block's quants are software-prefetched ``PREFETCH_BYTES`` ahead, as the other row dots do.

Measured (one thread, rows of K = 2048 in L2, this project's 2-core Xeon, AVX-512): weight bytes per second
q8_0 20 GB/s, q4_k 9.9, q5_k 9.0, q6_k 10.3, iq4_xs 10.7 for one token, the same for 4 (the decode is the work);
compiled for AVX2 on the same machine 11.8, 6.4, 5.6, 7.5, 6.7. In the expert forward at T = 1 (Qwen3-30B-A3B
shape, one thread) the k-quants read 7.7-8.5 GB/s, 60-70% of one thread's read bandwidth: one core is compute
bound; two cores' decode (2 x 8-10 GB/s) exceeds the 11-19 GB/s read bandwidth measured on that machine.

These float dots are the exact reference path (``activations="f32"``); by default the expert kernels read these
formats through their int8 row dots (q8_0: :mod:`freetoken.cpu_kernels.moe_int8`, the k-quants:
:mod:`freetoken.cpu_kernels.moe_int8_kquant`), which at the Qwen3-30B-A3B shape on two cores read 1.2x (q8_0) to
1.45x (q4_k, q5_k) more bytes per second. The dense products (:mod:`freetoken.cpu_kernels.qgemv`) use these.

Intrinsics (``code``: a format code, a runtime value dispatched once per call to its format's loop; ``gguf``: a
literal):

* ``kq_dot<N>(code, gguf, w, s, row, k, x, o_1, ..., o_N)``: row ``row`` (K = ``k`` weights) dotted with the N
  float32 token vectors at ``x + 4 * o_t`` (natural order); ``kq_dot1x2``: rows ``row`` and ``row + 1`` with one
  token. ``gguf`` False: ``w``/``s`` address the matrix's record banks (quants and headers, row-major, the leading
  expert dimension folded into ``row``); True: ``w`` addresses the GGUF block rows (``s`` unused).
* ``kq_decode(code, gguf, w, s, row, k, out)``: the row's weights as float32 at address ``out`` (the dense
  product's many-token path and ``dequantize_rows``).
"""

from __future__ import annotations

from freetoken.cpu_kernels.lanes import lane_tree
from freetoken.cpu_kernels.moe_int8 import lookup_bytes
from freetoken.cpu_kernels.moe_memory import PREFETCH_BYTES, PREFETCH_LOCALITY, declare_prefetch, typed_ptr
from freetoken.cpu_kernels.moe_nibble import _lookup
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from freetoken.device.simd import simd_level, target_features
from freetoken.formats.table import KERNEL_CODES

# Format codes of the expert kernels (the format table's, freetoken.formats.table), also the dense products' kinds.
FMT_Q8_0 = KERNEL_CODES["q8_0"]
FMT_Q4_K = KERNEL_CODES["q4_k"]
FMT_Q5_K = KERNEL_CODES["q5_k"]
FMT_Q6_K = KERNEL_CODES["q6_k"]
FMT_IQ4_XS = KERNEL_CODES["iq4_xs"]
KQUANT_CODES = {"q8_0": FMT_Q8_0, "q4_k": FMT_Q4_K, "q5_k": FMT_Q5_K, "q6_k": FMT_Q6_K, "iq4_xs": FMT_IQ4_XS}
#: (weights, header bytes, quant bytes) of one block, by format code.
GEOMETRY = {FMT_Q8_0: (32, 2, 32), FMT_Q4_K: (256, 16, 128), FMT_Q5_K: (256, 16, 160), FMT_Q6_K: (256, 18, 192),
            FMT_IQ4_XS: (256, 8, 128)}
#: Byte offsets of (header, quants) inside a GGUF block (q6_k stores its scales and d after the quants).
GGUF_OFFSETS = {FMT_Q8_0: (0, 2), FMT_Q4_K: (0, 16), FMT_Q5_K: (0, 16), FMT_Q6_K: (192, 0), FMT_IQ4_XS: (0, 8)}
#: The non-linear 4-bit values of iq4_xs (GGUF's kvalues_iq4nl).
IQ4_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)

_I8, _I16, _I32, _I64, _F32 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64), ir.FloatType()
_V16F = ir.VectorType(_F32, 16)
_V16I32 = ir.VectorType(_I32, 16)
_V8I32 = ir.VectorType(_I32, 8)


def _c(v, t=_I64):
    return ir.Constant(t, v)


def _vec(values, elem=_I32):
    return ir.Constant(ir.VectorType(elem, len(values)), list(values))


# ------------------------------------------------------------------------------------------ IR building blocks

def _bytes(b, p, off, n=16):
    """``<n x i8>`` at byte ``off`` (a Python int) of the i8* ``p``."""
    return b.load(b.bitcast(b.gep(p, [_c(off)]), ir.VectorType(_I8, n).as_pointer()), align=1)


def _u32(b, p, off):
    """The 16 bytes at ``p + off`` zero-extended to ``<16 x i32>``."""
    return b.zext(_bytes(b, p, off), _V16I32)


def _lanes(b, v, idx):
    """``v[idx]`` for constant lane indices (a shuffle)."""
    return b.shuffle_vector(v, ir.Constant(v.type, ir.Undefined), _vec(idx))


def _splat(b, v, lane):
    """Lane ``lane`` of the float vector ``v`` broadcast to 16 lanes."""
    return _lanes(b, v, [lane] * 16)


def _half(b, p, off):
    """The IEEE half at byte ``off`` of ``p`` as float32: moved into a vector register whole (vmovd) and converted
    there. A scalar ``fpext half`` becomes vpinsrw + vcvtph2ps on x86, and vpinsrw merges into whatever register
    the allocator picks, in these loops a vector accumulator: a false dependency on the previous FMA."""
    bits = b.load(b.bitcast(b.gep(p, [_c(off)]), _I16.as_pointer()), align=1)
    pair = b.bitcast(b.zext(bits, _I32), ir.VectorType(ir.HalfType(), 2))
    return b.extract_element(b.fpext(pair, ir.VectorType(_F32, 2)), _c(0, _I32))


def _scaled(b, ints, scale, lanes):
    """``float(ints) * scale`` lane-wise (``ints`` ``<lanes x i32>``, ``scale`` a float scalar)."""
    vt = ir.VectorType(_F32, lanes)
    sv = b.insert_element(ir.Constant(vt, ir.Undefined), scale, _c(0, _I32))
    return b.fmul(b.sitofp(ints, vt), _lanes(b, sv, [0] * lanes))


def _sel(mask_lo, mask_hi):
    """An 8-lane constant: ``mask_lo`` in lanes 0-3, ``mask_hi`` in lanes 4-7."""
    return _vec([mask_lo] * 4 + [mask_hi] * 4)


# --------------------------------------------------------------------------------------- per-format decoders
# decode(b, sp, wp, wide) yields (c, weights): for c = 0 .. wpb/16 - 1 the <16 x float> weights c*16 .. c*16+15 of the
# block whose header starts at the i8* sp and quants at wp. ``wide``: the target has AVX-512, where a 16-entry float
# table lookup is one vpermps; without it LLVM lowers that lookup lane by lane (measured with AVX2: q4_k and iq4_xs
# at 2.4 Gweights/s, a seventh of their AVX-512 speed), so q4_k converts its codes instead and iq4_xs looks its
# values up as bytes (vpshufb) and converts them.
def k_scales(b, sp):
    """q4_k/q5_k header (d, dmin, scales[12]) -> (``d * sc_j``, ``-dmin * m_j``) as ``<8 x float>``: the 6-bit scale
    and min of sub-block j are ``scales[j] & 63``, ``scales[j + 4] & 63`` for j < 4; for j >= 4 their low 4 bits are
    the nibbles of ``scales[j + 4]`` and their top 2 bits the top bits of ``scales[j - 4]`` / ``scales[j]``."""
    hdr = _bytes(b, sp, 0)  # scales[i] is hdr[4 + i]

    def gather(idx):
        return b.zext(_lanes(b, hdr, idx), _V8I32)

    top2 = _sel(0, 48)  # the 2 high bits, only for j >= 4
    sc = b.or_(b.and_(gather([4, 5, 6, 7, 12, 13, 14, 15]), _sel(63, 15)),
               b.and_(b.shl(b.lshr(gather([4, 5, 6, 7, 4, 5, 6, 7]), _sel(6, 6)), _sel(4, 4)), top2))
    mn = b.or_(b.and_(b.lshr(gather([8, 9, 10, 11, 12, 13, 14, 15]), _sel(0, 4)), _sel(63, 15)),
               b.and_(b.shl(b.lshr(gather([8, 9, 10, 11, 8, 9, 10, 11]), _sel(6, 6)), _sel(4, 4)), top2))
    return _scaled(b, sc, _half(b, sp, 0), 8), b.fneg(_scaled(b, mn, _half(b, sp, 2), 8))


def _high_bit(b, qh, j):
    """Bit ``j`` of each int32 lane of ``qh`` moved to bit 4 (value 16)."""
    moved = b.shl(qh, _vec([4 - j] * 16)) if j <= 4 else b.lshr(qh, _vec([j - 4] * 16))
    return b.and_(moved, _vec([16] * 16))


def _decode_k4(b, sp, wp, wide, fifth_bit):
    """q4_k (and q5_k with ``fifth_bit``): group g of 32 quant bytes holds sub-block 2g in the low nibbles and 2g + 1
    in the high ones; q5_k's 32 ``qh`` bytes come first, bit j of ``qh[i]`` is the fifth bit of weight 32j + i.
    With AVX-512 q4_k makes the 16 values ``d sc_j q - dmin m_j`` of sub-block j once (one FMA) and looks its nibbles
    up (one vpermps per 16 weights instead of a conversion and an FMA: ~6% faster); otherwise, and for q5_k's 32
    codes (a two-table permute X86 lowers lane by lane), the code is converted and scale and min applied with one
    FMA."""
    dsc, ndm = k_scales(b, sp)
    qs = 32 if fifth_bit else 0
    qh = [_u32(b, wp, 0), _u32(b, wp, 16)] if fifth_bit else None
    tabled = wide and not fifth_bit
    fma = _fmuladd(b)
    codes = _vec([float(i) for i in range(16)], _F32)
    for g in range(4):
        subs = [(j, _splat(b, dsc, j), _splat(b, ndm, j)) for j in (2 * g, 2 * g + 1)]
        tables = [b.call(fma, [codes, sc, mn]) for _, sc, mn in subs] if tabled else None
        for half in range(2):
            q = _u32(b, wp, qs + 32 * g + 16 * half)
            for i, nib in enumerate((b.and_(q, _vec([15] * 16)), b.lshr(q, _vec([4] * 16)))):
                j, sc, mn = subs[i]
                if tabled:
                    yield 2 * j + half, _lookup(b, tables[i], nib)
                    continue
                if fifth_bit:
                    nib = b.or_(nib, _high_bit(b, qh[half], j))
                yield 2 * j + half, b.call(fma, [b.sitofp(nib, _V16F), sc, mn])


def q6_scales(b, sp):
    """q6_k header (int8 scales[16], d) -> ``d * scale_c`` as ``<16 x float>`` (one per 16 weights)."""
    return b.fmul(b.sitofp(_bytes(b, sp, 0), _V16F), _splat(b, b.insert_element(
        ir.Constant(_V16F, ir.Undefined), _half(b, sp, 16), _c(0, _I32)), 0))


def _decode_q6_k(b, sp, wp, wide):
    """q6_k: quants ql[128], qh[64]; header int8 scales[16], d. Half h (128 weights) uses ql[64h:], qh[32h:]; its
    quarter i (32 weights) takes the low (i = 0, 1) or high (i = 2, 3) nibbles of ql[64h + 32 (i % 2) + l] and bits
    2i, 2i + 1 of qh[32h + l]; one int8 scale per 16 weights, value ``d * scale * (q - 32)``."""
    scales = q6_scales(b, sp)
    for h in range(2):
        for l0 in (0, 16):
            ql = [_u32(b, wp, 64 * h + l0), _u32(b, wp, 64 * h + 32 + l0)]
            qh = _u32(b, wp, 128 + 32 * h + l0)
            for i in range(4):
                nib = b.and_(ql[i % 2], _vec([15] * 16)) if i < 2 else b.lshr(ql[i % 2], _vec([4] * 16))
                shift = 4 - 2 * i  # bits 2i, 2i + 1 of qh to bits 4, 5
                high = b.shl(qh, _vec([shift] * 16)) if shift >= 0 else b.lshr(qh, _vec([-shift] * 16))
                q = b.sub(b.or_(nib, b.and_(high, _vec([48] * 16))), _vec([32] * 16))
                c = 8 * h + 2 * i + l0 // 16
                yield c, b.fmul(b.sitofp(q, _V16F), _splat(b, scales, c))


def iq4_scales(b, sp):
    """iq4_xs header (d, scales_h, scales_l[4]) -> ``d * (ls_j - 32)`` as ``<8 x float>`` (one per 32 weights)."""
    sh = b.zext(b.load(b.bitcast(b.gep(sp, [_c(2)]), _I16.as_pointer()), align=1), _I32)
    sh = _lanes(b, b.insert_element(ir.Constant(_V8I32, ir.Undefined), sh, _c(0, _I32)), [0] * 8)
    high = b.shl(b.and_(b.lshr(sh, _vec([2 * j for j in range(8)])), _vec([3] * 8)), _vec([4] * 8))
    low = b.and_(b.lshr(b.zext(_lanes(b, _bytes(b, sp, 4, 4), [0, 0, 1, 1, 2, 2, 3, 3]), _V8I32),
                        _vec([0, 4] * 4)), _vec([15] * 8))
    return _scaled(b, b.sub(b.or_(low, high), _vec([32] * 8)), _half(b, sp, 0), 8)


def _decode_iq4_xs(b, sp, wp, wide):
    """iq4_xs: header d, scales_h u16, scales_l[4]; sub-block j (32 weights) has the 6-bit scale
    ``ls_j = (scales_l[j // 2] >> 4 (j % 2)) & 15 | ((scales_h >> 2j) & 3) << 4`` and the low then the high nibbles
    of qs[16j:16j + 16], each looked up in ``IQ4_VALUES``; value ``d * (ls_j - 32) * IQ4_VALUES[q]``. AVX-512: the
    table times ``d (ls_j - 32)`` in one register, one vpermps per 16 weights; otherwise the 64 nibbles of two
    sub-blocks looked up as int8 values (two vpshufb), widened, converted and scaled."""
    dl = iq4_scales(b, sp)
    if wide:
        table = _vec([float(v) for v in IQ4_VALUES], _F32)
        for j in range(8):
            q = _u32(b, wp, 16 * j)
            ts = b.fmul(table, _splat(b, dl, j))
            yield 2 * j, _lookup(b, ts, b.and_(q, _vec([15] * 16)))
            yield 2 * j + 1, _lookup(b, ts, b.lshr(q, _vec([4] * 16)))
        return
    for j in range(0, 8, 2):  # two sub-blocks per 64-byte lookup: [lo j | hi j | lo j+1 | hi j+1]
        q = _bytes(b, wp, 16 * j, 32)
        lo, hi = b.and_(q, _vec([15] * 32, _I8)), b.lshr(q, _vec([4] * 32, _I8))
        nib = b.shuffle_vector(lo, hi, _vec([*range(16), *range(32, 48), *range(16, 32), *range(48, 64)]))
        vals = lookup_bytes(b, simd_level(), _vec(IQ4_VALUES, _I8), nib)
        for c in range(4):
            sc = _splat(b, dl, j + c // 2)
            yield 2 * j + c, b.fmul(b.sitofp(_lanes(b, vals, range(16 * c, 16 * c + 16)), _V16F), sc)


def _decode_q8_0(b, sp, wp, wide):
    """q8_0: header d, quants int8[32]; value ``d * q``."""
    d = _half(b, sp, 0)
    for c in range(2):
        yield c, _scaled(b, b.sext(_bytes(b, wp, 16 * c), _V16I32), d, 16)


_DECODERS = {FMT_Q8_0: _decode_q8_0, FMT_Q4_K: lambda b, sp, wp, wide: _decode_k4(b, sp, wp, wide, False),
             FMT_Q5_K: lambda b, sp, wp, wide: _decode_k4(b, sp, wp, wide, True), FMT_Q6_K: _decode_q6_k,
             FMT_IQ4_XS: _decode_iq4_xs}


def _fmuladd(b):
    return cgutils.get_or_insert_function(b.module, ir.FunctionType(_V16F, [_V16F] * 3), "llvm.fmuladd.v16f32")


# -------------------------------------------------------------------------------------------- row loops

class Rows:
    """Block addressing of ``nrow`` consecutive rows from row ``row`` of a matrix of ``k`` columns: record banks
    (quants from ``w``, headers from ``s``) or GGUF rows (both from ``w``)."""

    def __init__(self, b, code, gguf, w, s, row, k, nrow):
        wpb, hb, qb = GEOMETRY[code]
        self.b, self.code = b, code
        self.nblk = b.udiv(k, _c(wpb))
        if gguf:
            self.stride = self.hstride = hb + qb
            self.hoff, self.qoff = GGUF_OFFSETS[code]
            s = w
        else:
            self.stride, self.hstride, self.hoff, self.qoff = qb, hb, 0, 0
        wp, sp = typed_ptr(b, w, _I8), typed_ptr(b, s, _I8)
        self.wps = [b.gep(wp, [b.mul(b.add(row, _c(r)), b.mul(self.nblk, _c(self.stride)))]) for r in range(nrow)]
        self.sps = [b.gep(sp, [b.mul(b.add(row, _c(r)), b.mul(self.nblk, _c(self.hstride)))]) for r in range(nrow)]

    def pointers(self, r, blk):
        """(header, quants) i8* of block ``blk`` (i64) of row ``r``."""
        b = self.b
        return (b.gep(self.sps[r], [b.add(b.mul(blk, _c(self.hstride)), _c(self.hoff))]),
                b.gep(self.wps[r], [b.add(b.mul(blk, _c(self.stride)), _c(self.qoff))]))

    def decode(self, r, blk):
        """(c, weights) of block ``blk`` (i64) of row ``r``."""
        sp, wp = self.pointers(r, blk)
        return _DECODERS[self.code](self.b, sp, wp, "avx512f" in target_features())

    def prefetch(self, r, blk, nblocks):
        """Software prefetch of ``nblocks`` blocks of row ``r`` from ``blk``, ``PREFETCH_BYTES`` ahead."""
        b = self.b
        ahead = b.gep(self.wps[r], [b.add(b.mul(blk, _c(self.stride)), _c(PREFETCH_BYTES))])
        for line in range(0, nblocks * self.stride, 64):
            b.call(declare_prefetch(b.module), [b.gep(ahead, [_c(line)]), _c(0, _I32), _c(PREFETCH_LOCALITY, _I32),
                                                _c(1, _I32)])


def _for_blocks(b, nblk, unroll, body):
    """``body(blk, slot, n)`` for every block: ``n = unroll`` blocks per iteration (``slot``: the position in the
    iteration), then the remaining ``nblk % unroll`` one by one (``n = 1``)."""
    with cgutils.for_range(b, b.udiv(nblk, _c(unroll))) as loop:
        for u in range(unroll):
            body(b.add(b.mul(loop.index, _c(unroll)), _c(u)), u, unroll)
    if unroll > 1:
        with cgutils.for_range(b, b.urem(nblk, _c(unroll))) as loop:
            body(b.add(b.mul(b.udiv(nblk, _c(unroll)), _c(unroll)), loop.index), 0, 1)


def switch(b, code, results, emit, codes=tuple(GEOMETRY)):
    """``emit(c)`` (a list of ``results`` float values) for the runtime format ``code``: one block per format of
    ``codes``, NaN for another code. A literal code folds to its block."""
    end = b.append_basic_block("kq.end")
    default = b.append_basic_block("kq.default")
    sw = b.switch(code, default)
    incoming = []
    for c in codes:
        block = b.append_basic_block(f"kq.fmt{c}")
        sw.add_case(ir.Constant(code.type, c), block)
        b.position_at_end(block)
        incoming.append((emit(c), b.block))
        b.branch(end)
    b.position_at_end(default)
    incoming.append(([ir.Constant(_F32, float("nan"))] * results, b.block))
    b.branch(end)
    b.position_at_end(end)
    out = []
    for i in range(results):
        phi = b.phi(_F32)
        for vals, block in incoming:
            phi.add_incoming(vals[i], block)
        out.append(phi)
    return out


def _dot_codegen(ntok, nrow):
    """Arguments: code, gguf (a literal), w, s, row, k, x, ``ntok`` element offsets. Returns ``nrow * ntok``
    float32 dot products, row-major."""
    def codegen(context, builder, signature, args):
        b = builder
        code = context.cast(b, args[0], signature.args[0], types.int64)
        gguf = signature.args[1].literal_value
        w, s, row, k, x, *offs = (context.cast(b, a, t, types.uint64)
                                  for a, t in zip(args[2:], signature.args[2:], strict=True))
        xps = [b.gep(typed_ptr(b, x, _F32), [o]) for o in offs]

        def emit(fmt):
            wpb = GEOMETRY[fmt][0]
            rows = Rows(b, fmt, gguf, w, s, row, k, nrow)
            fma = _fmuladd(b)
            nacc = 4 if ntok * nrow <= 2 else 2  # independent FMA chains per (row, token)
            zero = ir.Constant(_V16F, [0.0] * 16)
            accs = [[[cgutils.alloca_once_value(b, zero) for _ in range(nacc)] for _ in range(ntok)]
                    for _ in range(nrow)]

            def block(blk, slot, nblocks):
                base = b.mul(blk, _c(wpb))
                for r in range(nrow):
                    if slot == 0:
                        rows.prefetch(r, blk, nblocks)
                    for c, v in rows.decode(r, blk):
                        for t in range(ntok):
                            xv = b.load(b.bitcast(b.gep(xps[t], [b.add(base, _c(16 * c))]), _V16F.as_pointer()),
                                        align=4)
                            acc = accs[r][t][(slot * wpb // 16 + c) % nacc]
                            b.store(b.call(fma, [v, xv, b.load(acc)]), acc)

            _for_blocks(b, rows.nblk, 2 if wpb == 32 else 1, block)  # q8_0: two 32-weight blocks per iteration
            sums = []
            for r in range(nrow):
                for t in range(ntok):
                    a = [b.load(p) for p in accs[r][t]]
                    while len(a) > 1:
                        a = [b.fadd(a[i], a[i + 1]) for i in range(0, len(a), 2)]
                    sums.append(lane_tree(b, a[0]))
            return sums

        sums = switch(b, code, ntok * nrow, emit)
        return sums[0] if len(sums) == 1 else context.make_tuple(b, signature.return_type, sums)
    return codegen


def _typed(code, gguf, addresses):
    """Whether the arguments type-check: an integer code, a literal bool gguf, integer addresses and sizes."""
    return (isinstance(code, types.Integer) and isinstance(gguf, types.BooleanLiteral)
            and all(isinstance(t, types.Integer) for t in addresses))


def _dot_signature(ntok, nrow, args):
    if not _typed(args[0], args[1], args[2:]):
        return None
    n = ntok * nrow
    ret = types.float32 if n == 1 else types.UniTuple(types.float32, n)
    return ret(*args), _dot_codegen(ntok, nrow)


@intrinsic
def kq_dot1(typingctx, code, gguf, w, s, row, k, x, o0):
    return _dot_signature(1, 1, (code, gguf, w, s, row, k, x, o0))


@intrinsic
def kq_dot2(typingctx, code, gguf, w, s, row, k, x, o0, o1):
    return _dot_signature(2, 1, (code, gguf, w, s, row, k, x, o0, o1))


@intrinsic
def kq_dot4(typingctx, code, gguf, w, s, row, k, x, o0, o1, o2, o3):
    return _dot_signature(4, 1, (code, gguf, w, s, row, k, x, o0, o1, o2, o3))


@intrinsic
def kq_dot1x2(typingctx, code, gguf, w, s, row, k, x, o0):
    return _dot_signature(1, 2, (code, gguf, w, s, row, k, x, o0))


@intrinsic
def kq_decode(typingctx, code, gguf, w, s, row, k, out):
    """Row ``row`` as float32 at address ``out`` (natural order; nothing is written for an unknown code)."""
    if not _typed(code, gguf, (w, s, row, k, out)):
        return None

    def codegen(context, builder, signature, args):
        b = builder
        code_ = context.cast(b, args[0], signature.args[0], types.int64)
        w_, s_, row_, k_, out_ = (context.cast(b, a, t, types.uint64)
                                  for a, t in zip(args[2:], signature.args[2:], strict=True))
        op = typed_ptr(b, out_, _F32)

        def emit(fmt):
            wpb = GEOMETRY[fmt][0]
            rows = Rows(b, fmt, gguf.literal_value, w_, s_, row_, k_, 1)

            def block(blk, slot, nblocks):
                base = b.mul(blk, _c(wpb))
                for c, v in rows.decode(0, blk):
                    b.store(v, b.bitcast(b.gep(op, [b.add(base, _c(16 * c))]), _V16F.as_pointer()), align=4)

            _for_blocks(b, rows.nblk, 1, block)
            return []

        switch(b, code_, 0, emit)
        return context.get_dummy_value()
    return types.void(code, gguf, w, s, row, k, out), codegen
