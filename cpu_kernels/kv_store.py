"""The KV append of a forward pass on the CPU (the cpu twin of ``kv_store_<kind>`` in ``cuda/paged_attention.cu``;
contract: ``freetoken/testing/reference/paged_attention.py``): T rows of keys and values encoded into their pool
blocks in one call. The NumPy encode and scatter it replaces took ~30 us per layer for a decode step's single row,
about as long as the attention over a 512-token context.

Kinds: float32 (copied) and bf16 (round to nearest even on the float32 bits, as
:func:`freetoken.ops.paged_attention.kv_encode` does: a NaN stays a quiet NaN); f16 and fp8 pools keep the NumPy
encoder (Numba has no float16 conversion).
"""

from __future__ import annotations

import numba as nb
import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic, overload


@intrinsic
def _f32_bits(typingctx, x):
    """float32 -> its bits as uint32."""
    if x != types.float32:
        return None

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.IntType(32))
    return types.uint32(x), codegen


def _encode(x, sample):
    """float32 ``x`` as the pool stores it (the pool's type is ``sample``'s)."""


@overload(_encode)
def _encode_typed(x, sample):
    if sample == types.uint16:
        def bf16(x, sample):
            bits = _f32_bits(x)
            if x != x:  # NaN: quiet, never rounded up to inf
                return np.uint16((bits >> np.uint32(16)) | np.uint32(0x40))
            return np.uint16((bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16))
        return bf16
    if sample == types.float32:
        return lambda x, sample: x
    return None


@nb.njit(error_model="numpy", cache=True)
def _store_row(k, v, t, k_pool, v_pool, block, row):
    """Row ``t`` of ``k``, ``v`` into row ``row`` of pool block ``block``."""
    for h in range(k.shape[1]):
        for d in range(k.shape[2]):
            k_pool[block, row, h, d] = _encode(k[t, h, d], k_pool[0, 0, 0, 0])
            v_pool[block, row, h, d] = _encode(v[t, h, d], v_pool[0, 0, 0, 0])


@nb.njit(error_model="numpy", cache=True)
def kv_store_rows(k, v, k_pool, v_pool, block_table, start):
    """Rows ``t`` of ``k``, ``v`` (float32 ``[T, Hkv, D]``) into pool block ``block_table[(start + t) // BS]``, row
    ``(start + t) % BS`` of ``k_pool``, ``v_pool`` (``[NB, BS, Hkv, D]``: float32, or uint16 bf16 bits)."""
    bs = k_pool.shape[1]
    for t in range(k.shape[0]):
        pos = start + t
        _store_row(k, v, t, k_pool, v_pool, block_table[pos // bs], pos % bs)


@nb.njit(error_model="numpy", cache=True)
def kv_store_rows_batch(k, v, k_pool, v_pool, tables, rows):
    """:func:`kv_store_rows` for the rows of several sequences: ``rows`` int32 ``[n, 3]`` holds each row's (row of
    ``k`` / ``v``, sequence, position); the position's block is looked up in the sequence's row of ``tables``
    (int32 ``[S, W]``)."""
    bs = k_pool.shape[1]
    for i in range(rows.shape[0]):
        pos = rows[i, 2]
        _store_row(k, v, rows[i, 0], k_pool, v_pool, tables[rows[i, 1], pos // bs], pos % bs)
