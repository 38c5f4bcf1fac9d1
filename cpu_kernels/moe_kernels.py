"""The gate/up and down kernels of the CPU expert forward (:func:`freetoken.cpu_kernels.moe_experts.forward`).

One call:

1. groups the (token, expert) pairs by unique expert; a duplicate id in one token's row becomes one pair whose weight
   is the sum of both (the two contributions are identical, so this is exact up to rounding);
2. gate/up: ``prange`` over (unique expert, block of 8 rows). Each gate and up row is read from memory once, decoded in
   registers and dotted with every token routed to the expert (groups of 4, 2, 1 tokens; later groups re-read the
   row from L1/L2); the activation is applied per (row, token) into ``h [pairs, I]``;
3. down: ``prange`` over contiguous ranges of output rows; each thread streams every unique expert's rows of its range
   (experts outer: one long stream per expert) and accumulates into the ``y`` rows it owns (no atomics, a
   deterministic order).

Every record byte is read once per call; nothing is dequantized into memory; fp32 accumulation throughout. The row
dots come from :mod:`freetoken.cpu_kernels.moe_rows`; arguments are raw addresses
(:mod:`freetoken.cpu_kernels.moe_memory`), already checked by the driver.
"""

from __future__ import annotations

import numba as nb
import numpy as np
from freetoken.cpu_kernels.moe_bf16act import bf16_round_row
from freetoken.cpu_kernels.moe_int8_tile import MIN_AT, PANEL_BLOCK_BYTES, PANEL_ROWS, TILE_TOKENS
from freetoken.cpu_kernels.moe_kquant import FMT_Q4_K, FMT_Q5_K, FMT_Q6_K
from freetoken.cpu_kernels.moe_memory import addr, load_f32, load_i64, store_f32
from freetoken.cpu_kernels.moe_rows import (
    FASTMATH,
    FMT_MXFP4,
    FMT_NVFP4,
    FMT_Q4_0,
    FMT_Q8_0,
    SPLIT_FORMATS,
    row_dot1,
    row_dot1x2,
    row_dot2,
    row_dot4,
)
from freetoken.cpu_kernels.moe_rows_q8 import (
    BF16_ACT_FORMATS,
    panel_repack,
    panel_tile,
    row_q8_dot1,
    row_q8_dot1x2,
    row_q8_dot2,
    row_q8_dot4,
)
from freetoken.cpu_kernels.q8_act import quantize_row
from freetoken.cpu_kernels.serial_copy import serial_copy

from freetoken.device.constants import ACT_SWIGLU, GPT_OSS_ALPHA, GPT_OSS_LIMIT, NO_ROUTE

#: Rows of the gate/up matrices per work item (one int8 panel).
ROWS_GATE_UP = PANEL_ROWS
#: An expert with at least this many tokens runs the int8 panel micro-kernel (q8 path). Measured with the weights in
#: cache, one thread, K = 2048 (AVX-512 VNNI): at 4 tokens the panel's decode is half its time and it breaks even
#: with the row dots; at 8 it is 1.8x faster, at 16 2.4-3.4x, at 64 4.3-5.8x.
TILE_MIN_PAIRS = 6

_F32 = np.float32
_U64 = np.uint64


