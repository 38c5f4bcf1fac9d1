"""Launchers of ``cuda/latent_attention.cu`` (gpu and emu) for :mod:`freetoken.ops.latent_attention`, which checks
the arguments first.

The append runs the paged cache's own ``kv_store_<kind>`` kernels (``cuda/paged_attention.cu``) with one kv head
and the grid's "values" half left out. The attention kernel takes blocks of :data:`LATENT_ROWS` (query, head) rows
against tiles of :data:`LATENT_KEYS` cached rows (bf16 tensor-core products, fp32 softmax and sums); when the row
blocks alone would leave the GPU idle (decode: T x H / 32 blocks) the context is cut into splits
(:func:`freetoken.ops.paged_attention_cuda.plan_splits`) merged by ``paged_combine``: flash-decoding. The split
count depends only on the shapes and the device, so a result is deterministic for a given device.
"""

from __future__ import annotations

import math
import os

import numpy as np

from freetoken.device.constants import KV_KIND_CODES, LATENT_KEYS, LATENT_MAX_DIM, LATENT_ROWS
from freetoken.ops._common import check_int32, cuda_kernel
from freetoken.ops.paged_attention import kv_kind_of
from freetoken.ops.paged_attention_cuda import plan_splits

_SOURCE = "latent_attention.cu"
_PAGED = "paged_attention.cu"  # kv_store_<kind> and paged_combine
_MAX_GRID_YZ = 65535
#: Row widths (R + P) the kernel is built for: a row up to C of them runs the build of the smallest C >= it.
LATENT_DIMS = (64, 128, 256, 576, LATENT_MAX_DIM)
#: Threads per block: 2 groups of 16 rows x 4 quarters of the row (cuda/latent_attention.cu).
THREADS = 256


def smem_bytes(cmax: int) -> int:
    """Dynamic shared memory of the build for rows up to ``cmax`` values (the carve-up of latent_block in
    cuda/latent_attention.cu): the bf16 key tile, the four partial score tiles, the bf16 probabilities and three
    per-row floats."""
    return (LATENT_KEYS * (cmax + 8) * 2 + 4 * LATENT_ROWS * (LATENT_KEYS + 1) * 4 + LATENT_ROWS * (LATENT_KEYS + 8) * 2
            + 3 * LATENT_ROWS * 4)


def _scale_arg(pool, pool_scale):
    """The scale pointer (fp8; else the pool stands in: the kernels never read it)."""
    kind = kv_kind_of(pool)
    return kind, (pool_scale if kind == "fp8" else pool)


def latent_store_cuda(dev, kv, pool, pool_scale, block_table, start: int) -> None:
    t, width = kv.shape
    kind, sc = _scale_arg(pool, pool_scale)
    fn = cuda_kernel(dev, _PAGED, f"kv_store_{kind}")
    # grid (T, Hkv = 1, 1): blockIdx.z = 0 writes the "keys" only; the "values" arguments are never touched
    fn((check_int32("T", t), 1, 1), (32,),
       (kv, kv, pool, pool, sc, sc, block_table, np.int32(1), np.int32(width), np.int32(pool.shape[1]),
        check_int32("start", start)))


