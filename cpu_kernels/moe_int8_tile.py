"""The prompt's int8 micro-kernel for the 4-bit formats: 16 weight rows x a tile of tokens per call.

The row dots of :mod:`freetoken.cpu_kernels.moe_int8` give each (row, token) pair its own accumulator, whose int32
lanes hold pieces of ONE dot product: every two blocks (64 multiply-adds) cost a ``vpdpbusd`` plus a float convert,
a scale multiply and an fma, and the weights are decoded again for every group of 4 tokens. That is right for a
token or two (decode reads each weight once; the float work hides under the memory stream), but a prompt's expert
sees tens of tokens and is compute bound: ~5% of the int8 peak.

Here the lanes are ROWS. An expert's 16-row panel is decoded once (:func:`repack16`) into unsigned weight bytes laid
out ``[block][chunk of 4 K values][row][4 bytes]`` (512 bytes per block) with the rows' float block scales beside it
(the format's factor and global folded in). Then, per block and token, 8 ``vpdpbusd`` (4 K bytes of 16 rows times
the token's 4 activation bytes broadcast to every lane) accumulate the block's 16 exact int32 dots, and ONE float
convert + fma per 16 outputs applies the scales: 8 integer instructions per 2 float ones, instead of 1 per 3. Each
64-byte weight chunk, loaded once from L1, serves the tile's tokens (8 with AVX-512, 4 with AVX2).

The offset (weight byte = value + OFFSET) is removed in the integer domain as in the row dots: the block's int32
accumulator starts at ``cs`` = -OFFSET x (sum of the token's activation bytes of the block or sub-block),
precomputed with the activations (:mod:`freetoken.cpu_kernels.q8_act`). nvfp4 applies its scales per 16-value
sub-block: in block-split order chunks 0, 1, 4, 5 (values 0-15) and 2, 3, 6, 7.
The integer part is exact at every SIMD level; only the float accumulation order differs from the row dots.

The k-quants' panels (made by :func:`freetoken.cpu_kernels.moe_int8_kquant.kq_q8_repack16`, natural K order) take two
more kinds of tile: ``k6`` (q6_k: offset 32, a scale per 16 values, chunks 0-3 and 4-7) and ``k4`` (q4_k, q5_k:
unsigned codes, no offset, and per row and block a min ``-dmin m`` stored after the scales, which adds
``min x dx x (sum of the block's activation bytes)`` with one more fma per block and token).
"""

from __future__ import annotations

from freetoken.cpu_kernels.moe_int8 import (
    FACTOR,
    _c32,
    _fn,
    _i64,
    _mask,
    _vec,
    dot_u8_s8,
    weight_bytes,
    weight_scales,
)
from freetoken.cpu_kernels.moe_memory import typed_ptr
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from freetoken.device.simd import simd_level

#: Rows per panel (one 512-bit vector of int32 lanes).
PANEL_ROWS = 16
#: Bytes of a panel per 32-value block.
PANEL_BLOCK_BYTES = 32 * PANEL_ROWS
#: Tokens per micro-kernel call: 8 int32 + 8 float accumulators fit AVX-512's 32 registers; AVX2 has 16 (each
#: 16-lane vector takes two), so 4.
TILE_TOKENS = 8 if simd_level() == "avx512_vnni" else 4

_I8, _I16, _I32, _I64, _F32 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64), ir.FloatType()


def _uint64_args(context, builder, signature, args):
    return [context.cast(builder, a, t, types.float32 if t == types.float32 else types.uint64)
            for a, t in zip(args, signature.args, strict=True)]


def transpose16(builder, rows):
    """A 16 x 16 matrix of int32 given as 16 row vectors -> its 16 column vectors: four stages that swap the
    off-diagonal sub-blocks of size 8, 4, 2, 1 (64 two-input shuffles instead of 256 element moves)."""
    rows = list(rows)
    for b in (8, 4, 2, 1):
        lo = [lane if not lane & b else 16 + lane - b for lane in range(16)]
        hi = [lane + b if not lane & b else 16 + lane for lane in range(16)]
        for i in range(16):
            if not i & b:
                a, c = rows[i], rows[i + b]
                rows[i], rows[i + b] = (builder.shuffle_vector(a, c, _mask(lo)),
                                        builder.shuffle_vector(a, c, _mask(hi)))
    return rows


