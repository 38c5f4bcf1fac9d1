"""Multi-head latent attention (DeepSeek-V3, absorbed form) over the paged KV cache on the CPU (the cpu twin of
``cuda/latent_attention.cu``; contract: ``freetoken/testing/reference/latent_attention.py``).

The paged attention kernel's structure (:mod:`freetoken.cpu_kernels.paged_attention`) with its pieces: the cache has
one kv head whose rows ``[c_kv, k_pe]`` (R + P values) are the keys of every query head, and their first R values
the values. One parallel task per (tile of up to :data:`QUERY_TILE` queries, chunk of up to :data:`HEAD_CHUNK`
heads): the task's rows are its (query, head) pairs, so each pool block it decodes serves all of them (a decode step
of DeepSeek-V3's 128 heads: 8 tasks of 16 rows; a prompt chunk: many tasks of up to 16 x 16 rows). Per pool block,
both products run on the dense product's register micro-kernel (:mod:`freetoken.cpu_kernels.gemm_panel`):

* scores ``S = Q K^T``: 16 keys in the lanes, their rows widened and transposed into a ``[R + P, 16]`` panel;
* ``O += P V``: 16 of the R output values in the lanes, ``V = K[:, :R]`` widened into ``[., keys, 16]`` panels.

Between them an online softmax per row and block (running max, rescale of the row's sum and output, exponentials
by the paged kernel's float32 polynomial). Float32 throughout; each lane sums in order, so the result does not
depend on the vector width.
"""

import numba as nb
import numpy as np
from freetoken.cpu_kernels.gemm_panel import SHORT_TOKENS, TOKENS
from freetoken.cpu_kernels.paged_attention import _LANES, _fold_row, _key_panel, _rows_through, _value_panels

#: Queries per task (prompt chunks): their rows share each decoded block.
QUERY_TILE = 16
#: Heads per task: a decode step of many heads still spreads over the cores, and a task's accumulators stay small.
HEAD_CHUNK = 16

_FASTMATH = {"contract"}  # fused multiply-adds; no reassociation: results do not depend on the vector width


@nb.njit(cache=True)
def _tasks(t_count, heads):
    """Parallel tasks of a sequence of ``t_count`` queries of ``heads`` heads: (query tile, head chunk) pairs."""
    return (t_count + QUERY_TILE - 1) // QUERY_TILE * ((heads + HEAD_CHUNK - 1) // HEAD_CHUNK)