def _launch(dev, q, pool, pool_scale, descriptors, blocks: int, rows: int, rank: int, start: int, keys: int,
            scale: float, out, splits: int | None) -> None:
    """One ``latent_attention_c*`` launch over ``blocks`` row blocks (``descriptors``: table, seqs, tiles and the
    batch width, 0 for one sequence) with the context split as :func:`plan_splits` says, merged by
    ``paged_combine``."""
    t, heads, row_width = q.shape
    kind, sc = _scale_arg(pool, pool_scale)
    nsplit, chunk = plan_splits(dev, 1, blocks, keys, splits)
    if nsplit > _MAX_GRID_YZ:
        raise ValueError(f"{nsplit} context splits exceed the grid limit {_MAX_GRID_YZ}")
    cmax = next(c for c in LATENT_DIMS if c >= row_width)
    # FREETOKEN_NO_MMA=1: the portable mma twin instead of tensor cores (as for paged_attention's prefill)
    opts = ("-DFT_NO_MMA",) if os.environ.get("FREETOKEN_NO_MMA") == "1" else ()
    fn = cuda_kernel(dev, _SOURCE, f"latent_attention_c{cmax}", opts)
    qscale = np.float32(scale * math.log2(math.e))
    table, seqs, tiles, batch_width = descriptors
    ints = (np.int32(KV_KIND_CODES[kind]), np.int32(t), np.int32(heads), np.int32(rank), np.int32(row_width),
            np.int32(pool.shape[1]), np.int32(batch_width), np.int32(start), np.int32(chunk), np.int32(nsplit))
    if nsplit == 1:
        fn((blocks, 1), (THREADS,), (q, pool, sc, table, seqs, tiles, out, out, out, *ints, qscale),
           shared_mem=smem_bytes(cmax))
        return
    part_o = dev.empty((nsplit, rows, rank), np.float32)
    part_ml = dev.empty((nsplit, rows, 2), np.float32)
    fn((blocks, nsplit), (THREADS,), (q, pool, sc, table, seqs, tiles, out, part_o, part_ml, *ints, qscale),
       shared_mem=smem_bytes(cmax))
    combine = cuda_kernel(dev, _PAGED, "paged_combine")
    combine((rows,), (32 * -(-rank // 32),),
            (part_o, part_ml, out, out, np.int32(rows), np.int32(heads), np.int32(rank), np.int32(nsplit),
             np.int32(0)))


def latent_attention_cuda(dev, q, pool, pool_scale, block_table, start: int, rank: int, scale: float, out, *,
                          splits: int | None = None) -> None:
    """Attention into ``out`` [T, H * R]; ``splits`` caps the context splits (a testing knob)."""
    t, heads, _ = q.shape
    rows = int(check_int32("T * H", t * heads))
    keys = int(check_int32("start + T", start + t))
    # width 0: one sequence (the batch descriptors never read)
    _launch(dev, q, pool, pool_scale, (block_table, block_table, block_table, 0), -(-rows // LATENT_ROWS), rows,
            rank, start, keys, scale, out, splits)


# ---- a batch of sequences (freetoken.ops.paged_batch) -------------------------------------------------------------
def latent_store_batch_cuda(dev, kv, pool, pool_scale, batch) -> None:
    t, width = kv.shape
    kind, sc = _scale_arg(pool, pool_scale)
    rows = batch.device_array("rows", lambda: batch.row_table(range(batch.size)))
    fn = cuda_kernel(dev, _PAGED, f"kv_store_varlen_{kind}")
    fn((check_int32("T", t), 1, 1), (32,),  # blockIdx.z = 0: the "keys" only (as latent_store_cuda)
       (kv, kv, pool, pool, sc, sc, batch.tables, rows, np.int32(1), np.int32(width), np.int32(pool.shape[1]),
        np.int32(batch.tables.shape[1])))


def latent_attention_batch_cuda(dev, q, pool, pool_scale, batch, rank: int, scale: float, out, *,
                                splits: int | None = None) -> None:
    """Attention of every sequence of ``batch`` into ``out`` [T, H * R], one launch over a list of (sequence, block
    of 32 rows) and, with context splits, one ``paged_combine``; ``splits`` caps the splits (a testing knob)."""
    t, heads, _ = q.shape
    rows = int(check_int32("T * H", t * heads))
    keys = max(batch.ends)
    per_seq = [-(-n * heads // LATENT_ROWS) for n in batch.counts]
    tiles = batch.device_array(("latent_tiles", heads), lambda: np.asarray(
        [(s, i) for s, n in enumerate(per_seq) for i in range(n)], np.int32).reshape(-1, 2))
    seqs = batch.device_array("seqs", lambda: np.stack([batch.bounds[:-1], batch.counts, batch.starts], 1))
    _launch(dev, q, pool, pool_scale, (batch.tables, seqs, tiles, batch.tables.shape[1]), sum(per_seq), rows, rank,
            0, keys, scale, out, splits)
