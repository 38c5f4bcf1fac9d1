"""Decode-step attention over the paged KV cache on the CPU: the few-query case of
:func:`freetoken.cpu_kernels.paged_attention.paged_attention_rows` (same arguments, same contract:
``freetoken/testing/reference/paged_attention.py``), reading each stored K and V row where it lies.

A decode step has only G rows (the heads of a kv group) per kv head. The prompt kernel's layout (16 keys in the
vector lanes, each K block widened and transposed into a panel, V widened into panels) pays a transpose and two
copies per key for G multiply-adds each, and so ran at ~3-10 GB/s of KV. Here the head dimension is in the lanes:

* scores ``s = q . k`` (:func:`_scores`): the stored K row is loaded 16 values at a time, widened in registers
  (bf16: a shift; f16: ``vcvtph2ps``) and multiply-added into 16 lane sums of 4 query rows at once, which one fixed
  pairwise tree then adds up;
* ``o += p v`` (:func:`_weighted_values`): per query row, 4 chunks of 16 outputs held in registers while the
  block's V rows, widened the same way, are multiply-added in key order: no reduction at all.

Both read each K/V row once per kv head and touch no buffer but the rows' outputs. The softmax between them is the
prompt kernel's online softmax, 16 keys per vector (:func:`_fold_lanes`). Long contexts split the
keys of each kv head into runs of :data:`SPLIT_BLOCKS` blocks (more parallel tasks when a model has few kv heads);
the runs' partial maxima, sums and outputs are merged at the end. The split depends on the context only, never on
the thread count, and every sum has a fixed order: results are the same on any machine with the same vector
instructions. Kinds: float32, bf16, f16 pools with D a multiple of 16 (:func:`handles`); fp8 and other head dims run
the prompt kernel.
"""

from __future__ import annotations

import math

import numba as nb
import numpy as np
from freetoken.cpu_kernels.lanes import (
    F32,
    I32,
    I64,
    KINDS,
    V16F,
    broadcast,
    fmuladd,
    lane_sums4,
    lane_tree,
    load_widened,
    row_ptr,
)
from freetoken.cpu_kernels.moe_memory import addr, declare_prefetch, typed_ptr
from freetoken.cpu_kernels.paged_attention import (
    _FASTMATH,
    _LANES,
    EXP_MIN,
    EXP_TAYLOR,
    LN2_HI,
    LN2_LO,
    LOG2E,
    _exp,
)
from freetoken.cpu_kernels.serial_copy import serial_copy
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

#: Query rows (query x head of the group) per kv head up to which a step runs here.
DECODE_ROWS = 16
#: Pool blocks per run of keys (one parallel task per kv head and run).
SPLIT_BLOCKS = 8
#: Below this many query-key multiply-adds per step (keys x query heads x head dim) :func:`paged_decode_rows_serial`
#: runs: waking the other threads costs more than the work (bundled model, 4 heads of 48: 100 keys took 7.3 us on
#: one thread, 8.3 us in a parallel region on two; Qwen3-30B-A3B's proportions at half width, 16 heads of 64: 540
#: keys took 69 us on one thread, 45 us on two).
SERIAL_MACS = 1 << 16


def handles(kind: str, dim: int, rows: int) -> bool:
    """Whether :func:`paged_decode_rows` takes a step of ``rows`` rows per kv head over a ``kind`` pool of head dim
    ``dim``."""
    return kind in ("f32", "bf16", "f16") and dim % _LANES == 0 and 0 < rows <= DECODE_ROWS


def _ints(context, builder, signature, args, count):
    """The intrinsic's first ``count`` arguments (integers, addresses) as uint64 IR values."""
    return [context.cast(builder, a, t, types.uint64) for a, t in zip(args[:count], signature.args[:count],
                                                                      strict=True)]


