"""Causal grouped-query attention over the paged KV cache on the CPU (the cpu twin of ``cuda/paged_attention.cu``;
contract: ``freetoken/testing/reference/paged_attention.py``).

One parallel task per (kv head, tile of up to :data:`QUERY_TILE` queries). The task's rows are its (query, head of
the group) pairs, so each K/V block it decodes serves every head of the group and every query of the tile (a decode
step: one task per kv head, G rows; a prompt chunk: many tasks of up to 16 G rows). Per pool block the rows can see
(below the causal limit, inside the sliding window), both products run on the dense product's register micro-kernel
(:mod:`freetoken.cpu_kernels.gemm_panel`, lanes = 16 outputs, one broadcast FMA per row and stored value):

* scores ``S = Q K^T``: 16 keys in the lanes. Their rows are widened (bf16 / f16 / f32; fp8 first decoded) and
  transposed in registers into a ``[D, 16]`` panel, then every row of the tile runs through it;
* ``O += P V``: 16 of the D output values in the lanes. V rows are already in that layout: they are widened into
  ``[D / 16, keys, 16]`` without a transpose, and P (the rows' probabilities, 0 where masked) is the broadcast side.

Between them an online softmax per row and block: running max, rescale of the row's sum and output, exponentials
by a vectorisable polynomial (:func:`_exp`, ~2 ulp). Float32 throughout; each lane sums in order, so the result
does not depend on the vector width.
"""

import numba as nb
import numpy as np
from freetoken.cpu_kernels.gemm_panel import PANEL_ROWS, SHORT_TOKENS, TOKENS, panel_tile, panel_tile4, widen16_strided
from freetoken.cpu_kernels.moe_memory import addr
from freetoken.cpu_kernels.widen import _widen
from llvmlite import ir
from numba import types
from numba.extending import intrinsic, overload

#: Queries per task: 16 queries x a group of 4-8 heads = 64-128 rows share each decoded K/V block.
QUERY_TILE = 16

_FASTMATH = {"contract"}  # fused multiply-adds; no reassociation: results do not depend on the vector width
_LANES = PANEL_ROWS


@intrinsic
def _bits_f32(typingctx, i):
    """int32 bits -> the float32 they encode (a bitcast the vectoriser keeps in registers)."""
    if i != types.int32:
        return None

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())
    return types.float32(i), codegen


#: The softmax exponential's constants (:func:`_exp`, and its 16-lane IR in :mod:`~freetoken.cpu_kernels.paged_decode`):
#: inputs below ``EXP_MIN`` give 0; ln 2 split in a high part exact in float32 and the rest; the degree-6 Taylor
#: coefficients, highest first.
EXP_MIN = -87.0
LOG2E = 1.4426950408889634
LN2_HI, LN2_LO = 0.693145751953125, 1.428606765330187e-06
EXP_TAYLOR = (1.0 / 720.0, 1.0 / 120.0, 1.0 / 24.0, 1.0 / 6.0, 0.5, 1.0, 1.0)


@nb.njit(error_model="numpy", inline="always", fastmath=_FASTMATH)
def _exp(x):
    """exp(x) for float32 x <= 0 (scores minus their running max): 2^n * p(r), r = x - n ln2 in [-ln2/2, ln2/2],
    p the degree-6 Taylor polynomial (relative error < 3e-7); x < ``EXP_MIN`` gives 0."""
    y = max(x, np.float32(EXP_MIN))
    n = np.float32(np.floor(y * np.float32(LOG2E) + np.float32(0.5)))
    r = y - n * np.float32(LN2_HI) - n * np.float32(LN2_LO)
    p = np.float32(EXP_TAYLOR[0])
    p = p * r + np.float32(EXP_TAYLOR[1])
    p = p * r + np.float32(EXP_TAYLOR[2])
    p = p * r + np.float32(EXP_TAYLOR[3])
    p = p * r + np.float32(EXP_TAYLOR[4])
    p = p * r + np.float32(EXP_TAYLOR[5])
    p = p * r + np.float32(EXP_TAYLOR[6])
    v = p * _bits_f32(np.int32((np.int32(n) + np.int32(127)) << np.int32(23)))
    return v if x >= np.float32(EXP_MIN) else np.float32(0.0)


