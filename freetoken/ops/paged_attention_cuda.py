"""Launchers of ``cuda/paged_attention.cu`` (gpu and emu) for :mod:`freetoken.ops.paged_attention`, which checks the
arguments first: the append, the decode kernel (up to ``DECODE_MAX_TOKENS`` queries, fp32 on the widened values,
the context cut into splits when the queries and kv heads alone would leave the GPU idle, merged by a second kernel:
flash-decoding) and the flash-attention prefill kernel (bf16 tensor-core products, fp32 softmax and sums).

The split count depends only on the shapes and the device (a fixed stand-in multiprocessor count on emu), so a
result is deterministic for a given device.
"""

from __future__ import annotations

import math
import os
from functools import lru_cache

import numpy as np

from freetoken.device.constants import ATT_TILE, ATT_WARPS, DECODE_MAX_TOKENS, KV_KIND_CODES
from freetoken.ops._common import check_int32, cuda_kernel
from freetoken.ops.paged_attention import kv_kind_of

_SOURCE = "paged_attention.cu"
_MIN_CHUNK = ATT_WARPS * ATT_TILE  # fewest keys worth a split of their own: one tile per warp
_BLOCKS_PER_SM = 4  # blocks the split count aims at per multiprocessor
_NOMINAL_SMS = 8  # the emu device's stand-in for a multiprocessor count (fixed: results must not vary by host)
_MAX_GRID_YZ = 65535
#: Head dims the decode kernels are built for (32 lanes a chunk: D up to 32 NC) and the prefill kernels (DP).
DECODE_CHUNKS = (1, 2, 4, 8)
PREFILL_DIMS = (48, 64, 96, 128, 192, 256)
#: (query, head) rows of one prefill block: a kv group of more query heads does not fit one block.
PREFILL_ROWS = 64
MAX_GROUP = PREFILL_ROWS


@lru_cache(maxsize=8)
def _sm_count(index: int) -> int:
    import cupy

    return int(cupy.cuda.runtime.getDeviceProperties(index)["multiProcessorCount"])


def heads_per_block(group: int) -> int:
    """Query heads of one kv group handled by one decode block: the smallest of 1, 2, 4, 8 covering the group."""
    for hb in (1, 2, 4):
        if group <= hb:
            return hb
    return 8


