"""Causal grouped-query attention over the paged KV cache on the CPU (the cpu twin of ``cuda/paged_attention.cu``;
contract: ``freetoken/testing/reference/paged_attention.py``).

One parallel task per (kv head, tile of up to :data:`QUERY_TILE` queries): the task's rows are the (query, head of
the group) pairs, so every K/V block it decodes serves all heads of the group and all queries of the tile (a decode
step has one task per kv head; a prompt many). The task walks the pool blocks its rows can see (below the causal
limit, inside the sliding window), decodes each block's K rows transposed (``[D, keys]``) and V rows into float32
scratch, and keeps an online softmax per row: scores for all keys of the block at once (the key index in the
vector lanes, so each score sums over D in order: the same result whatever the vector width), then the running
max, sum and accumulator rescaled once per block. Float32 throughout, exponentials in float64.

Storage decoding: f32 as is; f16 and bf16 through a 65536-entry float32 table indexed by the stored bits; fp8 through
a 256-entry table times the row's scale (Numba prunes the branches of the kinds a call does not use: ``table`` and
``scale`` are None where not needed).
"""

import math

import numba as nb
import numpy as np

#: Queries per task: 16 queries x 8 heads of a group = 128 rows sharing each decoded K/V block.
QUERY_TILE = 16

_FASTMATH = {"contract"}  # fused multiply-adds; no reassociation: results do not depend on the vector width


@nb.njit(inline="always")
def _decode_block(pool, scales, table, block, kvh, j0, j1, dst, transposed):
    """Rows ``j0 .. j1`` of pool block ``block``, kv head ``kvh``, as float32 into ``dst`` (``[D, BS]`` when
    ``transposed``, else ``[BS, D]``)."""
    dim = pool.shape[3]
    for j in range(j0, j1):
        if table is None:
            for d in range(dim):
                if transposed:
                    dst[d, j] = pool[block, j, kvh, d]
                else:
                    dst[j, d] = pool[block, j, kvh, d]
        elif scales is None:
            for d in range(dim):
                if transposed:
                    dst[d, j] = table[pool[block, j, kvh, d]]
                else:
                    dst[j, d] = table[pool[block, j, kvh, d]]
        else:
            s = scales[block, j, kvh]
            for d in range(dim):
                if transposed:
                    dst[d, j] = table[pool[block, j, kvh, d]] * s
                else:
                    dst[j, d] = table[pool[block, j, kvh, d]] * s


@nb.njit(parallel=True, cache=True, fastmath=_FASTMATH)
def paged_attention_rows(q, k_pool, v_pool, k_scale, v_scale, table, block_table, start, window, sinks, scale, out):
    """q float32 ``[T, H, D]`` at positions ``start ..``; pools ``[NB, BS, Hkv, D]`` (stored dtype), scales float32
    ``[NB, BS, Hkv]`` or None, ``table`` the kind's decode table or None (f32); ``window`` 0 for none; ``sinks``
    float32 ``[H]`` or None; ``scale`` the score factor -> out float32 ``[T, H * D]``."""
    t_count, heads, dim = q.shape
    bs, kv_heads = k_pool.shape[1], k_pool.shape[2]
    group = heads // kv_heads
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
        m = np.full(rows, -np.inf)
        lsum = np.zeros(rows)
        acc = np.zeros((rows, dim), np.float32)
        kt = np.empty((dim, bs), np.float32)
        vb = np.empty((bs, dim), np.float32)
        s = np.empty(bs, np.float32)
        hi = start + t1  # keys [lo, hi) serve some row of the tile
        lo = 0 if window == 0 else max(0, start + t0 - window + 1)
        for blk in range(lo // bs, (hi - 1) // bs + 1):
            base = blk * bs
            block = block_table[blk]
            j0 = max(lo - base, 0)
            j1 = min(hi - base, bs)
            _decode_block(k_pool, k_scale, table, block, kvh, j0, j1, kt, True)
            _decode_block(v_pool, v_scale, table, block, kvh, j0, j1, vb, False)
            for r in range(rows):
                pos = start + t0 + r // group
                jhi = min(j1, pos - base + 1)  # keys up to the query's own position
                jlo = j0 if window == 0 else max(j0, pos - window + 1 - base)
                if jhi <= jlo:
                    continue
                for j in range(jlo, jhi):
                    s[j] = 0.0
                for d in range(dim):
                    qd = qs[r, d]
                    for j in range(jlo, jhi):
                        s[j] += qd * kt[d, j]
                mx = m[r]
                for j in range(jlo, jhi):
                    mx = max(mx, np.float64(s[j]))
                corr = math.exp(m[r] - mx)  # 0 on the row's first block (m = -inf)
                total = 0.0
                for j in range(jlo, jhi):
                    p = math.exp(s[j] - mx)
                    s[j] = p
                    total += p
                lsum[r] = lsum[r] * corr + total
                m[r] = mx
                c = np.float32(corr)
                for d in range(dim):
                    acc[r, d] *= c
                for j in range(jlo, jhi):
                    p = s[j]
                    for d in range(dim):
                        acc[r, d] += p * vb[j, d]
        for r in range(rows):
            t = t0 + r // group
            h = kvh * group + r % group
            den = lsum[r]
            if sinks is not None:
                den += math.exp(np.float64(sinks[h]) - m[r])
            inv = np.float32(1.0 / den)
            for d in range(dim):
                out[t, h * dim + d] = acc[r, d] * inv