@nb.njit(error_model="numpy", inline="always")
def _widen_fp8(code, table, scale):
    return table[code] * scale


def _key_panel(pool, scales, table, block, kvh, g0, nkeys, panel, tmp):
    """Keys ``g0 .. g0 + nkeys - 1`` of pool block ``block``, kv head ``kvh`` -> ``panel[d, lane]`` (lanes past
    ``nkeys`` zero). Chosen by the pool's element type while Numba types the caller (an fp8 pool's codes are no
    type the widening intrinsics take, so the two bodies must never be typed together)."""


@overload(_key_panel, jit_options={"fastmath": _FASTMATH})
def _key_panel_typed(pool, scales, table, block, kvh, g0, nkeys, panel, tmp):
    if pool.dtype == types.uint8:
        def fp8(pool, scales, table, block, kvh, g0, nkeys, panel, tmp):  # decode through table and scales
            dim = pool.shape[3]
            for j in range(nkeys):
                s = scales[block, g0 + j, kvh]
                for d in range(dim):
                    tmp[j, d] = _widen_fp8(pool[block, g0 + j, kvh, d], table, s)
            _widen_rows(tmp, addr(tmp), np.uint64(dim * 4), nkeys, panel, tmp[0, 0])
        return fp8

    def plain(pool, scales, table, block, kvh, g0, nkeys, panel, tmp):  # widen the stored rows in place
        dim = pool.shape[3]
        stride = np.uint64(pool.shape[2] * dim * pool.itemsize)
        src = addr(pool) + np.uint64(((block * pool.shape[1] + g0) * pool.shape[2] + kvh) * dim * pool.itemsize)
        _widen_rows(pool[block, g0:, kvh], src, stride, nkeys, panel, pool[0, 0, 0, 0])
    return plain


@nb.njit(error_model="numpy", inline="always", fastmath=_FASTMATH)
def _widen_rows(rows_view, src, stride, nkeys, panel, sample):
    dim = panel.shape[0]
    if dim >= 16:
        widen16_strided(src, dim, stride, nkeys, addr(panel), sample)
    for d in range(dim - dim % 16, dim):  # the head dim's last D % 16 values
        for j in range(nkeys):
            panel[d, j] = _widen(rows_view[j, d])
        for j in range(nkeys, _LANES):
            panel[d, j] = np.float32(0.0)


def _value_panels(pool, scales, table, block, kvh, nkeys, vpan):
    """Values of keys ``0 .. nkeys - 1`` of the block -> ``vpan[c, j, lane] = V[j, 16 c + lane]`` (zero past
    ``nkeys`` and past D); chosen by the pool's element type as :func:`_key_panel`."""