#: Query rows whose scores :func:`_scores` computes together (independent sums; each key chunk loaded once).
SCORE_ROWS = 4
#: Output chunks of 16 values :func:`_weighted_values` accumulates together in registers.
_VALUE_CHUNKS = 4
#: Keys ahead of the one being read whose K (or V) row is prefetched. One kv head's rows lie ``Hkv x D`` values apart,
#: a strided walk the hardware prefetchers follow late. This prefetch, the 4-key score tiles and the vector fold
#: (:func:`_fold_lanes`) together (Qwen3-30B-A3B's proportions at half width, 16 heads / 4 kv heads of 64, bf16):
#: 2,000 keys on one thread 305 -> ~200 us; 4,000 keys on two threads 444 -> ~245 us, ~17 GB/s of K and V.
PREFETCH_KEYS = 8


def _prefetch_row(builder, prefetch, row_at, line):
    """IR: prefetch the cache line ``line`` bytes into the stored row at address ``row_at``."""
    at = typed_ptr(builder, builder.add(row_at, line), ir.IntType(8))
    builder.call(prefetch, [at, ir.Constant(I32, 0), ir.Constant(I32, 3), ir.Constant(I32, 1)])


#: Keys :func:`_scores` dots together (with ``SCORE_ROWS`` rows: 16 independent sums in registers).
SCORE_KEYS = 4


def _score_tile(builder, kind, fma, qp, n_, r0, keys):
    """IR: the ``SCORE_ROWS x len(keys)`` dot products of query rows ``r0 ..`` (``qp``) with the stored K rows at the
    addresses ``keys``: each sum 16 lanes over the chunks in order; per row, the keys' lane sums reduced by
    :func:`lane_sums4` (a 4-vector of their scores; a tile of fewer than 4 keys pads it)."""
    zero = ir.Constant(V16F, [0.0] * 16)
    accs = [[cgutils.alloca_once_value(builder, zero) for _ in keys] for _ in range(SCORE_ROWS)]
    kps = [row_ptr(builder, kind, k) for k in keys]
    with cgutils.for_range(builder, n_) as cl:
        c = cl.index
        ws = [load_widened(builder, kind, kp, c) for kp in kps]
        for i in range(SCORE_ROWS):
            qv = builder.load(builder.gep(qp, [builder.add(builder.mul(builder.add(r0, ir.Constant(I64, i)), n_), c)]),
                              align=4)
            for a, w in zip(accs[i], ws, strict=True):
                builder.store(builder.call(fma, [qv, w, builder.load(a)]), a)
    vals = [[builder.load(a) for a in row] for row in accs]
    return [lane_sums4(builder, row + [zero] * (4 - len(row))) for row in vals]


