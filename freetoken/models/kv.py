"""The sequence's keys and values: one ``[max_len, Hkv, D]`` float32 row array per layer for K and for V.

Rows ``[0, length)`` of every layer hold the sequence's tokens; a forward pass at position ``start`` writes its T
rows and attends over rows ``[0, start + T)``. (A paged bf16 pool is the long-context issue's.)"""

from __future__ import annotations

import numpy as np


class LayerKV:
    """One layer's K and V rows."""

    def __init__(self, xp, max_len: int, kv_heads: int, head_dim: int):
        self.k = xp.zeros((max_len, kv_heads, head_dim), np.float32)
        self.v = xp.zeros((max_len, kv_heads, head_dim), np.float32)

    def write(self, start: int, k, v) -> None:
        """Rows ``start .. start + T - 1`` from ``k``, ``v`` ``[T, Hkv, D]``."""
        self.k[start:start + k.shape[0]] = k
        self.v[start:start + v.shape[0]] = v


class KVCache:
    """Every layer's :class:`LayerKV` and the sequence length they hold."""

    def __init__(self, xp, num_layers: int, max_len: int, kv_heads: int, head_dim: int):
        self.layers = [LayerKV(xp, max_len, kv_heads, head_dim) for _ in range(num_layers)]
        self.max_len = max_len
        self.length = 0