@nb.njit(error_model="numpy", cache=True)
def group_pairs(ids, weights, num_experts):
    """Unique experts (ascending) and their tokens; duplicate (token, expert) pairs merged by summing weights.

    Returns ``uniq [U]``, ``poff [U + 1]`` (pairs of ``uniq[u]`` are ``poff[u]:poff[u + 1]``), ``ptok [P]``,
    ``pw [P]`` (float32) and ``bad``: -1, or the flat position ``t * k + j`` of the first out-of-range id. Pairs whose
    id is ``NO_ROUTE`` are left out.
    """
    t_count, k = ids.shape
    keys = np.empty(t_count * k, np.int64)
    wsrc = np.empty(t_count * k, np.int64)  # each kept pair's flat position, for its weight
    m = 0
    for t in range(t_count):
        for j in range(k):
            e = ids[t, j]
            if e == NO_ROUTE:  # routed to another format's experts: this call skips it
                continue
            if e < 0 or e >= num_experts:
                return (np.empty(0, np.int32), np.zeros(1, np.int32), np.empty(0, np.int32),
                        np.empty(0, np.float32), np.int64(t * k + j))
            keys[m] = np.int64(e) * t_count + t
            wsrc[m] = t * k + j
            m += 1
    if m == 0:
        return (np.empty(0, np.int32), np.zeros(1, np.int32), np.empty(0, np.int32), np.empty(0, np.float32),
                np.int64(-1))
    keys = keys[:m]
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
        w = weights[wsrc[i] // k, wsrc[i] % k]
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


@nb.njit(error_model="numpy", inline="always")
def _pairs_rows(fmt):
    """Whether a single token dots two rows per call (``row_dot1x2``): the nibble and GGUF block formats, whose
    decode leaves the per-row overhead (and the FMA chains of one row) worth sharing; bf16 and fp8 stream at full
    speed row by row."""
    return fmt == FMT_MXFP4 or fmt == FMT_NVFP4 or fmt == FMT_Q4_0 or fmt >= FMT_Q8_0


@nb.njit(error_model="numpy", inline="always")
def _has_panel(fmt):
    """Whether the q8 path has a panel micro-kernel for ``fmt`` (the 4-bit formats, q4_k, q5_k, q6_k); the others
    (q8_0, iq4_xs) run the int8 row dots whatever the number of tokens."""
    return (fmt == FMT_Q4_0 or fmt == FMT_MXFP4 or fmt == FMT_NVFP4 or fmt == FMT_Q4_K or fmt == FMT_Q5_K
            or fmt == FMT_Q6_K)


@nb.njit(error_model="numpy", fastmath=FASTMATH, inline="always")
def rows_dot(fmt, q8, w, s, g, e, n, nr, rows, k, x, xq, offs, npairs, acc):
    """Rows ``n .. n + nr - 1`` of matrix ``e`` dotted with token vectors into ``acc[r * npairs + q]`` (float32
    address). Token vectors: float32 at element offsets ``offs[:npairs]`` (int64 address) of address ``x``, or, with
    ``q8``, 8-bit rows ``offs[:npairs]`` of ``xq`` (:mod:`freetoken.cpu_kernels.q8_act`). ``nr`` is 1, or 2 with a
    single vector (the T = 1 path); tokens go in groups of 4, 2, 1."""
    if nr == 2:
        if q8:
            r2 = row_q8_dot1x2(fmt, w, s, g, e, n, rows, k, xq, load_i64(offs, 0))
        else:
            r2 = row_dot1x2(fmt, w, s, g, e, n, rows, k, x, load_i64(offs, 0))
        store_f32(acc, 0, r2[0])
        store_f32(acc, 1, r2[1])
        return
    q = 0
    while npairs - q >= 4:
        o0, o1, o2, o3 = load_i64(offs, q), load_i64(offs, q + 1), load_i64(offs, q + 2), load_i64(offs, q + 3)
        if q8:
            r4 = row_q8_dot4(fmt, w, s, g, e, n, rows, k, xq, o0, o1, o2, o3)
        else:
            r4 = row_dot4(fmt, w, s, g, e, n, rows, k, x, o0, o1, o2, o3)
        for i in range(4):
            store_f32(acc, q + i, r4[i])
        q += 4
    if npairs - q >= 2:
        o0, o1 = load_i64(offs, q), load_i64(offs, q + 1)
        if q8:
            r2 = row_q8_dot2(fmt, w, s, g, e, n, rows, k, xq, o0, o1)
        else:
            r2 = row_dot2(fmt, w, s, g, e, n, rows, k, x, o0, o1)
        store_f32(acc, q, r2[0])
        store_f32(acc, q + 1, r2[1])
        q += 2
    if npairs - q >= 1:
        o0 = load_i64(offs, q)
        if q8:
            store_f32(acc, q, row_q8_dot1(fmt, w, s, g, e, n, rows, k, xq, o0))
        else:
            store_f32(acc, q, row_dot1(fmt, w, s, g, e, n, rows, k, x, o0))


@nb.njit(error_model="numpy", inline="always")
def quantize_rows_parallel(q8, fmt, x, qoff, xq8):
    """With ``q8``: every row of ``x`` into the 8-bit rows ``xq8`` = (qa, nc, dx, cs) (one parallel region; ``cs``'s
    halves in ``fmt``'s K order), or for bf16 and fp8_block into bf16 rows in ``qa``, returning the row dots' (qa,
    nc, dx, kp, cs) addresses; without: zeros. Many rows (a prompt) in one parallel region."""
    qa, nc, dx, cs = xq8
    if not q8:
        return _U64(0), _U64(0), _U64(0), _U64(0), _U64(0)
    if fmt in BF16_ACT_FORMATS:  # bf16 rows in qa (2 bytes per value); nc, dx and cs unused
        if x.shape[0] <= 16:
            for t in range(x.shape[0]):
                bf16_round_row(x, t, qa)
        else:
            for t in nb.prange(x.shape[0]):
                bf16_round_row(x, t, qa)
        return addr(qa), _U64(0), _U64(0), _U64(qa.shape[1]), _U64(0)
    split = fmt in SPLIT_FORMATS
    if x.shape[0] <= 16:  # a few rows: cheaper than entering a parallel region (~5 us)
        for t in range(x.shape[0]):
            quantize_row(x, t, qoff, split, qa, nc, dx, cs)
    else:
        for t in nb.prange(x.shape[0]):
            quantize_row(x, t, qoff, split, qa, nc, dx, cs)
    return addr(qa), addr(nc), addr(dx), _U64(qa.shape[1]), addr(cs)


@nb.njit(error_model="numpy", inline="always")
def _activation(g, u, act):
    if act == ACT_SWIGLU:
        return g / (_F32(1.0) + np.exp(-g)) * u
    lim = _F32(GPT_OSS_LIMIT)
    g = lim if g > lim else g  # comparisons written so that NaN passes through, as np.minimum/np.clip do
    u = lim if u > lim else (-lim if u < -lim else u)
    return (u + _F32(1.0)) * g / (_F32(1.0) + np.exp(_F32(-GPT_OSS_ALPHA) * g))


@nb.njit(error_model="numpy", inline="always")
def _tile_tokens(offs, q0, npairs, toks):
    """``TILE_TOKENS`` token row indices from ``offs[q0:]`` into ``toks``, the last one repeated past ``npairs``;
    returns how many are real."""
    n = min(TILE_TOKENS, npairs - q0)
    for i in range(TILE_TOKENS):
        toks[i] = offs[q0 + min(i, n - 1)]
    return n


@nb.njit(error_model="numpy", inline="always")
def _panel_buffers(k):
    """A worker's panel, its scales, the tile's token indices and outputs (two of each panel: gate and up)."""
    nblk = k // 32
    return (np.empty((2, nblk * PANEL_BLOCK_BYTES), np.uint8),
            np.empty((2, nblk * (MIN_AT + 1) * PANEL_ROWS), np.float32),
            np.empty(TILE_TOKENS, np.int64), np.empty((2, TILE_TOKENS * PANEL_ROWS), np.float32))


@nb.njit(error_model="numpy", parallel=True, nogil=True, cache=True, boundscheck=False, fastmath=FASTMATH)
def gate_up_kernel(fmt, gate, up, gb, ub, has_bias, act, uniq, poff, ptok, xs, q8, qoff, xq8, hidden, inter, hperm,
                   h, nthreads):
    """h[p, hperm[n]] = act(gate_e[n] . x[ptok[p]] + gb, up_e[n] . x[ptok[p]] + ub) for the pairs p of each e.

    ``gate``/``up``: addresses (values, scales, globals) of the matrices' banks; ``gb``/``ub``: addresses of the
    float32 [E, I] biases; ``xs``: the float32 [T, H] tokens in K order. With ``q8`` they are first quantized into
    the 8-bit rows ``xq8`` = (qa, nc, dx, cs) (offset ``qoff``, :mod:`freetoken.cpu_kernels.q8_act`) and those are
    read: by the panel micro-kernel for an expert with ``TILE_MIN_PAIRS`` tokens or more, by the row dots otherwise.
    """
    xa = addr(xs)
    xq = quantize_rows_parallel(q8, fmt, xs, qoff, xq8)
    gw, gs, gg = gate
    uw, us, ug = up
    n_uniq = uniq.shape[0]
    nrb = (inter + ROWS_GATE_UP - 1) // ROWS_GATE_UP
    nitems = n_uniq * nrb
    pair_rows = _pairs_rows(fmt)
    panels = q8 and _has_panel(fmt)
    max_pairs = 2  # >= 2: the two-row single-token path
    tiles = False
    for ui in range(n_uniq):
        max_pairs = max(max_pairs, poff[ui + 1] - poff[ui])
        tiles = tiles or (panels and poff[ui + 1] - poff[ui] >= TILE_MIN_PAIRS)
    for wk in nb.prange(nthreads):
        accg = np.empty(max_pairs, np.float32)
        accu = np.empty(max_pairs, np.float32)
        offs = np.empty(max_pairs, np.int64)
        accg_a, accu_a, offs_a = addr(accg), addr(accu), addr(offs)
        panel, pscale, toks, tout = _panel_buffers(hidden if tiles else 32)
        for it in range(wk * nitems // nthreads, (wk + 1) * nitems // nthreads):
            ui = it // nrb
            r0 = (it % nrb) * ROWS_GATE_UP
            r_end = min(inter, r0 + ROWS_GATE_UP)
            e = uniq[ui]
            p0 = poff[ui]
            npairs = poff[ui + 1] - p0
            for q in range(npairs):
                offs[q] = ptok[p0 + q] if q8 else ptok[p0 + q] * hidden
            if panels and npairs >= TILE_MIN_PAIRS:  # r_end - r0 == PANEL_ROWS: inter is a multiple of 32
                for m in range(2):
                    w, s, g = (gw, gs, gg) if m == 0 else (uw, us, ug)
                    panel_repack(fmt, w, s, g, e, r0, inter, hidden, addr(panel[m]), addr(pscale[m]))
                for q0 in range(0, npairs, TILE_TOKENS):
                    n = _tile_tokens(offs, q0, npairs, toks)
                    for m in range(2):
                        panel_tile(fmt, addr(panel[m]), addr(pscale[m]), xq, addr(toks), hidden, addr(tout[m]))
                    for rr in range(PANEL_ROWS):
                        gbias = load_f32(gb, e * inter + r0 + rr) if has_bias else _F32(0.0)
                        ubias = load_f32(ub, e * inter + r0 + rr) if has_bias else _F32(0.0)
                        col = hperm[r0 + rr]
                        for i in range(n):
                            j = i * PANEL_ROWS + rr
                            h[p0 + q0 + i, col] = _activation(tout[0, j] + gbias, tout[1, j] + ubias, act)
                continue
            n = r0
            while n < r_end:
                nr = 2 if pair_rows and npairs == 1 and n + 1 < r_end else 1
                for m in range(2):  # one inlined call site for gate and up: half the compile time
                    if m == 0:
                        w, s, g, acc = gw, gs, gg, accg_a
                    else:
                        w, s, g, acc = uw, us, ug, accu_a
                    rows_dot(fmt, q8, w, s, g, e, n, nr, inter, hidden, xa, xq, offs_a, npairs, acc)
                for rr in range(nr):
                    gbias = load_f32(gb, e * inter + n + rr) if has_bias else _F32(0.0)
                    ubias = load_f32(ub, e * inter + n + rr) if has_bias else _F32(0.0)
                    col = hperm[n + rr]
                    for q in range(npairs):
                        i = rr * npairs + q
                        h[p0 + q, col] = _activation(accg[i] + gbias, accu[i] + ubias, act)
                n += nr


@nb.njit(error_model="numpy", parallel=True, nogil=True, cache=True, boundscheck=False, fastmath=FASTMATH)
def down_kernel(fmt, down, db, has_bias, uniq, poff, ptok, pw, h, q8, qoff, hq8, hidden, inter, out, nthreads):
    """out[t, r] = sum over pairs p of token t: pw[p] * (down_e[r] . h[p] + db[e, r]); ``down``: bank addresses,
    ``db``: address of the float32 [E, H] biases; with ``q8`` h is first quantized into ``hq8`` and that is read
    (by the panel micro-kernel for an expert with ``TILE_MIN_PAIRS`` tokens or more)."""
    hq = quantize_rows_parallel(q8, fmt, h, qoff, hq8)
    dw, ds, dg = down
    ha = addr(h)
    n_uniq = uniq.shape[0]
    t_count = out.shape[0]
    pair_rows = _pairs_rows(fmt)
    panels = q8 and _has_panel(fmt)
    max_pairs = 2  # >= 2: the two-row single-token path
    tiles = False
    for ui in range(n_uniq):
        max_pairs = max(max_pairs, poff[ui + 1] - poff[ui])
        tiles = tiles or (panels and poff[ui + 1] - poff[ui] >= TILE_MIN_PAIRS)
    for wk in nb.prange(nthreads):
        acc = np.empty(max_pairs, np.float32)
        offs = np.empty(max_pairs, np.int64)
        acc_a, offs_a = addr(acc), addr(offs)
        panel, pscale, toks, tout = _panel_buffers(inter if tiles else 32)
        # each worker owns a contiguous range of output rows (whole 16-row groups: 64-byte lines of out, even
        # counts for the row pairs, whole panels); experts outer: one long stream per expert
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
                offs[q] = p0 + q if q8 else (p0 + q) * inter
            if panels and npairs >= TILE_MIN_PAIRS:
                for rp in range(r0, r1, PANEL_ROWS):
                    panel_repack(fmt, dw, ds, dg, e, rp, hidden, inter, addr(panel[0]), addr(pscale[0]))
                    for q0 in range(0, npairs, TILE_TOKENS):
                        n = _tile_tokens(offs, q0, npairs, toks)
                        panel_tile(fmt, addr(panel[0]), addr(pscale[0]), hq, addr(toks), inter, addr(tout[0]))
                        for i in range(n):
                            p = p0 + q0 + i
                            wgt = pw[p]
                            t = ptok[p]
                            for rr in range(PANEL_ROWS):
                                bias = load_f32(db, e * hidden + rp + rr) if has_bias else _F32(0.0)
                                out[t, rp + rr] += wgt * (tout[0, i * PANEL_ROWS + rr] + bias)
                continue
            r = r0
            while r < r1:
                nr = 2 if pair_rows and npairs == 1 and r + 1 < r1 else 1
                rows_dot(fmt, q8, dw, ds, dg, e, r, nr, hidden, inter, ha, hq, offs_a, npairs, acc_a)
                for rr in range(nr):
                    bias = load_f32(db, e * hidden + r + rr) if has_bias else _F32(0.0)
                    for q in range(npairs):
                        out[ptok[p0 + q], r + rr] += pw[p0 + q] * (acc[rr * npairs + q] + bias)
                r += nr


#: The two kernels on the calling thread, for calls too small to repay a parallel region (a decode step of a small
#: model): no thread to wake or wait for, and no ``set_num_threads`` round trip around the call.
gate_up_serial = serial_copy(gate_up_kernel)
down_serial = serial_copy(down_kernel)