@nb.njit(error_model="numpy", cache=True, fastmath=_FASTMATH)
def _latent_task(q, pool, pool_scale, table, block_table, start, rank, scale, task, out):
    """Task ``task`` of :func:`latent_attention_rows` for the queries ``q`` at positions ``start ..`` (its rows of
    ``out``)."""
    t_count, heads, width = q.shape
    bs = pool.shape[1]
    nc = (rank + _LANES - 1) // _LANES  # output panels
    ncv = (width + _LANES - 1) // _LANES  # value panels _value_panels fills (the whole row)
    ngroups = (bs + _LANES - 1) // _LANES
    bsp = ngroups * _LANES
    tiles = (t_count + QUERY_TILE - 1) // QUERY_TILE
    chunks = (heads + HEAD_CHUNK - 1) // HEAD_CHUNK
    # tiles alternate from both ends (0, n-1, 1, n-2, ...): a thread's contiguous run of tasks mixes the short
    # causal rows of early queries with the long ones of late queries
    ti = task // chunks
    h0 = (task - ti * chunks) * HEAD_CHUNK
    tile = ti // 2 if ti % 2 == 0 else tiles - 1 - ti // 2
    t0 = tile * QUERY_TILE
    t1 = min(t_count, t0 + QUERY_TILE)
    nh = min(heads, h0 + HEAD_CHUNK) - h0
    rows = (t1 - t0) * nh
    qs = np.empty((rows, width), np.float32)
    for r in range(rows):
        t = t0 + r // nh
        h = h0 + r % nh
        for c in range(width):
            qs[r, c] = q[t, h, c] * scale
    m = np.full(rows, -np.inf, np.float32)
    lsum = np.zeros(rows, np.float32)
    o = np.zeros((nc, rows, _LANES), np.float32)
    s = np.empty((ngroups, rows, _LANES), np.float32)
    p = np.zeros((rows, bsp), np.float32)
    kpan = np.empty((width, _LANES), np.float32)
    vpan = np.empty((ncv, bsp, _LANES), np.float32)
    tmp = np.empty((_LANES, width), np.float32)
    toks = np.empty(max(TOKENS, SHORT_TOKENS), np.int64)
    tot = np.empty(_LANES, np.float32)
    hi = start + t1  # keys [0, hi) serve some row of the task
    for blk in range((hi - 1) // bs + 1):
        base = blk * bs
        block = block_table[blk]
        j1 = min(hi - base, bs)  # keys past the task's last position are not read
        g_hi = (j1 + _LANES - 1) // _LANES
        for g in range(g_hi):
            _key_panel(pool, pool_scale, table, block, 0, g * _LANES, min(_LANES, j1 - g * _LANES), kpan, tmp)
            for r in range(rows):
                for lane in range(_LANES):
                    s[g, r, lane] = np.float32(0.0)
            _rows_through(kpan, qs, width, rows, s[g], toks)
        _value_panels(pool, pool_scale, table, block, 0, j1, vpan)
        for r in range(rows):
            for j in range(bsp):
                p[r, j] = np.float32(0.0)
            jhi = min(j1, start + t0 + r // nh - base + 1)  # keys up to the query's own position
            if jhi <= 0:
                continue
            _fold_row(s, p, m, lsum, o, tot, r, 0, g_hi, 0, jhi)
        for c in range(nc):
            _rows_through(vpan[c], p, bsp, rows, o[c], toks)
    for r in range(rows):
        t = t0 + r // nh
        h = h0 + r % nh
        inv = np.float32(1.0) / lsum[r]
        for d in range(rank):
            out[t, h * rank + d] = o[d // _LANES, r, d % _LANES] * inv


@nb.njit(error_model="numpy", parallel=True, cache=True, fastmath=_FASTMATH)
def latent_attention_rows(q, pool, pool_scale, table, block_table, start, rank, scale, out):
    """q float32 ``[T, H, R + P]`` at positions ``start ..``; pool ``[NB, BS, 1, R + P]`` (float32, uint16 = bf16
    bits, int16 = IEEE half bits, uint8 = fp8 codes with float32 scales ``[NB, BS, 1]``, else scales None);
    ``table`` the fp8 code values (any float32 array otherwise); ``rank`` R; ``scale`` the score factor
    -> out float32 ``[T, H * R]``."""
    for task in nb.prange(_tasks(q.shape[0], q.shape[1])):
        _latent_task(q, pool, pool_scale, table, block_table, start, rank, scale, task, out)


@nb.njit(error_model="numpy", parallel=True, cache=True, fastmath=_FASTMATH)
def latent_attention_batch(q, pool, pool_scale, table, tables, seqs, rank, scale, out):
    """:func:`latent_attention_rows` for several sequences in one call: sequence ``i`` holds rows ``seqs[i, 0] ..
    seqs[i, 0] + seqs[i, 1] - 1`` of ``q`` and ``out`` at positions ``seqs[i, 2] ..``, block table ``tables[i]``
    (``seqs`` int64). One parallel task per (sequence, query tile, head chunk); each sequence's result is the one
    :func:`latent_attention_rows` gives it alone."""
    nseq = seqs.shape[0]
    first = np.zeros(nseq + 1, np.int64)
    for i in range(nseq):
        first[i + 1] = first[i] + _tasks(seqs[i, 1], q.shape[1])
    for task in nb.prange(first[nseq]):
        i = np.searchsorted(first, task, side="right") - 1
        lo, n = seqs[i, 0], seqs[i, 1]
        _latent_task(q[lo:lo + n], pool, pool_scale, table, tables[i], seqs[i, 2], rank, scale, task - first[i],
                     out[lo:lo + n])
