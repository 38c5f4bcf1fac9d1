"""The paged KV cache's two ops: :func:`kv_store` appends keys and values, :func:`paged_attention` runs causal
grouped-query attention over them (``cuda/paged_attention.cu`` on gpu/emu through
:mod:`freetoken.ops.paged_attention_cuda`, ``cpu_kernels/paged_attention.py`` on the cpu device).

The layout and the storage kinds are the contract of ``freetoken/testing/reference/paged_attention.py`` (pools
``[num_blocks, block_size, Hkv, D]`` of float32, float16, bf16 bits as uint16 or fp8 e4m3 codes as uint8 with a
float32 scale per (block, row, kv head); an int32 block table per sequence). The model hands each layer its slice
of the pool (:class:`freetoken.models.kv.LayerKV`).
"""

from __future__ import annotations

import operator
from functools import lru_cache

import numpy as np

from freetoken.device.constants import KV_FP8_MAX
from freetoken.ops._common import as_input, cpu_module, prepare_out, resolve

MAX_HEAD_DIM = 256

#: Stored dtype -> KV kind.
_KINDS = {np.dtype(np.float32): "f32", np.dtype(np.float16): "f16", np.dtype(np.uint16): "bf16",
          np.dtype(np.uint8): "fp8"}


def kv_kind_of(pool) -> str:
    """The KV kind a pool array stores, from its dtype."""
    kind = _KINDS.get(pool.dtype)
    if kind is None:
        raise TypeError(f"a KV pool stores float32, float16, bf16 (uint16) or fp8 (uint8), not {pool.dtype}")
    return kind


_NO_TABLE = np.zeros(1, np.float32)  # the cpu kernel's table argument where the kind has none


@lru_cache(maxsize=4)
def decode_table(kind: str) -> np.ndarray | None:
    """float32 value of every stored code of a 16- or 8-bit kind (fp8: before its row scale); None for f32."""
    if kind == "f32":
        return None
    if kind == "f16":
        return np.arange(1 << 16, dtype=np.uint16).view(np.float16).astype(np.float32)
    if kind == "bf16":
        return (np.arange(1 << 16, dtype=np.uint32) << np.uint32(16)).view(np.float32)
    import ml_dtypes

    return np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)


def kv_encode(x: np.ndarray, kind: str) -> tuple[np.ndarray, np.ndarray | None]:
    """float32 ``[..., D]`` -> (stored values in the kind's dtype, float32 row scales for fp8 else None), on the
    host: round to nearest even; fp8 saturates at +-448 after dividing by the row's amax / 448."""
    if kind == "f32":
        return x, None
    if kind == "f16":
        with np.errstate(over="ignore"):
            return x.astype(np.float16), None
    if kind == "bf16":
        bits = np.ascontiguousarray(x, np.float32).view(np.uint32)
        rounded = ((bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16))
        quiet = (bits >> np.uint32(16)) | np.uint32(0x40)  # NaN stays NaN (rounding could carry it to inf)
        return np.where(np.isnan(x), quiet, rounded).astype(np.uint16), None
    import ml_dtypes

    amax = np.abs(x).max(axis=-1)
    scale = np.where(amax > 0, amax / np.float32(KV_FP8_MAX), np.float32(1.0)).astype(np.float32)
    y = np.clip(x / scale[..., None], -KV_FP8_MAX, KV_FP8_MAX)
    return y.astype(ml_dtypes.float8_e4m3fn).view(np.uint8), scale


def _whole(name: str, value, note: str = "") -> int:
    """``value`` as an int >= 0 (TypeError / ValueError naming ``name`` otherwise)."""
    try:
        value = operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an integer, got {type(value).__name__}") from None
    if value < 0:
        raise ValueError(f"{name}={value} must be >= 0{note}")
    return value