def plan_splits(dev, t: int, kv_blocks: int, keys: int, splits: int | None = None) -> tuple[int, int]:
    """(nsplit, chunk): keys per split (a multiple of the warp tile) and the number of splits covering ``keys``."""
    if splits is None:
        sms = _sm_count(dev.index) if dev.kind == "gpu" else _NOMINAL_SMS
        want = -(-_BLOCKS_PER_SM * sms // (t * kv_blocks))
        splits = max(1, min(want, -(-keys // _MIN_CHUNK)))
    per_split = -(-keys // splits)
    chunk = ATT_TILE * -(-per_split // ATT_TILE)
    return -(-keys // chunk), chunk


def _pool_args(k_pool, v_pool, k_scale, v_scale):
    """The pools' kind and the scale pointers (fp8; else the pools stand in: the kernels never read them)."""
    kind = kv_kind_of(k_pool)
    if kind != "fp8":
        k_scale, v_scale = k_pool, v_pool
    return kind, k_scale, v_scale


def kv_store_cuda(dev, k, v, k_pool, v_pool, k_scale, v_scale, block_table, start: int) -> None:
    t, kv_heads, dim = k.shape
    kind, k_scale, v_scale = _pool_args(k_pool, v_pool, k_scale, v_scale)
    if kv_heads > _MAX_GRID_YZ:
        raise ValueError(f"{kv_heads} kv heads exceed the grid limit {_MAX_GRID_YZ}")
    fn = cuda_kernel(dev, _SOURCE, f"kv_store_{kind}")
    fn((check_int32("T", t), kv_heads, 2), (32,),
       (k, v, k_pool, v_pool, k_scale, v_scale, block_table, np.int32(kv_heads), np.int32(dim),
        np.int32(k_pool.shape[1]), check_int32("start", start)))


def paged_attention_cuda(dev, q, k_pool, v_pool, k_scale, v_scale, block_table, start: int, window: int, sinks,
                         scale: float, out, *, splits: int | None = None) -> None:
    """Attention into ``out`` [T, H * D]; ``splits`` (decode only) caps the context splits (a testing knob)."""
    t, heads, dim = q.shape
    _, block_size, kv_heads, _ = k_pool.shape
    kind, k_scale, v_scale = _pool_args(k_pool, v_pool, k_scale, v_scale)
    group = heads // kv_heads
    check_int32("start + T", start + t)
    qscale = np.float32(scale * math.log2(math.e))
    has_sinks = np.int32(sinks is not None)
    sinks = q if sinks is None else sinks  # never read without has_sinks
    code = np.int32(KV_KIND_CODES[kind])
    if t > DECODE_MAX_TOKENS:
        if group > MAX_GROUP:
            raise ValueError(f"{group} query heads per kv head exceed the prefill kernel's {MAX_GROUP}")
        dp = next(d for d in PREFILL_DIMS if d >= dim)
        per_block = PREFILL_ROWS // group
        # FREETOKEN_NO_MMA=1: the prefill kernels' portable mma twin instead of tensor cores (as for moe_experts: to
        # tell a tensor-core fault on a GPU from the rest of the kernel)
        opts = ("-DFT_NO_MMA",) if os.environ.get("FREETOKEN_NO_MMA") == "1" else ()
        fn = cuda_kernel(dev, _SOURCE, f"paged_prefill_d{dp}", opts)
        fn((-(-t // per_block), kv_heads), (128,),  # width 0: one sequence (the descriptors stand in, never read)
           (q, k_pool, v_pool, k_scale, v_scale, block_table, block_table, block_table, sinks, out, code, np.int32(t),
            np.int32(heads), np.int32(kv_heads), np.int32(dim), np.int32(block_size), np.int32(0), np.int32(start),
            check_int32("window", window), has_sinks, qscale))
        return
    hb = heads_per_block(group)
    kv_blocks = kv_heads * -(-group // hb)
    if kv_blocks > _MAX_GRID_YZ:
        raise ValueError(f"{kv_blocks} kv-head blocks exceed the grid limit {_MAX_GRID_YZ}")
    key0 = max(0, start + 1 - window) if window > 0 else 0  # the first key any query of the call sees
    nsplit, chunk = plan_splits(dev, t, kv_blocks, start + t - key0, splits)
    nc = next(c for c in DECODE_CHUNKS if 32 * c >= dim)
    fn = cuda_kernel(dev, _SOURCE, f"paged_decode_c{nc}_g{hb}")
    ints = (code, np.int32(t), np.int32(heads), np.int32(kv_heads), np.int32(dim), np.int32(block_size), np.int32(0),
            np.int32(start), np.int32(window), np.int32(key0), np.int32(chunk), np.int32(nsplit), has_sinks)
    pools = (q, k_pool, v_pool, k_scale, v_scale, block_table, block_table, sinks, out)  # width 0: rows not read
    if nsplit == 1:
        fn((1, kv_blocks, t), (32 * ATT_WARPS,), (*pools, out, out, *ints, qscale))
        return
    part_o = dev.empty((nsplit, t, heads, dim), np.float32)
    part_ml = dev.empty((nsplit, t, heads, 2), np.float32)
    fn((nsplit, kv_blocks, t), (32 * ATT_WARPS,), (*pools, part_o, part_ml, *ints, qscale))
    combine = cuda_kernel(dev, _SOURCE, "paged_combine")
    combine((t * heads,), (32 * -(-dim // 32),),
            (part_o, part_ml, sinks, out, check_int32("rows", t * heads), np.int32(heads), np.int32(dim),
             np.int32(nsplit), has_sinks))


# ---- a batch of sequences (freetoken.ops.paged_batch) -------------------------------------------------------------
def kv_store_batch_cuda(dev, k, v, k_pool, v_pool, k_scale, v_scale, batch) -> None:
    t, kv_heads, dim = k.shape
    kind, k_scale, v_scale = _pool_args(k_pool, v_pool, k_scale, v_scale)
    rows = batch.device_array("rows", lambda: batch.row_table(range(batch.size)))
    fn = cuda_kernel(dev, _SOURCE, f"kv_store_varlen_{kind}")
    fn((check_int32("T", t), kv_heads, 2), (32,),
       (k, v, k_pool, v_pool, k_scale, v_scale, batch.tables, rows, np.int32(kv_heads), np.int32(dim),
        np.int32(k_pool.shape[1]), np.int32(batch.tables.shape[1])))


def _prefill_tiles(batch, seqs: list[int], per_block: int) -> np.ndarray:
    """int32 ``[blocks, 2]``: (sequence, query tile of ``per_block`` queries) of every prefill block."""
    tiles = [(s, i) for s in seqs for i in range(-(-batch.counts[s] // per_block))]
    return np.asarray(tiles, np.int32).reshape(-1, 2)


def paged_attention_batch_cuda(dev, q, k_pool, v_pool, k_scale, v_scale, batch, window: int, sinks, scale: float,
                               out, *, splits: int | None = None) -> None:
    """Attention of every sequence of ``batch`` into ``out`` [T, H * D]: the decode kernel for the sequences of a
    few queries (one launch; ``splits`` caps its context splits, a testing knob), the prefill kernel for the rest
    (one launch)."""
    t, heads, dim = q.shape
    _, block_size, kv_heads, _ = k_pool.shape
    kind, k_scale, v_scale = _pool_args(k_pool, v_pool, k_scale, v_scale)
    group = heads // kv_heads
    width = np.int32(batch.tables.shape[1])
    qscale = np.float32(scale * math.log2(math.e))
    has_sinks = np.int32(sinks is not None)
    sinks = q if sinks is None else sinks  # never read without has_sinks
    code = np.int32(KV_KIND_CODES[kind])
    decoding = batch.decoding()
    prompts = sorted(set(range(batch.size)) - set(decoding))
    if prompts:
        if group > MAX_GROUP:
            raise ValueError(f"{group} query heads per kv head exceed the prefill kernel's {MAX_GROUP}")
        per_block = PREFILL_ROWS // group
        seqs = batch.device_array("seqs", lambda: np.stack([batch.bounds[:-1], batch.counts, batch.starts], 1))
        tiles = batch.device_array(("tiles", per_block), lambda: _prefill_tiles(batch, prompts, per_block))
        dp = next(d for d in PREFILL_DIMS if d >= dim)
        opts = ("-DFT_NO_MMA",) if os.environ.get("FREETOKEN_NO_MMA") == "1" else ()
        fn = cuda_kernel(dev, _SOURCE, f"paged_prefill_d{dp}", opts)
        fn((tiles.shape[0], kv_heads), (128,),
           (q, k_pool, v_pool, k_scale, v_scale, batch.tables, seqs, tiles, sinks, out, code, np.int32(t),
            np.int32(heads), np.int32(kv_heads), np.int32(dim), np.int32(block_size), width, np.int32(0),
            check_int32("window", window), has_sinks, qscale))
    if not decoding:
        return
    rows = batch.device_array("decode_rows", lambda: batch.row_table(decoding))
    n = rows.shape[0]
    hb = heads_per_block(group)
    kv_blocks = kv_heads * -(-group // hb)
    if kv_blocks > _MAX_GRID_YZ:
        raise ValueError(f"{kv_blocks} kv-head blocks exceed the grid limit {_MAX_GRID_YZ}")
    # each query's keys: its own first key (the window) up to its position; the splits cover the longest
    keys = max(batch.ends[s] if window == 0 else min(batch.ends[s], window)
               for s in decoding)
    nsplit, chunk = plan_splits(dev, n, kv_blocks, keys, splits)
    nc = next(c for c in DECODE_CHUNKS if 32 * c >= dim)
    fn = cuda_kernel(dev, _SOURCE, f"paged_decode_c{nc}_g{hb}")
    ints = (code, np.int32(n), np.int32(heads), np.int32(kv_heads), np.int32(dim), np.int32(block_size), width,
            np.int32(0), np.int32(window), np.int32(0), np.int32(chunk), np.int32(nsplit), has_sinks)
    pools = (q, k_pool, v_pool, k_scale, v_scale, batch.tables, rows, sinks, out)
    if nsplit == 1:
        fn((1, kv_blocks, n), (32 * ATT_WARPS,), (*pools, out, out, *ints, qscale))
        return
    part_o = dev.empty((nsplit, n, heads, dim), np.float32)
    part_ml = dev.empty((nsplit, n, heads, 2), np.float32)
    fn((nsplit, kv_blocks, n), (32 * ATT_WARPS,), (*pools, part_o, part_ml, *ints, qscale))
    combine = cuda_kernel(dev, _SOURCE, "paged_combine_varlen")
    combine((n * heads,), (32 * -(-dim // 32),),
            (part_o, part_ml, sinks, out, rows, check_int32("rows", n * heads), np.int32(heads), np.int32(dim),
             np.int32(nsplit), has_sinks))
