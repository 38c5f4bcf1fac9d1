"""References of the dense ops (``ops.dense_gemv``, ``ops.dense``): the float64 product and GGUF block decoding."""

from __future__ import annotations

import numpy as np


def dense_reference(x: np.ndarray, w32: np.ndarray, bias: np.ndarray | None = None) -> np.ndarray:
    """``x @ w32.T (+ bias)`` in float64, in row chunks (bounds the float64 copy of a large matrix)."""
    x64 = x.astype(np.float64)
    out = np.empty((x.shape[0], w32.shape[0]), np.float64)
    step = max(1, (1 << 24) // max(1, w32.shape[1]))
    for r0 in range(0, w32.shape[0], step):
        out[:, r0:r0 + step] = x64 @ w32[r0:r0 + step].astype(np.float64).T
    return out if bias is None else out + bias


def gguf_dequantized(blocks: np.ndarray, kind: str) -> np.ndarray:
    """float32 values of GGUF blocks per gguf-py (the reference decoder)."""
    from gguf.quants import GGMLQuantizationType, dequantize

    return np.asarray(dequantize(blocks, GGMLQuantizationType[kind.upper()]), dtype=np.float32)
