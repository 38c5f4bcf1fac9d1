"""The paged KV cache's ops over a batch of sequences in one call (continuous batching): :func:`kv_store_batch`
appends each sequence's keys and values, :func:`paged_attention_batch` runs each sequence's causal grouped-query
attention, :func:`latent_store_batch` and :func:`latent_attention_batch` the same for multi-head latent attention
(DeepSeek-V3's latent rows), for a forward pass whose rows belong to several sequences of different lengths and
block tables (varlen).

The rows of sequence ``s`` are ``bounds[s] .. bounds[s + 1] - 1`` of ``q`` / ``k`` / ``v``, at its positions
``starts[s] ..``, its block table row ``s`` of ``tables``; one :class:`PagedBatch` describes that layout for every
layer of a pass (it uploads its descriptors once). Each sequence's result is what :func:`~freetoken.ops.paged_attention
.paged_attention` gives it alone (the contract: ``freetoken/testing/reference/paged_attention.py``); sequences may
share pool blocks (a common prefix), never a row they write.

gpu/emu: one launch for all the sequences of a few queries (``paged_decode_*`` given a (query row, sequence,
position) descriptor per query, flash-decoding splits merged by ``paged_combine_varlen``) and one for the prompt
chunks (``paged_prefill_*`` given a list of (sequence, query tile) blocks): the single-sequence kernels themselves,
in their batch mode (``width`` > 0), so each build serves both; the append is one ``kv_store_varlen_*`` launch.
cpu: the decode steps of all the sequences in one Numba call (``cpu_kernels/paged_decode.py``'s
``paged_decode_batch``), each prompt chunk (already a parallel kernel of its own) by the single-sequence kernel.
"""

from __future__ import annotations

import numpy as np

from freetoken.device.constants import DECODE_MAX_TOKENS, LATENT_MAX_DIM
from freetoken.ops._common import as_input, check_int32, cpu_module, resolve
from freetoken.ops.latent_attention import _check as _check_latent
from freetoken.ops.latent_attention import check_latent_query
from freetoken.ops.paged_attention import (
    _NO_TABLE,
    _check,
    _whole,
    check_query,
    decode_table,
    kv_encode,
    kv_kind_of,
    kv_rows,
    kv_store,
    paged_attention,
)


class PagedBatch:
    """The layout of one pass's rows over several sequences: ``tables`` int32 ``[S, W]`` (row ``s``: sequence
    ``s``'s block table, at least as many entries as its positions need), ``starts`` (each sequence's first new
    position) and ``counts`` (its rows, > 0), on ``device``. Device descriptors are made on first use and kept, so
    every layer of the pass shares them."""

    def __init__(self, tables, starts, counts, *, device=None):
        dev = resolve(device)
        self.dev = dev
        self.tables = as_input(dev, tables, "tables", np.int32, 2)
        self.starts = tuple(_whole(f"starts[{i}]", s) for i, s in enumerate(starts))
        self.counts = tuple(_whole(f"counts[{i}]", c) for i, c in enumerate(counts))
        if len(self.starts) != len(self.counts) or len(self.counts) != self.tables.shape[0]:
            raise ValueError(f"{self.tables.shape[0]} block tables, {len(self.starts)} starts and "
                             f"{len(self.counts)} counts: one of each per sequence")
        if not self.counts or min(self.counts) == 0:
            raise ValueError("a batch needs at least one sequence, each with at least one row")
        self.bounds = tuple(int(b) for b in np.concatenate([[0], np.cumsum(self.counts)]))
        self.rows = self.bounds[-1]
        #: Each sequence's length after the pass (the kernels' int32 positions: checked to fit once, here).
        self.ends = tuple(int(check_int32(f"starts[{i}] + counts[{i}]", s + n))
                          for i, (s, n) in enumerate(zip(self.starts, self.counts, strict=True)))
        self._dev_arrays: dict = {}
        self._host: dict = {}  # the cpu kernels' descriptors, made on first use (every layer of a pass shares them)

    @property
    def size(self) -> int:
        return len(self.counts)

    def decoding(self) -> list[int]:
        """The sequences whose rows the decode kernels take (a few queries each)."""
        return [s for s, n in enumerate(self.counts) if n <= DECODE_MAX_TOKENS]

    def row_table(self, seqs) -> np.ndarray:
        """int32 ``[rows, 3]``: (row of q, sequence, position) of every row of the sequences ``seqs``, in order."""
        parts = [np.stack([np.arange(self.bounds[s], self.bounds[s + 1]), np.full(self.counts[s], s),
                           self.starts[s] + np.arange(self.counts[s])], axis=1) for s in seqs]
        return np.concatenate(parts).astype(np.int32) if parts else np.zeros((0, 3), np.int32)

    def host_value(self, key, make):
        """A host descriptor made by ``make()`` on first use under ``key`` and kept."""
        value = self._host.get(key)
        if value is None:
            value = self._host[key] = make()
        return value

    def device_array(self, key, make):
        """A descriptor on the device, made by ``make()`` (host int32) on first use under ``key``."""
        arr = self._dev_arrays.get(key)
        if arr is None:
            arr = self._dev_arrays[key] = self.dev.asarray(np.ascontiguousarray(make(), np.int32))
        return arr