def _repack_codegen(kind, level):
    """Arguments: w, s (value bytes and scales of the panel's first row; rows follow contiguously), stab (the
    byte -> float scale table), g (float32 global, nv), nblk, panel, pscale (outputs)."""
    def codegen(context, builder, signature, args):
        w, s, stab, g, nblk, panel, pscale = _uint64_args(context, builder, signature, args)
        scale_bytes = 1 if kind == "mx" else 2  # per block: q4 one half, mx one e8m0, nv two e4m3
        nsub = 2 if kind == "nv" else 1
        factor = ir.Constant(_F32, FACTOR[kind])
        if kind == "nv":
            factor = builder.fmul(factor, g)
        v16i32, v16f = _vec(_I32, 16), _vec(_F32, 16)
        pp = typed_ptr(builder, panel, v16i32)
        ps = typed_ptr(builder, pscale, v16f)
        stp = typed_ptr(builder, stab, _F32)
        wps = [typed_ptr(builder, builder.add(w, builder.mul(nblk, _i64(16 * r))), _I8) for r in range(PANEL_ROWS)]
        sps = [typed_ptr(builder, builder.add(s, builder.mul(nblk, _i64(scale_bytes * r))),
                         _I16 if kind == "q4" else _I8) for r in range(PANEL_ROWS)]

        def pair(b, tail):
            """Blocks b, b + 1 of the 16 rows: [row][dword] -> [dword][row] (dword c < 8: block b's chunk c)."""
            cols = transpose16(builder, [builder.bitcast(weight_bytes(builder, kind, level, wps[r], b, tail),
                                                          v16i32) for r in range(PANEL_ROWS)])
            for c in range(8 if tail else 16):
                builder.store(cols[c], builder.gep(pp, [builder.add(builder.mul(b, _i64(8)), _i64(c))]), align=4)
            nscale = (2 if tail else 4) if kind == "nv" else (1 if tail else 2)
            vecs = [ir.Constant(v16f, ir.Undefined)] * nscale
            for r in range(PANEL_ROWS):
                sw = weight_scales(builder, kind, sps[r], stp, b, tail)
                for i in range(nscale):
                    vecs[i] = builder.insert_element(vecs[i], builder.extract_element(sw, _c32(i)), _c32(r))
            splat = builder.shuffle_vector(builder.insert_element(ir.Constant(_vec(_F32, 1), ir.Undefined), factor,
                                                                  _c32(0)),
                                           ir.Constant(_vec(_F32, 1), ir.Undefined), ir.Constant(v16i32, [0] * 16))
            for i in range(nscale):
                at = builder.add(builder.mul(b, _i64(nsub)), _i64(i))
                builder.store(builder.fmul(vecs[i], splat), builder.gep(ps, [at]), align=4)

        with cgutils.for_range(builder, builder.lshr(nblk, _i64(1))) as pairs:
            pair(builder.mul(pairs.index, _i64(2)), False)
        with builder.if_then(builder.icmp_unsigned("!=", builder.and_(nblk, _i64(1)), _i64(0))):
            pair(builder.sub(nblk, _i64(1)), True)
        return context.get_dummy_value()
    return codegen


#: Scale vectors of 16 rows per 32-value block in a panel's ``pscale`` (two for the sub-block formats); the k4
#: panels' mins follow the scales at vector ``MIN_AT * nblk``: ``pscale`` holds ``(MIN_AT + 1) * nblk`` vectors.
MIN_AT = 2


def _sub_chunks(kind, nsub, sub):
    """The 4-byte chunks of a block that sub-block ``sub`` covers."""
    if nsub == 1:
        return range(8)
    return (2 * sub, 2 * sub + 1, 2 * sub + 4, 2 * sub + 5) if kind == "nv" else range(4 * sub, 4 * sub + 4)