def _check(dev, q, k_pool, v_pool, k_scale, v_scale, block_table, start, t_count):
    """Validate the pools, scales, block table and start shared by both ops; returns (pools, scales, table, start)."""
    k_pool, v_pool = dev.as_array(k_pool), dev.as_array(v_pool)
    if k_pool.ndim != 4:
        raise ValueError(f"k_pool must be [num_blocks, block_size, Hkv, D], got shape {tuple(k_pool.shape)}")
    if tuple(v_pool.shape) != tuple(k_pool.shape) or v_pool.dtype != k_pool.dtype:
        raise ValueError(f"v_pool ({v_pool.dtype} {tuple(v_pool.shape)}) differs from k_pool "
                         f"({k_pool.dtype} {tuple(k_pool.shape)})")
    if not (k_pool.flags.c_contiguous and v_pool.flags.c_contiguous):
        raise ValueError("k_pool and v_pool must be C-contiguous (they are written in place)")
    kind = kv_kind_of(k_pool)
    nb_, bs, kv_heads, dim = k_pool.shape
    if not 1 <= dim <= MAX_HEAD_DIM:
        raise ValueError(f"head dim {dim} unsupported: must be in [1, {MAX_HEAD_DIM}]")
    if kind == "fp8":
        for name, sc in (("k_scale", k_scale), ("v_scale", v_scale)):
            if sc is None:
                raise ValueError(f"an fp8 pool needs {name} [num_blocks, block_size, Hkv] float32")
            sc = dev.as_array(sc)
            if tuple(sc.shape) != (nb_, bs, kv_heads) or sc.dtype != np.float32 or not sc.flags.c_contiguous:
                raise ValueError(f"{name} must be C-contiguous float32 {(nb_, bs, kv_heads)}, got {sc.dtype} "
                                 f"{tuple(sc.shape)}")
        k_scale, v_scale = dev.as_array(k_scale), dev.as_array(v_scale)
    elif k_scale is not None or v_scale is not None:
        raise ValueError(f"a {kind} pool has no scales: pass k_scale=None, v_scale=None")
    table = as_input(dev, block_table, "block_table", np.int32, 1)
    start = _whole("start", start)
    need = -(-(start + t_count) // bs)
    if table.shape[0] < need:
        raise ValueError(f"block_table of {table.shape[0]} blocks is too short for positions up to "
                         f"{start + t_count - 1} (block size {bs}: {need} blocks)")
    if need:
        used = np.asarray(dev.to_host(table[:need]))
        if used.min() < 0 or used.max() >= nb_:
            raise ValueError(f"block_table[:{need}] holds blocks outside the pool's 0 .. {nb_ - 1}")
    return k_pool, v_pool, k_scale, v_scale, table, start


def kv_rows(dev, k, v):
    """``k``, ``v`` as float32 ``[T, Hkv, D]`` arrays of one shape on ``dev``."""
    k = as_input(dev, k, "k", np.float32, 3)
    v = as_input(dev, v, "v", np.float32, 3)
    if tuple(v.shape) != tuple(k.shape):
        raise ValueError(f"v shape {tuple(v.shape)} differs from k shape {tuple(k.shape)}")
    return k, v


def check_query(dev, q, k_pool, window, sinks, scale, out):
    """The queries' heads against the pool's, and the attention's ``window``, ``sinks``, ``scale`` and ``out``
    (checked or allocated); returns (window, sinks, out)."""
    heads, dim = q.shape[1], q.shape[2]
    kv_heads = k_pool.shape[2]
    if dim != k_pool.shape[3]:
        raise ValueError(f"head dim of q ({dim}) and of the pool ({k_pool.shape[3]}) differ")
    if heads == 0 or heads % kv_heads:
        raise ValueError(f"query heads ({heads}) must be a positive multiple of kv heads ({kv_heads})")
    window = _whole("window", window, " (0: no window)")
    if sinks is not None:
        sinks = as_input(dev, sinks, "sinks", np.float32, 1)
        if sinks.shape[0] != heads:
            raise ValueError(f"sinks must have one logit per query head ({heads}), got {sinks.shape[0]}")
    if scale is not None and not np.isfinite(scale):
        raise ValueError(f"scale={scale} must be finite")
    return window, sinks, prepare_out(dev, out, (q.shape[0], heads * dim), np.float32)


def kv_store(k, v, k_pool, v_pool, k_scale, v_scale, block_table, start, *, device=None, checked: bool = False):
    """Append keys and values at positions ``start .. start + T - 1`` of a sequence's paged cache (in place).

    Parameters
    ----------
    k, v : float32 arrays [T, Hkv, D]
    k_pool, v_pool : [num_blocks, block_size, Hkv, D] arrays of the KV kind's dtype (float32, float16, uint16 =
        bf16 bits, uint8 = fp8 e4m3 codes), written in place
    k_scale, v_scale : float32 [num_blocks, block_size, Hkv] (fp8: written with the rows), else None
    block_table : int32 [n]: position p lives in block ``block_table[p // block_size]``, row ``p % block_size``
    start : int >= 0
    device : Device or name, optional
    checked : the caller vouches for the arguments (the attention block, on its own buffers)
    """
    dev = resolve(device) if not checked else device
    if not checked:
        k, v = kv_rows(dev, k, v)
        k_pool, v_pool, k_scale, v_scale, block_table, start = _check(
            dev, None, k_pool, v_pool, k_scale, v_scale, block_table, start, k.shape[0])
        if tuple(k.shape[1:]) != tuple(k_pool.shape[2:]):
            raise ValueError(f"k rows [Hkv, D] = {tuple(k.shape[1:])} differ from the pool's "
                             f"{tuple(k_pool.shape[2:])}")
    t = k.shape[0]
    if t == 0:
        return None
    if dev.kind != "cpu":
        from freetoken.ops.paged_attention_cuda import kv_store_cuda

        kv_store_cuda(dev, k, v, k_pool, v_pool, k_scale, v_scale, block_table, start)
        return None
    kind = kv_kind_of(k_pool)
    if kind in ("f32", "bf16"):
        kv_store_rows = cpu_module("kv_store").kv_store_rows

        kv_store_rows(k, v, k_pool, v_pool, block_table, start)
        return None
    bs = k_pool.shape[1]
    pos = start + np.arange(t)
    blocks, rows = block_table[pos // bs], pos % bs
    for pool, scales, x in ((k_pool, k_scale, k), (v_pool, v_scale, v)):
        stored, sc = kv_encode(x, kind)
        pool[blocks, rows] = stored
        if sc is not None:
            scales[blocks, rows] = sc
    return None


def paged_attention(q, k_pool, v_pool, k_scale, v_scale, block_table, start, *, window: int = 0, sinks=None,
                    scale: float | None = None, out=None, device=None, checked: bool = False):
    """Causal grouped-query attention of T queries at positions ``start .. start + T - 1`` over a sequence's paged
    KV cache, which already holds their keys and values (:func:`kv_store`).

    Query t sees the positions p <= start + t, and with ``window`` W > 0 only those with start + t - p < W; query
    head h reads kv head h // (H / Hkv); scores are ``scale * q.k`` (default 1 / sqrt(D)); ``sinks`` (float32 [H],
    gpt-oss) add exp(sinks[h]) to each softmax denominator.

    Parameters
    ----------
    q : float32 array [T, H, D], H a multiple of the pool's Hkv, D <= 256
    k_pool, v_pool, k_scale, v_scale, block_table, start : as for :func:`kv_store`
    window : int >= 0 (0: the whole context)
    sinks : float32 array [H] or None
    scale : float or None
    out : float32 array [T, H * D], optional
    device : Device or name, optional
    checked : the caller vouches for the arguments

    Returns
    -------
    float32 array [T, H * D] on the device.
    """
    if checked:
        dev = device
    else:
        dev = resolve(device)
        q = as_input(dev, q, "q", np.float32, 3)
        k_pool, v_pool, k_scale, v_scale, block_table, start = _check(
            dev, q, k_pool, v_pool, k_scale, v_scale, block_table, start, q.shape[0])
        window, sinks, out = check_query(dev, q, k_pool, window, sinks, scale, out)
    t_count, heads, dim = q.shape
    if out is None:
        out = dev.empty((t_count, heads * dim), np.float32)
    if t_count == 0:
        return out
    sc = float(1.0 / np.sqrt(dim)) if scale is None else float(scale)
    if dev.kind != "cpu":
        from freetoken.ops.paged_attention_cuda import paged_attention_cuda

        paged_attention_cuda(dev, q, k_pool, v_pool, k_scale, v_scale, block_table, start, window, sinks, sc, out)
        return out
    paged_decode = cpu_module("paged_decode")
    kind = kv_kind_of(k_pool)
    if kind == "f16":  # the kernels widen IEEE half bits from int16 (Numba has no float16 arithmetic)
        k_pool, v_pool = k_pool.view(np.int16), v_pool.view(np.int16)
    if paged_decode.handles(kind, dim, t_count * heads // k_pool.shape[2]):  # a decode step: rows read in place
        nsplit = paged_decode.splits_for(t_count, k_pool.shape[1], start, window)
        keys = start + t_count if window == 0 else min(start + t_count, window + t_count - 1)
        paged_decode.decode_kernel(keys, heads, dim)(q, k_pool, v_pool, block_table, start, window, sinks,
                                                     np.float32(sc), nsplit, out)
        return out
    table = decode_table("fp8") if kind == "fp8" else _NO_TABLE
    cpu_module("paged_attention").paged_attention_rows(q, k_pool, v_pool, k_scale, v_scale, table, block_table,
                                                       start, window, sinks, np.float32(sc), out)
    return out