def _check_rows(dev, batch, t_count: int) -> None:
    """``batch`` a PagedBatch of ``dev`` with ``t_count`` rows."""
    if not isinstance(batch, PagedBatch):
        raise TypeError(f"batch must be a PagedBatch, got {type(batch).__name__}")
    if batch.dev is not dev:
        raise ValueError(f"the batch was made for the {batch.dev.kind} device, not {dev.kind}")
    if t_count != batch.rows:
        raise ValueError(f"{t_count} rows given for a batch of {batch.rows} ({batch.counts} per sequence)")


def _check_batch(dev, batch: PagedBatch, k_pool, v_pool, k_scale, v_scale, t_count: int):
    """The pools and scales checked as the single-sequence ops check them, every sequence's block table against
    its positions; the rows against the batch."""
    _check_rows(dev, batch, t_count)
    for s in range(batch.size):
        k_pool, v_pool, k_scale, v_scale, _, _ = _check(dev, None, k_pool, v_pool, k_scale, v_scale,
                                                        batch.tables[s], batch.starts[s], batch.counts[s])
    return k_pool, v_pool, k_scale, v_scale


def kv_store_batch(k, v, k_pool, v_pool, k_scale, v_scale, batch: PagedBatch, *, device=None, checked: bool = False):
    """Append each sequence's rows of ``k``, ``v`` (float32 ``[T, Hkv, D]``, T = ``batch.rows``) at its positions
    (in place): :func:`~freetoken.ops.paged_attention.kv_store` for every sequence of ``batch`` at once."""
    dev = resolve(device) if not checked else device
    if not checked:
        k, v = kv_rows(dev, k, v)
        k_pool, v_pool, k_scale, v_scale = _check_batch(dev, batch, k_pool, v_pool, k_scale, v_scale, k.shape[0])
        if tuple(k.shape[1:]) != tuple(k_pool.shape[2:]):
            raise ValueError(f"k rows [Hkv, D] = {tuple(k.shape[1:])} differ from the pool's "
                             f"{tuple(k_pool.shape[2:])}")
    if dev.kind != "cpu":
        from freetoken.ops.paged_attention_cuda import kv_store_batch_cuda

        kv_store_batch_cuda(dev, k, v, k_pool, v_pool, k_scale, v_scale, batch)
        return None
    if kv_kind_of(k_pool) in ("f32", "bf16"):
        rows = batch.host_value("rows", lambda: batch.row_table(range(batch.size)))
        cpu_module("kv_store").kv_store_rows_batch(k, v, k_pool, v_pool, batch.tables, rows)
        return None
    for s in range(batch.size):  # f16 / fp8: the NumPy encoder, a sequence at a time
        lo, hi = batch.bounds[s], batch.bounds[s + 1]
        kv_store(k[lo:hi], v[lo:hi], k_pool, v_pool, k_scale, v_scale, batch.tables[s], batch.starts[s], device=dev,
                 checked=True)
    return None


