"""References of the dense ops (``ops.dense_gemv``, ``ops.dense``): the float64 product, GGUF block decoding (by
gguf-py) and block-FP8 row decoding (by ml_dtypes)."""

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


def dense_grouped_reference(x: np.ndarray, w32: np.ndarray) -> np.ndarray:
    """``y[t, g] = x[t, g] @ w32[g*N:(g+1)*N].T`` in float64: x [T, G, K], w32 [G*N, K] -> [T, G, N]."""
    t, groups, k = x.shape
    w = w32.astype(np.float64).reshape(groups, -1, k)
    return np.einsum("tgk,gnk->tgn", x.astype(np.float64), w)


def gguf_dequantized(blocks: np.ndarray, kind: str) -> np.ndarray:
    """float32 values of GGUF blocks per gguf-py (the reference decoder)."""
    from gguf.quants import GGMLQuantizationType, dequantize

    return np.asarray(dequantize(blocks, GGMLQuantizationType[kind.upper()]), dtype=np.float32)


def fp8_rows_dequantized(rows: np.ndarray, k: int) -> np.ndarray:
    """float32 values of block-FP8 rows (uint8 [N, K + 4 * ceil(K/128)]: the row's float32 scales, then its K e4m3fn
    codes): ``float32(e4m3) * scale``, one float32 rounding, the e4m3 decode by ml_dtypes."""
    import ml_dtypes

    nkb = -(-k // 128)
    rows = np.ascontiguousarray(rows)
    scales = rows[:, :4 * nkb].copy().view("<f4").astype(np.float32)
    codes = rows[:, 4 * nkb:4 * nkb + k].copy().view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    with np.errstate(over="ignore", invalid="ignore"):
        return codes * np.repeat(scales, 128, axis=1)[:, :k]


def blocks_dequantized(blocks: np.ndarray, kind: str, k: int) -> np.ndarray:
    """float32 values of a block storage's rows: GGUF ``kind`` by gguf-py, ``fp8_block`` by
    :func:`fp8_rows_dequantized`."""
    return fp8_rows_dequantized(blocks, k) if kind == "fp8_block" else gguf_dequantized(blocks, kind)
