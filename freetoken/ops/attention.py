"""Causal grouped-query attention against a KV cache (``cuda/attention.cu``, ``cpu_kernels/attention.py``).

:func:`attention` is the op the model calls (decode kernel or array code, by device and batch);
:func:`attention_decode` the decode kernel itself.

Built for decode (a few new queries, a long context): on CUDA devices the context of each query is cut into
splits that run as separate blocks when (queries x kv heads) alone would leave the GPU idle; a second kernel
merges the splits (flash-decoding). The split count depends only on the shapes and the device, so a result is
deterministic for a given device.
"""

from __future__ import annotations

import math
import operator
from functools import lru_cache

import numpy as np

from freetoken.device.constants import ATT_TILE, ATT_WARPS, DECODE_MAX_TOKENS
from freetoken.ops._common import as_input, check_int32, cuda_kernel, prepare_out, resolve

_TILE = ATT_TILE  # keys per warp tile (FT_ATT_TILE in attention.cu)
_WARPS = ATT_WARPS  # warps per block (FT_ATT_WARPS in attention.cu)
_MIN_CHUNK = _WARPS * _TILE  # fewest keys worth a split of their own: one tile per warp
_BLOCKS_PER_SM = 4  # blocks the split count aims at per multiprocessor
_NOMINAL_SMS = 8  # the emu device's stand-in for a multiprocessor count (fixed: results must not vary by host)
_MAX_GRID_YZ = 65535
MAX_HEAD_DIM = 256


@lru_cache(maxsize=8)
def _sm_count(index: int) -> int:
    import cupy

    return int(cupy.cuda.runtime.getDeviceProperties(index)["multiProcessorCount"])


def _heads_per_block(group: int) -> int:
    """Query heads of one kv group handled by one block: the smallest of 1, 2, 4, 8 covering the group."""
    for hb in (1, 2, 4):
        if group <= hb:
            return hb
    return 8