def _cpu_plan(batch: PagedBatch, kind: str, heads: int, dim: int, pool_shape, window: int):
    """(kernel, fused, tables, seqs, splits, rest) of the cpu path: the sequences whose steps the decode kernel takes
    (``fused``: their block tables, (first row, rows, start) and key runs, and the kernel build for their size), and
    the ``rest`` run a sequence at a time."""
    paged_decode = cpu_module("paged_decode")
    block_size, kv_heads = pool_shape
    group = heads // kv_heads
    fused = [s for s in range(batch.size) if paged_decode.handles(kind, dim, batch.counts[s] * group)]
    rest = sorted(set(range(batch.size)) - set(fused))
    seqs = np.array([(batch.bounds[s], batch.counts[s], batch.starts[s]) for s in fused], np.int64).reshape(-1, 3)
    splits = np.array([paged_decode.splits_for(int(n), block_size, int(st), window) for _, n, st in seqs], np.int64)
    macs = sum(int(st + n) * heads * dim for _, n, st in seqs)
    tables = batch.tables if len(fused) == batch.size else batch.tables[np.asarray(fused, np.int64)]
    return paged_decode.decode_batch_kernel(macs), fused, tables, seqs, splits, rest


def paged_attention_batch(q, k_pool, v_pool, k_scale, v_scale, batch: PagedBatch, *, window: int = 0, sinks=None,
                          scale: float | None = None, out=None, device=None, checked: bool = False):
    """Each sequence's rows of ``q`` (float32 ``[T, H, D]``, T = ``batch.rows``) attend over its paged cache, which
    already holds their keys and values (:func:`kv_store_batch`): :func:`~freetoken.ops.paged_attention.
    paged_attention` for every sequence of ``batch`` at once (same ``window``, ``sinks``, ``scale`` for all).
    Returns float32 ``[T, H * D]`` on the device (``out`` when given)."""
    if checked:
        dev = device
    else:
        dev = resolve(device)
        q = as_input(dev, q, "q", np.float32, 3)
        k_pool, v_pool, k_scale, v_scale = _check_batch(dev, batch, k_pool, v_pool, k_scale, v_scale, q.shape[0])
        window, sinks, out = check_query(dev, q, k_pool, window, sinks, scale, out)
    t_count, heads, dim = q.shape
    if out is None:
        out = dev.empty((t_count, heads * dim), np.float32)
    sc = float(1.0 / np.sqrt(dim)) if scale is None else float(scale)
    if dev.kind != "cpu":
        from freetoken.ops.paged_attention_cuda import paged_attention_batch_cuda

        paged_attention_batch_cuda(dev, q, k_pool, v_pool, k_scale, v_scale, batch, window, sinks, sc, out)
        return out
    kind = kv_kind_of(k_pool)
    kernel, fused, tables, seqs, splits, rest = batch.host_value(
        ("decode", kind, heads, dim, k_pool.shape[1:3], window), lambda: _cpu_plan(batch, kind, heads, dim,
                                                                                    k_pool.shape[1:3], window))
    if fused:  # every decode step in one call
        pools = (k_pool.view(np.int16), v_pool.view(np.int16)) if kind == "f16" else (k_pool, v_pool)
        kernel(q, *pools, tables, seqs, window, sinks, np.float32(sc), splits, out)
    for s in rest:  # prompt chunks (and fp8 steps): a sequence at a time
        lo, hi = batch.bounds[s], batch.bounds[s + 1]
        paged_attention(q[lo:hi], k_pool, v_pool, k_scale, v_scale, batch.tables[s], batch.starts[s], window=window,
                        sinks=sinks, scale=sc, out=out[lo:hi], device=dev, checked=True)
    return out