def _tile_codegen(kind, level, ntok):
    """Arguments: panel, pscale (:func:`repack16`'s output), qa, cs, dx (the 8-bit token rows), kp (bytes per
    token row of qa), toks (address of ``ntok`` int64 token row indices), nblk, out (float32 [ntok, 16])."""
    def codegen(context, builder, signature, args):
        panel, pscale, qa, cs, dx, kp, toks, nblk, out = _uint64_args(context, builder, signature, args)
        v16f, v16i32, v64i8 = _vec(_F32, 16), _vec(_I32, 16), _vec(_I8, 64)
        nsub = 2 if kind in ("nv", "k6") else 1
        fmuladd = _fn(builder, "llvm.fmuladd.v16f32", v16f, [v16f] * 3)
        pp = typed_ptr(builder, panel, v64i8)
        ps = typed_ptr(builder, pscale, v16f)
        tp = typed_ptr(builder, toks, _I64)
        qas, css, dxs = [], [], []
        for t in range(ntok):
            row = builder.load(builder.gep(tp, [_i64(t)]))
            base = builder.mul(row, kp)  # qa: kp bytes per row; cs: kp / 16 int32; dx: kp / 32 float32
            qas.append(typed_ptr(builder, builder.add(qa, base), _I32))
            css.append(typed_ptr(builder, builder.add(cs, builder.lshr(base, _i64(2))), _I32))
            dxs.append(typed_ptr(builder, builder.add(dx, builder.lshr(base, _i64(3))), _F32))
        facc = [cgutils.alloca_once_value(builder, ir.Constant(v16f, [0.0] * 16)) for _ in range(ntok)]

        def block_sum(t, b):
            """Token t's two half-block ``cs`` of block b added: the block's correction (or, offset -1, its sum)."""
            c0 = builder.load(builder.gep(css[t], [builder.mul(b, _i64(2))]))
            c1 = builder.load(builder.gep(css[t], [builder.add(builder.mul(b, _i64(2)), _i64(1))]))
            return builder.add(c0, c1)

        def splat(v, vt):
            return builder.shuffle_vector(builder.insert_element(ir.Constant(_vec(vt, 1), ir.Undefined), v,
                                                                 _c32(0)),
                                          ir.Constant(_vec(vt, 1), ir.Undefined), ir.Constant(v16i32, [0] * 16))

        with cgutils.for_range(builder, nblk) as blocks:
            b = blocks.index
            for sub in range(nsub):
                chunks = _sub_chunks(kind, nsub, sub)
                iacc = []
                for t in range(ntok):
                    if kind == "k4":  # no offset: the min term below uses the block sums
                        corr = _c32(0)
                    elif nsub == 1:
                        corr = block_sum(t, b)
                    else:
                        corr = builder.load(builder.gep(css[t], [builder.add(builder.mul(b, _i64(2)), _i64(sub))]))
                    iacc.append(splat(corr, _I32))
                for c in chunks:
                    wv = builder.load(builder.gep(pp, [builder.add(builder.mul(b, _i64(8)), _i64(c))]), align=1)
                    for t in range(ntok):
                        a4 = builder.load(builder.gep(qas[t], [builder.add(builder.mul(b, _i64(8)), _i64(c))]),
                                          align=4)
                        a = builder.bitcast(splat(a4, _I32), v64i8)
                        iacc[t] = dot_u8_s8(builder, level, iacc[t], wv, a)
                sw = builder.load(builder.gep(ps, [builder.add(builder.mul(b, _i64(nsub)), _i64(sub))]), align=4)
                mins = None
                if kind == "k4":
                    mins = builder.load(builder.gep(ps, [builder.add(builder.mul(nblk, _i64(MIN_AT)), b)]), align=4)
                for t in range(ntok):
                    d = builder.load(builder.gep(dxs[t], [b]))
                    sc = builder.fmul(sw, splat(d, _F32))
                    acc = facc[t]
                    total = builder.call(fmuladd, [builder.sitofp(iacc[t], v16f), sc, builder.load(acc)])
                    if mins is not None:  # + min x dx x block sum (offset -1: cs holds plain sums)
                        mt = builder.fmul(d, builder.sitofp(block_sum(t, b), _F32))
                        total = builder.call(fmuladd, [mins, splat(mt, _F32), total])
                    builder.store(total, acc)
        op = typed_ptr(builder, out, v16f)
        for t in range(ntok):
            builder.store(builder.load(facc[t]), builder.gep(op, [_i64(t)]), align=4)
        return context.get_dummy_value()
    return codegen


def _all_ints(args, float_at=()):
    return all((t == types.float32) if i in float_at else isinstance(t, types.Integer) for i, t in enumerate(args))


def _intrinsics(kind):
    def repack16(typingctx, w, s, stab, g, nblk, panel, pscale):
        args = (w, s, stab, g, nblk, panel, pscale)
        if not _all_ints(args, float_at=(3,)):
            return None
        return types.void(*args), _repack_codegen(kind, simd_level())

    def tile(typingctx, panel, pscale, qa, cs, dx, kp, toks, nblk, out):
        args = (panel, pscale, qa, cs, dx, kp, toks, nblk, out)
        if not _all_ints(args):
            return None
        return types.void(*args), _tile_codegen(kind, simd_level(), TILE_TOKENS)

    repack16.__name__ = repack16.__qualname__ = f"{kind}_q8_repack16"
    tile.__name__ = tile.__qualname__ = f"{kind}_q8_tile"
    return intrinsic(repack16), intrinsic(tile)


#: ``<kind>_q8_repack16(w, s, stab, g, nblk, panel, pscale)``: 16 consecutive weight rows (value bytes from address
#: ``w``, scales from ``s``) into a panel (``nblk * PANEL_BLOCK_BYTES`` bytes) and its float32
#: scales (``[nblk * (2 if nv else 1), 16]``). ``<kind>_q8_tile(panel, pscale, qa, cs, dx, kp, toks, nblk, out)``:
#: the panel's 16 rows dotted with ``TILE_TOKENS`` 8-bit token rows (indices at address ``toks``) into float32
#: ``out [TILE_TOKENS, 16]``.
q4_q8_repack16, q4_q8_tile = _intrinsics("q4")
mx_q8_repack16, mx_q8_tile = _intrinsics("mx")
nv_q8_repack16, nv_q8_tile = _intrinsics("nv")
#: The k-quants' tiles (their panels: ``moe_int8_kquant.kq_q8_repack16``): k4 for q4_k / q5_k, k6 for q6_k.
_, k4_q8_tile = _intrinsics("k4")
_, k6_q8_tile = _intrinsics("k6")