def plan_splits(dev, t: int, kv_blocks: int, context: int, splits: int | None = None) -> tuple[int, int]:
    """(nsplit, chunk): keys per split (a multiple of 32) and the number of splits covering ``context`` keys."""
    if splits is None:
        sms = _sm_count(dev.index) if dev.kind == "gpu" else _NOMINAL_SMS
        want = -(-_BLOCKS_PER_SM * sms // (t * kv_blocks))
        splits = max(1, min(want, -(-context // _MIN_CHUNK)))
    per_split = -(-context // splits)
    chunk = _TILE * -(-per_split // _TILE)
    return -(-context // chunk), chunk


def attention_decode(q, k_cache, v_cache, start, out=None, device=None, *, splits: int | None = None):
    """Causal grouped-query attention of T new queries at positions start..start+T-1 against a KV cache.

    Query t attends to cache rows 0..start+t inclusive; query head h uses kv head h // (H // Hkv); scores are
    scaled by 1 / sqrt(D); softmax in fp32 (CUDA) or fp64 (cpu).

    Parameters
    ----------
    q : float32 array [T, H, D], D <= 256
    k_cache, v_cache : float32 arrays [rows, Hkv, D] with rows >= start + T, H divisible by Hkv; rows
        start..start+T-1 already hold the new keys/values; rows past start + T - 1 are not read
    start : int >= 0, the position of the first query
    out : float32 array [T, H * D], optional
    device : Device or name, optional (default: auto)
    splits : int, optional; CUDA devices only: cut each query's context into at most this many splits
        (default: enough to fill the device). Testing and tuning knob; the cpu device ignores it.

    Returns
    -------
    float32 array [T, H * D] on the device.
    """
    dev = resolve(device)
    q = as_input(dev, q, "q", np.float32)
    k = as_input(dev, k_cache, "k_cache", np.float32)
    v = as_input(dev, v_cache, "v_cache", np.float32)
    if q.ndim != 3:
        raise ValueError(f"q must be [T, H, D], got shape {tuple(q.shape)}")
    if k.ndim != 3:
        raise ValueError(f"k_cache must be [rows, Hkv, D], got shape {tuple(k.shape)}")
    if tuple(v.shape) != tuple(k.shape):
        raise ValueError(f"v_cache shape {tuple(v.shape)} differs from k_cache shape {tuple(k.shape)}")
    t, heads, dim = q.shape
    rows, kv_heads, kdim = k.shape
    if kdim != dim:
        raise ValueError(f"head dim of q ({dim}) and of the cache ({kdim}) differ")
    if kv_heads == 0 or heads == 0 or heads % kv_heads:
        raise ValueError(f"query heads ({heads}) must be a positive multiple of kv heads ({kv_heads})")
    if not 1 <= dim <= MAX_HEAD_DIM:
        raise ValueError(f"head dim {dim} unsupported: must be in [1, {MAX_HEAD_DIM}]")
    try:
        start = operator.index(start)
    except TypeError:
        raise TypeError(f"start must be an integer, got {type(start).__name__}") from None
    if start < 0:
        raise ValueError(f"start={start} must be >= 0")
    if rows < start + t:
        raise ValueError(f"cache of {rows} rows is too short for start={start} + T={t} queries")
    if splits is not None and splits < 1:
        raise ValueError(f"splits={splits} must be at least 1")
    out = prepare_out(dev, out, (t, heads * dim), np.float32)
    if t == 0:
        return out
    if dev.kind == "cpu":
        from freetoken.cpu_kernels.attention import attention_decode_f32

        attention_decode_f32(q, k, v, start, out)
        return out

    group = heads // kv_heads
    hb = _heads_per_block(group)
    kv_blocks = kv_heads * -(-group // hb)
    context = start + t  # keys the last query sees
    nsplit, chunk = plan_splits(dev, t, kv_blocks, context, splits)
    if t > _MAX_GRID_YZ or kv_blocks > _MAX_GRID_YZ:
        raise ValueError(f"T={t} queries or {kv_blocks} kv-head blocks exceed the grid limit {_MAX_GRID_YZ}")
    fn = cuda_kernel(dev, "attention.cu", f"attention_decode_f32_c{-(-dim // 32)}_g{hb}")
    qscale = np.float32(math.log2(math.e) / math.sqrt(dim))
    check_int32("start + T", start + t)
    ints = (np.int32(t), check_int32("H", heads), np.int32(kv_heads), np.int32(dim), np.int32(start),
            np.int32(chunk), np.int32(nsplit))
    if nsplit == 1:
        fn((1, kv_blocks, t), (32 * _WARPS,), (q, k, v, out, out, out, *ints, qscale))
        return out
    part_o = dev.empty((nsplit, t, heads, dim), np.float32)
    part_ml = dev.empty((nsplit, t, heads, 2), np.float32)
    fn((nsplit, kv_blocks, t), (32 * _WARPS,), (q, k, v, out, part_o, part_ml, *ints, qscale))
    combine = cuda_kernel(dev, "attention.cu", "attention_combine_f32")
    combine((t * heads,), (32 * -(-dim // 32),), (part_o, part_ml, out, check_int32("rows", t * heads), np.int32(dim),
                                   np.int32(nsplit)))
    return out


#: Query rows per task of the host prefill (:func:`attention_arrays` on NumPy): the [G, rows, context] score block
#: of one kv head stays in L2 for context ~ 512.
_HOST_QUERY_ROWS = 128
#: Score elements (T x context x heads) from which the host path splits its work over threads.
_HOST_PARALLEL_SCORES = 1 << 18


@lru_cache(maxsize=1)
def _host_pool(workers: int):
    from concurrent.futures import ThreadPoolExecutor

    return ThreadPoolExecutor(max_workers=workers, thread_name_prefix="freetoken-attention")


def _host_threads() -> int:
    try:
        import numba

        return numba.get_num_threads()
    except Exception:
        return 1


def attention_arrays(xp, q, k_cache, v_cache, start: int):
    """Causal grouped-query attention on an array module (numpy or cupy), float32: the prefill path of
    :func:`attention` (and the whole op on the cpu device). Same arguments and result as :func:`attention`.

    On NumPy a large product (a prompt) is cut into (kv head, block of query rows) tasks, each the same array
    operations on its slice (scores, in place: scale, mask, max, exp, sum, divide; then the product with V), run on
    the cpu device's threads (Numba's thread count; NumPy releases the GIL in its loops and BLAS calls). Every output
    element is computed by the same operations as on the whole batch: the result does not depend on the split."""
    t, heads, dim = q.shape
    kv_heads = k_cache.shape[1]
    total = start + t
    k = k_cache[:total]
    v = v_cache[:total]
    group = heads // kv_heads
    qg = q.reshape(t, kv_heads, group, dim).transpose(1, 2, 0, 3)  # [Hkv, G, T, D]
    if xp is not np or t * total * heads < _HOST_PARALLEL_SCORES:  # a device, or small: batched over heads
        scores = xp.matmul(qg, k.transpose(1, 2, 0)[:, None])  # [Hkv, G, T, total]
        scores *= np.float32(1.0 / math.sqrt(dim))  # IEEE sqrt, as np.sqrt (a NumPy scalar call costs ~2 us)
        if t > 1:  # query t sees keys 0 .. start + t (one query: all of them)
            mask = np.arange(total)[None, :] > (start + np.arange(t))[:, None]
            scores = xp.where(xp.asarray(mask), np.float32(-np.inf), scores)
        scores -= scores.max(axis=-1, keepdims=True)
        p = xp.exp(scores, out=scores)
        p /= p.sum(axis=-1, keepdims=True)
        out = xp.matmul(p, v.transpose(1, 0, 2)[:, None])  # [Hkv, G, T, D]
        return out.transpose(2, 0, 1, 3).reshape(t, heads * dim)
    # large products on the host: (kv head, query block) tasks on a few threads, the same operations in place
    kt = k.transpose(1, 2, 0)  # [Hkv, D, total]
    vt = v.transpose(1, 0, 2)  # [Hkv, total, D]
    out = np.empty((t, heads * dim), np.float32)
    out4 = out.reshape(t, kv_heads, group, dim)
    scale = np.float32(1.0 / math.sqrt(dim))
    nblk = -(-t // _HOST_QUERY_ROWS) if t >= 2 * _HOST_QUERY_ROWS else 1
    rows = -(-t // nblk)
    tasks = [(h, r0, min(t, r0 + rows)) for h in range(kv_heads) for r0 in range(0, t, rows)]

    def run(part):
        for h, r0, r1 in part:
            s = np.matmul(qg[h, :, r0:r1], kt[h][None])  # [G, rows, total]
            np.multiply(s, scale, out=s)
            mask = np.arange(total)[None, :] > (start + np.arange(r0, r1))[:, None]
            np.copyto(s, np.float32(-np.inf), where=mask)
            s -= s.max(axis=-1, keepdims=True)
            np.exp(s, out=s)
            s /= s.sum(axis=-1, keepdims=True)
            out4[r0:r1, h] = np.matmul(s, vt[h][None]).transpose(1, 0, 2)  # [rows, G, D]

    threads = min(_host_threads(), len(tasks))
    if threads <= 1:
        run(tasks)
    else:
        for f in [_host_pool(threads).submit(run, tasks[i::threads]) for i in range(threads)]:
            f.result()
    return out


def attention(q, k_cache, v_cache, start: int, *, device=None, checked: bool = False):
    """Causal grouped-query attention of T new queries at positions start..start+T-1 against KV caches that already
    hold them.

    Parameters
    ----------
    q : float32 array [T, H, D]
    k_cache, v_cache : float32 arrays [>= start + T, Hkv, D], H divisible by Hkv
    start : int >= 0, the position of the first query
    device : Device or name, optional (default: auto)
    checked : the caller vouches for the arguments (``device`` a Device, the arrays on it as described, q
        C-contiguous): nothing is checked (the attention block, on buffers it made at load time)

    Returns
    -------
    float32 array [T, H * D] on the device.

    Dispatch: the cpu device runs the array code (:func:`attention_arrays`); gpu/emu run the decode kernel
    (:func:`attention_decode`) for T <= :data:`freetoken.device.constants.DECODE_MAX_TOKENS` and the array code
    beyond (prefill; a flash-attention prefill kernel will take it over).
    """
    if checked:
        if device.kind == "cpu" or q.shape[0] > DECODE_MAX_TOKENS:
            return attention_arrays(device.xp, q, k_cache, v_cache, start)
        return attention_decode(q, k_cache, v_cache, start, device=device)
    dev = resolve(device)
    q, k_cache, v_cache = dev.as_array(q), dev.as_array(k_cache), dev.as_array(v_cache)
    if q.ndim != 3 or k_cache.ndim != 3 or v_cache.ndim != 3:
        raise ValueError(f"q [T, H, D] and the caches [rows, Hkv, D] must be 3-D, got {tuple(q.shape)}, "
                         f"{tuple(k_cache.shape)}, {tuple(v_cache.shape)}")
    if dev.kind == "cpu" or q.shape[0] > DECODE_MAX_TOKENS:
        return attention_arrays(dev.xp, q, k_cache, v_cache, start)
    return attention_decode(dev.xp.ascontiguousarray(q), k_cache, v_cache, start, device=dev)