def _check_latent_batch(dev, batch: PagedBatch, pool, pool_scale, t_count: int, max_width=None):
    _check_rows(dev, batch, t_count)
    for s in range(batch.size):
        pool, pool_scale, _, _ = _check_latent(dev, pool, pool_scale, batch.tables[s], batch.starts[s],
                                               batch.counts[s], max_width)
    return pool, pool_scale


def latent_store_batch(kv, pool, pool_scale, batch: PagedBatch, *, device=None, checked: bool = False):
    """Append each sequence's latent rows of ``kv`` (float32 ``[T, R + P]``, T = ``batch.rows``) at its positions
    (in place): :func:`~freetoken.ops.latent_attention.latent_store` for every sequence of ``batch`` at once."""
    dev = resolve(device) if not checked else device
    if not checked:
        kv = as_input(dev, kv, "kv", np.float32, 2)
        pool, pool_scale = _check_latent_batch(dev, batch, pool, pool_scale, kv.shape[0])
        if kv.shape[1] != pool.shape[3]:
            raise ValueError(f"kv rows of {kv.shape[1]} values differ from the pool's {pool.shape[3]}")
    if dev.kind != "cpu":
        from freetoken.ops.latent_attention_cuda import latent_store_batch_cuda

        latent_store_batch_cuda(dev, kv, pool, pool_scale, batch)
        return None
    rows = batch.host_value("rows", lambda: batch.row_table(range(batch.size)))  # one scatter for all of them
    bs = pool.shape[1]
    blocks, at = batch.host_value(("latent_rows", bs), lambda: (batch.tables[rows[:, 1], rows[:, 2] // bs],
                                                                rows[:, 2] % bs))
    stored, sc = kv_encode(kv, kv_kind_of(pool))  # (the rows are kv's, in order)
    pool[blocks, at, 0] = stored
    if sc is not None:
        pool_scale[blocks, at, 0] = sc
    return None


def latent_attention_batch(q, pool, pool_scale, batch: PagedBatch, rank, *, scale: float, out=None, device=None,
                           checked: bool = False):
    """Each sequence's rows of ``q`` (float32 ``[T, H, R + P]``, T = ``batch.rows``) attend over its cached latent
    rows (:func:`latent_store_batch`): :func:`~freetoken.ops.latent_attention.latent_attention` for every sequence
    of ``batch`` at once. Returns float32 ``[T, H * R]`` on the device (``out`` when given)."""
    if checked:
        dev = device
    else:
        dev = resolve(device)
        q = as_input(dev, q, "q", np.float32, 3)
        pool, pool_scale = _check_latent_batch(dev, batch, pool, pool_scale, q.shape[0], LATENT_MAX_DIM)
        rank, out = check_latent_query(dev, q, pool, rank, scale, out)
    t_count, heads, _ = q.shape
    if out is None:
        out = dev.empty((t_count, heads * rank), np.float32)
    if dev.kind != "cpu":
        from freetoken.ops.latent_attention_cuda import latent_attention_batch_cuda

        latent_attention_batch_cuda(dev, q, pool, pool_scale, batch, rank, float(scale), out)
        return out
    kind = kv_kind_of(pool)
    if kind == "f16":  # the kernel widens IEEE half bits from int16 (Numba has no float16 arithmetic)
        pool = pool.view(np.int16)
    table = decode_table("fp8") if kind == "fp8" else _NO_TABLE
    seqs = batch.host_value("seqs", lambda: np.stack([batch.bounds[:-1], batch.counts, batch.starts], 1)
                            .astype(np.int64))
    cpu_module("latent_attention").latent_attention_batch(q, pool, pool_scale, table, batch.tables, seqs, rank,
                                                          np.float32(scale), out)
    return out