@intrinsic
def _scores(typingctx, qs, groups, keys, key_bytes, nkeys, n16, s, s_stride, sample):
    """``s[r * s_stride + j] = sum_i qs[r, i] * widen(K_j[i])`` for keys ``j < nkeys`` (stored rows ``key_bytes``
    apart from address ``keys``, of ``sample``'s type) and rows ``r < SCORE_ROWS * groups`` of ``qs`` (float32
    ``[rows, 16 n16]`` at its address), ``SCORE_ROWS`` rows by ``SCORE_KEYS`` keys at a time (16 independent
    FMA chains: one key's chain alone waited on its own latency): per row and key 16 lane sums in order, then
    :func:`lane_sums4`'s fixed tree. Each K row is prefetched ``PREFETCH_KEYS`` keys ahead."""
    ints = (qs, groups, keys, key_bytes, nkeys, n16, s, s_stride)
    if sample not in KINDS or not all(isinstance(a, types.Integer) for a in ints):
        return None

    def codegen(context, builder, signature, args):
        qs_, groups_, keys_, kb_, nk_, n_, s_, ss_ = _ints(context, builder, signature, args, 8)
        kind = KINDS[signature.args[8]]
        qp, sp = typed_ptr(builder, qs_, V16F), typed_ptr(builder, s_, F32)
        fma = fmuladd(builder)
        prefetch = declare_prefetch(builder.module)
        chunk_bytes = 64 if kind == "f32" else 32
        lines = builder.udiv(builder.add(builder.mul(n_, ir.Constant(I64, chunk_bytes)), ir.Constant(I64, 63)),
                             ir.Constant(I64, 64))
        step = ir.Constant(I64, SCORE_KEYS)
        tiles = builder.udiv(nk_, step)

        def tile(j, count):
            keys = [builder.add(keys_, builder.mul(builder.add(j, ir.Constant(I64, i)), kb_)) for i in range(count)]
            for i in range(count):  # every line of the row PREFETCH_KEYS keys on
                ahead = builder.add(keys_, builder.mul(builder.add(j, ir.Constant(I64, PREFETCH_KEYS + i)), kb_))
                with cgutils.for_range(builder, lines) as cl:
                    _prefetch_row(builder, prefetch, ahead, builder.mul(cl.index, ir.Constant(I64, 64)))
            with cgutils.for_range(builder, groups_) as gl:
                r0 = builder.mul(gl.index, ir.Constant(I64, SCORE_ROWS))
                sums = _score_tile(builder, kind, fma, qp, n_, r0, keys)
                for i in range(SCORE_ROWS):
                    at = builder.gep(sp, [builder.add(builder.mul(builder.add(r0, ir.Constant(I64, i)), ss_), j)])
                    if count == SCORE_KEYS:  # the row's 4 consecutive scores in one store
                        builder.store(sums[i], builder.bitcast(at, ir.VectorType(F32, 4).as_pointer()), align=4)
                    else:
                        builder.store(builder.extract_element(sums[i], ir.Constant(I32, 0)), at)

        with cgutils.for_range(builder, tiles) as tl:
            tile(builder.mul(tl.index, step), SCORE_KEYS)
        with cgutils.for_range(builder, builder.sub(nk_, builder.mul(tiles, step))) as kl:  # the last few keys
            tile(builder.add(builder.mul(tiles, step), kl.index), 1)
        return context.get_dummy_value()
    return types.void(qs, groups, keys, key_bytes, nkeys, n16, s, s_stride, sample), codegen