@overload(_value_panels, jit_options={"fastmath": _FASTMATH})
def _value_panels_typed(pool, scales, table, block, kvh, nkeys, vpan):
    if pool.dtype == types.uint8:
        def fp8(pool, scales, table, block, kvh, nkeys, vpan):
            dim = pool.shape[3]
            for j in range(nkeys):
                s = scales[block, j, kvh]
                for d in range(dim):
                    vpan[d // _LANES, j, d % _LANES] = _widen_fp8(pool[block, j, kvh, d], table, s)
            _zero_value_tail(dim, nkeys, vpan)
        return fp8

    def plain(pool, scales, table, block, kvh, nkeys, vpan):
        dim = pool.shape[3]
        for j in range(nkeys):
            for c in range(dim // _LANES):
                for lane in range(_LANES):
                    vpan[c, j, lane] = _widen(pool[block, j, kvh, c * _LANES + lane])
            for d in range(dim - dim % _LANES, dim):
                vpan[d // _LANES, j, d % _LANES] = _widen(pool[block, j, kvh, d])
        _zero_value_tail(dim, nkeys, vpan)
    return plain


@nb.njit(error_model="numpy", inline="always")
def _zero_value_tail(dim, nkeys, vpan):
    """Zeros in ``vpan`` past D (the last panel's lanes) and past ``nkeys`` (the block's last keys)."""
    nc, bsp = vpan.shape[0], vpan.shape[1]
    for j in range(nkeys):
        for d in range(dim, nc * _LANES):
            vpan[d // _LANES, j, d % _LANES] = np.float32(0.0)
    for c in range(nc):
        for j in range(nkeys, bsp):
            for lane in range(_LANES):
                vpan[c, j, lane] = np.float32(0.0)


@nb.njit(error_model="numpy", inline="always", fastmath=_FASTMATH)
def _rows_through(panel, x, k, rows, acc, toks):
    """``acc[r] += x[r, :k] @ panel[:k]`` for rows ``0 .. rows - 1`` (micro-kernel tiles; a short last tile runs
    the 4-row kernel)."""
    pa, xa, aa, ta = addr(panel), addr(x), addr(acc), addr(toks)
    r0 = 0
    while r0 < rows:
        n = rows - r0
        if n <= SHORT_TOKENS:
            for i in range(SHORT_TOKENS):
                toks[i] = r0 + min(i, n - 1)
            panel_tile4(pa, xa, k, 0, k, ta, aa)
        else:
            for i in range(TOKENS):
                toks[i] = r0 + min(i, n - 1)
            panel_tile(pa, xa, k, 0, k, ta, aa)
        r0 += TOKENS if n > SHORT_TOKENS else SHORT_TOKENS


@nb.njit(error_model="numpy", inline="always", fastmath=_FASTMATH)
def _fold_row(s, p, m, lsum, o, tot, r, g_lo, g_hi, jlo, jhi):
    """Row r's online softmax over one block's keys ``jlo .. jhi - 1`` (key ``g * _LANES + lane`` scored
    ``s[g, r, lane]``, groups ``g_lo .. g_hi - 1``): the running max ``m[r]`` and sum ``lsum[r]`` updated, the row's
    outputs ``o[:, r]`` rescaled, and the block's unnormalised probabilities into ``p[r]`` (0 for the other keys) for
    ``O += P V``. ``tot``: scratch of ``_LANES``."""
    mx = m[r]
    for g in range(g_lo, g_hi):
        for lane in range(_LANES):
            j = g * _LANES + lane
            if j >= jlo and j < jhi:
                mx = max(mx, s[g, r, lane])
    corr = _exp(m[r] - mx) if m[r] > -np.inf else np.float32(0.0)
    for lane in range(_LANES):
        tot[lane] = np.float32(0.0)
    for g in range(g_lo, g_hi):  # per-lane partial sums: vectorised, the same on any vector width
        for lane in range(_LANES):
            j = g * _LANES + lane
            e = _exp(s[g, r, lane] - mx)
            e = e if j >= jlo and j < jhi else np.float32(0.0)
            p[r, j] = e
            tot[lane] += e
    total = np.float32(0.0)
    for lane in range(_LANES):
        total += tot[lane]
    lsum[r] = lsum[r] * corr + total
    m[r] = mx
    for c in range(o.shape[0]):
        for lane in range(_LANES):
            o[c, r, lane] *= corr


@nb.njit(error_model="numpy", parallel=True, cache=True, fastmath=_FASTMATH)
def paged_attention_rows(q, k_pool, v_pool, k_scale, v_scale, table, block_table, start, window, sinks, scale, out):
    """q float32 ``[T, H, D]`` at positions ``start ..``; pools ``[NB, BS, Hkv, D]`` (float32, uint16 = bf16 bits,
    int16 = IEEE half bits, uint8 = fp8 codes with float32 scales ``[NB, BS, Hkv]``, else scales None); ``table``
    the fp8 code values (any float32 array otherwise); ``window`` 0 for none; ``sinks`` float32 ``[H]`` or None;
    ``scale`` the score factor -> out float32 ``[T, H * D]``."""
    t_count, heads, dim = q.shape
    bs, kv_heads = k_pool.shape[1], k_pool.shape[2]
    group = heads // kv_heads
    nc = (dim + _LANES - 1) // _LANES
    ngroups = (bs + _LANES - 1) // _LANES
    bsp = ngroups * _LANES
    tiles = (t_count + QUERY_TILE - 1) // QUERY_TILE
    for task in nb.prange(tiles * kv_heads):
        # tiles alternate from both ends (0, n-1, 1, n-2, ...): a thread's contiguous run of tasks mixes the short
        # causal rows of early queries with the long ones of late queries
        ti = task // kv_heads
        kvh = task - ti * kv_heads
        tile = ti // 2 if ti % 2 == 0 else tiles - 1 - ti // 2
        t0 = tile * QUERY_TILE
        t1 = min(t_count, t0 + QUERY_TILE)
        rows = (t1 - t0) * group
        qs = np.empty((rows, dim), np.float32)
        for r in range(rows):
            t = t0 + r // group
            h = kvh * group + r % group
            for d in range(dim):
                qs[r, d] = q[t, h, d] * scale
        m = np.full(rows, -np.inf, np.float32)
        lsum = np.zeros(rows, np.float32)
        o = np.zeros((nc, rows, _LANES), np.float32)
        s = np.empty((ngroups, rows, _LANES), np.float32)
        p = np.zeros((rows, bsp), np.float32)
        kpan = np.empty((dim, _LANES), np.float32)
        vpan = np.empty((nc, bsp, _LANES), np.float32)
        tmp = np.empty((_LANES, dim), np.float32)
        toks = np.empty(max(TOKENS, SHORT_TOKENS), np.int64)
        tot = np.empty(_LANES, np.float32)
        hi = start + t1  # keys [lo, hi) serve some row of the tile
        lo = 0 if window == 0 else max(0, start + t0 - window + 1)
        for blk in range(lo // bs, (hi - 1) // bs + 1):
            base = blk * bs
            block = block_table[blk]
            j1 = min(hi - base, bs)  # keys past the tile's last position are not read
            g_lo = max(lo - base, 0) // _LANES
            for g in range(g_lo, (j1 + _LANES - 1) // _LANES):
                _key_panel(k_pool, k_scale, table, block, kvh, g * _LANES, min(_LANES, j1 - g * _LANES), kpan, tmp)
                for r in range(rows):
                    for lane in range(_LANES):
                        s[g, r, lane] = np.float32(0.0)
                _rows_through(kpan, qs, dim, rows, s[g], toks)
            _value_panels(v_pool, v_scale, table, block, kvh, j1, vpan)
            g_hi = (j1 + _LANES - 1) // _LANES
            for r in range(rows):
                for j in range(bsp):
                    p[r, j] = np.float32(0.0)
                pos = start + t0 + r // group
                jhi = min(j1, pos - base + 1)  # keys up to the query's own position
                jlo = max(lo - base, 0) if window == 0 else max(0, pos - window + 1 - base)
                if jhi <= jlo:
                    continue
                _fold_row(s, p, m, lsum, o, tot, r, g_lo, g_hi, jlo, jhi)
            for c in range(nc):
                _rows_through(vpan[c], p, bsp, rows, o[c], toks)
        for r in range(rows):
            t = t0 + r // group
            h = kvh * group + r % group
            den = lsum[r]
            if sinks is not None:
                den += np.float32(np.exp(np.float64(sinks[h]) - np.float64(m[r])))
            inv = np.float32(1.0) / den
            for d in range(dim):
                out[t, h * dim + d] = o[d // _LANES, r, d % _LANES] * inv