def _accumulate(builder, kind, fma, o, n16, p, p_stride, vals, vb, nk, r0, c0, width):
    """IR: ``o[r0 + i, c0 + c] += sum_j p[(r0 + i) p_stride + j] * widen(V_j[c0 + c])`` for ``SCORE_ROWS`` rows i
    and ``width`` chunks c (of 16 values), the ``SCORE_ROWS x width`` sums in registers, keys in order."""
    op, pp = typed_ptr(builder, o, V16F), typed_ptr(builder, p, F32)
    rows = [builder.add(r0, ir.Constant(I64, i)) for i in range(SCORE_ROWS)]
    chunks = [builder.add(c0, ir.Constant(I64, c)) for c in range(width)]
    outs = [[builder.gep(op, [builder.add(builder.mul(r, n16), c)]) for c in chunks] for r in rows]
    accs = [[cgutils.alloca_once_value(builder, builder.load(at, align=4)) for at in row] for row in outs]
    prow = [builder.gep(pp, [builder.mul(r, p_stride)]) for r in rows]
    prefetch = declare_prefetch(builder.module)
    chunk_bytes = 64 if kind == "f32" else 32
    with cgutils.for_range(builder, nk) as kl:
        j = kl.index
        vp = row_ptr(builder, kind, builder.add(vals, builder.mul(j, vb)))
        ahead = builder.add(vals, builder.mul(builder.add(j, ir.Constant(I64, PREFETCH_KEYS)), vb))
        for c in range(0, width, 64 // chunk_bytes):  # the lines of this tile's chunks, PREFETCH_KEYS keys on
            _prefetch_row(builder, prefetch, ahead, builder.mul(builder.add(c0, ir.Constant(I64, c)),
                                                                ir.Constant(I64, chunk_bytes)))
        ws = [load_widened(builder, kind, vp, c) for c in chunks]
        for i in range(SCORE_ROWS):
            pj = broadcast(builder, builder.load(builder.gep(prow[i], [j])))
            for a, w in zip(accs[i], ws, strict=True):
                builder.store(builder.call(fma, [pj, w, builder.load(a)]), a)
    for row_accs, row_outs in zip(accs, outs, strict=True):
        for a, at in zip(row_accs, row_outs, strict=True):
            builder.store(builder.load(a), at, align=4)


@intrinsic
def _weighted_values(typingctx, o, groups, p, p_stride, vals, val_bytes, nkeys, n16, sample):
    """``o[r, :] += sum_{j < nkeys} p[r * p_stride + j] * widen(V_j)`` for rows ``r < SCORE_ROWS * groups``
    (float32 ``o [rows, 16 n16]`` and ``p`` at their addresses; stored rows ``val_bytes`` apart from address
    ``vals``, of ``sample``'s type): each output value summed over the keys in order, tiles of ``SCORE_ROWS`` rows
    x ``_VALUE_CHUNKS`` chunks of 16 outputs in registers (each V chunk widened once per tile)."""
    ints = (o, groups, p, p_stride, vals, val_bytes, nkeys, n16)
    if sample not in KINDS or not all(isinstance(a, types.Integer) for a in ints):
        return None

    def codegen(context, builder, signature, args):
        o_, groups_, p_, ps_, v_, vb_, nk_, n_ = _ints(context, builder, signature, args, 8)
        kind = KINDS[signature.args[8]]
        fma = fmuladd(builder)
        width = ir.Constant(I64, _VALUE_CHUNKS)
        full = builder.udiv(n_, width)
        with cgutils.for_range(builder, groups_) as gl:
            r0 = builder.mul(gl.index, ir.Constant(I64, SCORE_ROWS))
            with cgutils.for_range(builder, full) as cl:
                _accumulate(builder, kind, fma, o_, n_, p_, ps_, v_, vb_, nk_, r0, builder.mul(cl.index, width),
                            _VALUE_CHUNKS)
            with cgutils.for_range(builder, builder.sub(n_, builder.mul(full, width))) as cl:
                _accumulate(builder, kind, fma, o_, n_, p_, ps_, v_, vb_, nk_, r0,
                            builder.add(builder.mul(full, width), cl.index), 1)
        return context.get_dummy_value()
    return types.void(o, groups, p, p_stride, vals, val_bytes, nkeys, n16, sample), codegen


_V16I = ir.VectorType(I32, 16)
_V16L = ir.VectorType(I64, 16)


def _c16f(v):
    return ir.Constant(V16F, [v] * 16)


def _splat_i64(builder, x):
    one = ir.Constant(ir.VectorType(I64, 1), ir.Undefined)
    return builder.shuffle_vector(builder.insert_element(one, x, ir.Constant(I32, 0)), one,
                                  ir.Constant(_V16I, [0] * 16))


def _exp16(builder, x):
    """IR: :func:`~freetoken.cpu_kernels.paged_attention._exp` on 16 lanes, with its constants (x <= 0: 2^n p(r);
    x < ``EXP_MIN`` gives 0)."""
    fma = fmuladd(builder)
    y = builder.select(builder.fcmp_ordered(">", x, _c16f(EXP_MIN)), x, _c16f(EXP_MIN))
    floor = cgutils.get_or_insert_function(builder.module, ir.FunctionType(V16F, [V16F]), "llvm.floor.v16f32")
    n = builder.call(floor, [builder.call(fma, [y, _c16f(LOG2E), _c16f(0.5)])])
    r = builder.fsub(builder.fsub(y, builder.fmul(n, _c16f(LN2_HI))), builder.fmul(n, _c16f(LN2_LO)))
    p = _c16f(EXP_TAYLOR[0])
    for c in EXP_TAYLOR[1:]:
        p = builder.call(fma, [p, r, _c16f(c)])
    bits = builder.shl(builder.add(builder.fptosi(n, _V16I), ir.Constant(_V16I, [127] * 16)),
                       ir.Constant(_V16I, [23] * 16))
    v = builder.fmul(p, builder.bitcast(bits, V16F))
    return builder.select(builder.fcmp_ordered(">=", x, _c16f(EXP_MIN)), v, _c16f(0.0))


def _maximum(builder, a, b):
    """IR: ``llvm.maximum`` (NaN if either is NaN, as the prompt kernel's running maximum gives)."""
    name = "llvm.maximum." + ("v16f32" if isinstance(a.type, ir.VectorType) else "f32")
    return builder.call(cgutils.get_or_insert_function(builder.module, ir.FunctionType(a.type, [a.type] * 2), name),
                        [a, b])


@intrinsic
def _fold_lanes(typingctx, s, rows_pad, r, g_lo, g_hi, jlo, jhi, m_old, p, p_stride):
    """Row r's online softmax over one block's keys ``jlo .. jhi - 1``, 16 keys per vector: key ``g * 16 + lane``
    scored ``s[(g * rows_pad + r) * 16 + lane]`` (float32 at address ``s``), groups ``g_lo .. g_hi - 1``. Returns
    (the running maximum over ``m_old`` and the block's keys, the block's sum of ``exp(score - maximum)``) and
    writes those exponentials to ``p[r * p_stride + g * 16 + lane]`` (0 for keys outside the range). The prompt kernel's
    :func:`~freetoken.cpu_kernels.paged_attention._fold_row`, with the maximum and the sum taken per lane and then
    over the lanes in a fixed tree: Numba's loops over a row's 16 lanes left half the step in their scalar code
    (2,000 keys, 16 heads / 4 kv heads of 64, one thread: the fold took 70 of 240 us, 35 here)."""
    ints = (s, rows_pad, r, g_lo, g_hi, jlo, jhi, p, p_stride)
    if not all(isinstance(a, types.Integer) for a in ints) or m_old != types.float32:
        return None

    def codegen(context, builder, signature, args):
        vals = [context.cast(builder, a, t, types.float32 if i == 7 else types.int64)
                for i, (a, t) in enumerate(zip(args, signature.args, strict=True))]
        s_, rp_, r_, glo_, ghi_, jlo_, jhi_, mold_, p_, ps_ = vals
        sp, pp = typed_ptr(builder, s_, F32), typed_ptr(builder, p_, F32)
        lanes = ir.Constant(_V16L, list(range(16)))
        lo, hi = _splat_i64(builder, jlo_), _splat_i64(builder, jhi_)
        step = ir.Constant(I64, 1)

        def scores(g):
            at = builder.mul(builder.add(builder.mul(g, rp_), r_), ir.Constant(I64, 16))
            return builder.load(builder.bitcast(builder.gep(sp, [at]), V16F.as_pointer()), align=4)

        def in_range(g):
            j = builder.add(_splat_i64(builder, builder.mul(g, ir.Constant(I64, 16))), lanes)
            return builder.and_(builder.icmp_signed(">=", j, lo), builder.icmp_signed("<", j, hi))

        vmax = cgutils.alloca_once_value(builder, _c16f(-math.inf))
        with cgutils.for_range_slice(builder, glo_, ghi_, step, inc=True) as (g, _):
            v = builder.select(in_range(g), scores(g), _c16f(-math.inf))
            builder.store(_maximum(builder, builder.load(vmax), v), vmax)
        mx = _maximum(builder, mold_, lane_tree(builder, builder.load(vmax), _maximum))
        mxv = broadcast(builder, mx)
        tot = cgutils.alloca_once_value(builder, _c16f(0.0))
        with cgutils.for_range_slice(builder, glo_, ghi_, step, inc=True) as (g, _):
            e = builder.select(in_range(g), _exp16(builder, builder.fsub(scores(g), mxv)), _c16f(0.0))
            at = builder.add(builder.mul(r_, ps_), builder.mul(g, ir.Constant(I64, 16)))
            builder.store(e, builder.bitcast(builder.gep(pp, [at]), V16F.as_pointer()), align=4)
            builder.store(builder.fadd(builder.load(tot), e), tot)
        total = lane_tree(builder, builder.load(tot))
        return context.make_tuple(builder, signature.return_type, [mx, total])
    return types.UniTuple(types.float32, 2)(s, rows_pad, r, g_lo, g_hi, jlo, jhi, m_old, p, p_stride), codegen


def splits_for(t_count: int, block_size: int, start: int, window: int) -> int:
    """Runs of keys per kv head for a step of ``t_count`` queries from position ``start``: one per
    :data:`SPLIT_BLOCKS` pool blocks the step reads (from the context alone, never the thread count)."""
    hi = start + t_count
    lo = 0 if window == 0 else max(0, start - window + 1)
    blocks = (hi - 1) // block_size - lo // block_size + 1
    return max(1, (blocks + SPLIT_BLOCKS - 1) // SPLIT_BLOCKS)


@nb.njit(error_model="numpy", cache=True, fastmath=_FASTMATH)
def _decode_run(q, k_pool, v_pool, block_table, start, window, scale, nsplit, kvh, sp, m_out, l_out, o):
    """Run ``sp`` of ``nsplit`` of kv head ``kvh`` for the queries ``q`` ``[T, H, D]`` at positions ``start ..``:
    each row's (query x head of the group) running maximum into ``m_out``, sum into ``l_out``, unnormalised output
    into ``o`` ``[rows padded to SCORE_ROWS, D]``."""
    t_count, heads, dim = q.shape
    bs, kv_heads = k_pool.shape[1], k_pool.shape[2]
    group = heads // kv_heads
    rows = t_count * group
    n16 = dim // _LANES
    ngroups = (bs + _LANES - 1) // _LANES
    row_bytes = np.uint64(dim * k_pool.itemsize)
    key_bytes = row_bytes * np.uint64(kv_heads)  # consecutive positions of one kv head
    hi = start + t_count  # keys [lo, hi) serve some row
    lo = 0 if window == 0 else max(0, start - window + 1)
    b_first = lo // bs
    nblocks = (hi - 1) // bs - b_first + 1
    rows_pad = (rows + SCORE_ROWS - 1) // SCORE_ROWS * SCORE_ROWS
    bsp = ngroups * _LANES
    qs = np.zeros((rows_pad, dim), np.float32)  # padding rows: scores computed and never read
    for r in range(rows):
        t = r // group
        h = kvh * group + r % group
        for d in range(dim):
            qs[r, d] = q[t, h, d] * scale
    m = np.full(rows, -np.inf, np.float32)
    lsum = np.zeros(rows, np.float32)
    o[:rows_pad] = np.float32(0.0)
    s = np.zeros((ngroups, rows_pad, _LANES), np.float32)
    p = np.zeros((rows_pad, bsp), np.float32)  # padding rows stay 0
    kbase, vbase = addr(k_pool), addr(v_pool)
    for blk in range(b_first + sp * nblocks // nsplit, b_first + (sp + 1) * nblocks // nsplit):
        base = blk * bs
        block = block_table[blk]
        j0 = max(lo - base, 0)
        j1 = min(hi - base, bs)  # keys past the last query's position are not read
        g_lo, g_hi = j0 // _LANES, (j1 + _LANES - 1) // _LANES
        row0 = np.uint64(block * bs * kv_heads + kvh) * row_bytes
        for g in range(g_lo, g_hi):
            k0 = max(g * _LANES, j0)
            _scores(addr(qs), rows_pad // SCORE_ROWS, kbase + row0 + np.uint64(k0 * kv_heads) * row_bytes,
                    key_bytes, min(j1, g * _LANES + _LANES) - k0, n16,
                    addr(s) + np.uint64(((g * rows_pad) * _LANES + k0 - g * _LANES) * 4), _LANES,
                    k_pool[0, 0, 0, 0])
        for r in range(rows):
            pos = start + r // group
            jhi = min(j1, pos - base + 1)  # keys up to the query's own position
            jlo = j0 if window == 0 else max(0, pos - window + 1 - base)
            if jhi <= jlo:  # no key of this block for the row (a window): it adds nothing
                for j in range(g_lo * _LANES, g_hi * _LANES):
                    p[r, j] = np.float32(0.0)
                continue
            m_old = m[r]
            mx, total = _fold_lanes(addr(s), rows_pad, r, g_lo, g_hi, jlo, jhi, m_old, addr(p), bsp)
            corr = _exp(m_old - mx) if m_old > -np.inf else np.float32(0.0)
            lsum[r] = lsum[r] * corr + total
            m[r] = mx
            for d in range(dim):
                o[r, d] *= corr
        _weighted_values(addr(o), rows_pad // SCORE_ROWS, addr(p) + np.uint64(j0 * 4), bsp,
                         vbase + row0 + np.uint64(j0 * kv_heads) * row_bytes, key_bytes, j1 - j0, n16,
                         v_pool[0, 0, 0, 0])
    for r in range(rows):
        m_out[r] = m[r]
        l_out[r] = lsum[r]


@nb.njit(error_model="numpy", cache=True, fastmath=_FASTMATH)
def _decode_merge(part_m, part_l, part_o, sinks, group, kvh, dim, out):
    """Merge the runs of kv head ``kvh`` into ``out`` ``[T, H * D]``: ``part_m``, ``part_l`` ``[nsplit, rows]`` and
    ``part_o`` ``[nsplit, rows padded, D]`` the runs' maxima, sums and unnormalised outputs (one run: out = o / (sum
    + sink))."""
    nsplit = part_m.shape[0]
    for r in range(out.shape[0] * group):
        t = r // group
        h = kvh * group + r % group
        mx = -np.inf
        for sp in range(nsplit):
            mx = max(mx, part_m[sp, r])
        den = np.float32(0.0)
        for sp in range(nsplit):
            if part_m[sp, r] > -np.inf:
                den += part_l[sp, r] * _exp(part_m[sp, r] - mx)
        if sinks is not None:
            den += np.float32(np.exp(np.float64(sinks[h]) - np.float64(mx)))
        # every row sees at least its own key, so no finite maximum means NaN scores: NaN out, as NumPy gives
        inv = np.float32(1.0) / den if mx > -np.inf else np.float32(np.nan)
        for d in range(dim):
            out[t, h * dim + d] = np.float32(0.0) if mx > -np.inf else inv
        for sp in range(nsplit):
            if part_m[sp, r] > -np.inf:
                w = _exp(part_m[sp, r] - mx) * inv
                for d in range(dim):
                    out[t, h * dim + d] += part_o[sp, r, d] * w


@nb.njit(error_model="numpy", parallel=True, cache=True, fastmath=_FASTMATH)
def paged_decode_rows(q, k_pool, v_pool, block_table, start, window, sinks, scale, nsplit, out):
    """As :func:`~freetoken.cpu_kernels.paged_attention.paged_attention_rows` for a float32, bf16 (uint16) or f16
    (int16) pool, ``H / Hkv * T <= DECODE_ROWS`` and ``D % 16 == 0``, in ``nsplit`` runs of keys per kv head
    (:func:`splits_for`). The fp8 kind runs the prompt kernel."""
    t_count, heads, dim = q.shape
    kv_heads = k_pool.shape[2]
    group = heads // kv_heads
    rows = t_count * group
    rows_pad = (rows + SCORE_ROWS - 1) // SCORE_ROWS * SCORE_ROWS
    part_m = np.empty((kv_heads, nsplit, rows), np.float32)
    part_l = np.empty((kv_heads, nsplit, rows), np.float32)
    part_o = np.empty((kv_heads, nsplit, rows_pad, dim), np.float32)
    for task in nb.prange(kv_heads * nsplit):
        kvh = task // nsplit
        sp = task - kvh * nsplit
        _decode_run(q, k_pool, v_pool, block_table, start, window, scale, nsplit, kvh, sp, part_m[kvh, sp],
                    part_l[kvh, sp], part_o[kvh, sp])
    for kvh in range(kv_heads):  # merge the runs
        _decode_merge(part_m[kvh], part_l[kvh], part_o[kvh], sinks, group, kvh, dim, out)


@nb.njit(error_model="numpy", parallel=True, cache=True, fastmath=_FASTMATH)
def paged_decode_batch(q, k_pool, v_pool, tables, seqs, window, sinks, scale, splits, out):
    """:func:`paged_decode_rows` for several sequences in one call: sequence ``i`` holds rows ``seqs[i, 0] ..
    seqs[i, 0] + seqs[i, 1] - 1`` of ``q`` and ``out`` at positions ``seqs[i, 2] ..``, block table ``tables[i]``,
    ``splits[i]`` runs of keys per kv head (``seqs``, ``splits`` int64). One parallel task per (sequence, kv head,
    run); every sequence's result is the one :func:`paged_decode_rows` gives it alone."""
    heads, dim = q.shape[1], q.shape[2]
    kv_heads = k_pool.shape[2]
    group = heads // kv_heads
    nseq = seqs.shape[0]
    first = np.zeros(nseq + 1, np.int64)  # the sequences' first tasks
    most = 1
    for i in range(nseq):
        first[i + 1] = first[i] + kv_heads * splits[i]
        most = max(most, seqs[i, 1] * group)
    most_pad = (most + SCORE_ROWS - 1) // SCORE_ROWS * SCORE_ROWS
    part_m = np.empty((first[nseq], most), np.float32)
    part_l = np.empty((first[nseq], most), np.float32)
    part_o = np.empty((first[nseq], most_pad, dim), np.float32)
    for task in nb.prange(first[nseq]):
        i = np.searchsorted(first, task, side="right") - 1
        nsplit = splits[i]
        kvh = (task - first[i]) // nsplit
        sp = task - first[i] - kvh * nsplit
        lo, n = seqs[i, 0], seqs[i, 1]
        _decode_run(q[lo:lo + n], k_pool, v_pool, tables[i], seqs[i, 2], window, scale, nsplit, kvh, sp,
                    part_m[task], part_l[task], part_o[task])
    for i in nb.prange(nseq):
        lo, n, nsplit = seqs[i, 0], seqs[i, 1], splits[i]
        for kvh in range(kv_heads):
            t0 = first[i] + kvh * nsplit
            _decode_merge(part_m[t0:t0 + nsplit, :n * group], part_l[t0:t0 + nsplit, :n * group],
                          part_o[t0:t0 + nsplit], sinks, group, kvh, dim, out[lo:lo + n])


#: :func:`paged_decode_rows` on the calling thread (a short context: :data:`SERIAL_MACS`).
paged_decode_rows_serial = serial_copy(paged_decode_rows)


def decode_kernel(keys: int, heads: int, dim: int):
    """:func:`paged_decode_rows` or its serial copy for a step over ``keys`` keys of ``heads`` query heads."""
    return paged_decode_rows_serial if keys * heads * dim < SERIAL_MACS else paged_decode_rows


#: :func:`paged_decode_batch` on the calling thread.
paged_decode_batch_serial = serial_copy(paged_decode_batch)


def decode_batch_kernel(macs: int):
    """:func:`paged_decode_batch` or its serial copy for steps of ``macs`` query-key multiply-adds in all."""
    return paged_decode_batch_serial if macs < SERIAL_MACS else paged_decode_batch
