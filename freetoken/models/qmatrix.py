"""GGUF block-quantized matrices kept in their file encoding (Q8_0, Q4_0) for :class:`freetoken.models.linear.Linear`.

A row of K weights is K/32 blocks, each a little-endian float16 scale ``d`` followed by the quants:

- ``q8_0`` (34 bytes): 32 int8 ``q``; weight ``j`` is ``d * q[j]``.
- ``q4_0`` (18 bytes): 16 bytes of nibbles; weight ``j < 16`` is the low nibble of byte ``j``, weight ``j + 16`` its
  high nibble; the value is ``d * (nibble - 8)`` (gguf-py's / llama.cpp's order, as :mod:`freetoken.formats.q4_0`).

Every value is exact in float32 (an 11-bit significand times an integer of at most 8 bits), so :meth:`dequantize`
equals ``gguf.quants.dequantize`` bit for bit. Whole rows are independent: stacking or permuting rows of the block
array is exact (fused q/k/v, llama.cpp's Q/K row permutation).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

#: Weights per block.
BLOCK = 32
#: Bytes per block of each kind (2-byte scale + quants).
BLOCK_BYTES = {"q8_0": 34, "q4_0": 18}
KINDS = tuple(BLOCK_BYTES)


@dataclass(frozen=True)
class QuantizedMatrix:
    """A matrix [N, K] as GGUF blocks: ``blocks`` uint8 [N, K/32 * BLOCK_BYTES[kind]] (C-contiguous on the
    host), ``kind`` "q8_0" or "q4_0"."""

    kind: str
    blocks: np.ndarray
    shape: tuple[int, int]

    def __post_init__(self):
        if self.kind not in BLOCK_BYTES:
            raise ValueError(f"unknown quantized kind {self.kind!r}; choose {' or '.join(KINDS)}")
        n, k = (int(d) for d in self.shape)
        if k % BLOCK:
            raise ValueError(f"{self.kind} rows must be whole blocks of {BLOCK}, got K={k}")
        b = self.blocks
        want = (n, k // BLOCK * BLOCK_BYTES[self.kind])
        if b.dtype != np.uint8 or b.shape != want:
            raise ValueError(f"{self.kind} blocks of a [{n}, {k}] matrix must be uint8 {list(want)}, got "
                             f"{b.dtype} {list(b.shape)}")
        object.__setattr__(self, "shape", (n, k))

    @property
    def nbytes(self) -> int:
        return int(self.blocks.nbytes)

    def rows(self, index) -> QuantizedMatrix:
        """The rows ``index`` (an index array or a slice) as a new matrix (block rows copied)."""
        b = np.ascontiguousarray(self.blocks[index])
        return QuantizedMatrix(self.kind, b, (b.shape[0], self.shape[1]))

    def dequantize(self) -> np.ndarray:
        """float32 [N, K] (bit-identical to ``gguf.quants.dequantize``)."""
        return dequantize_blocks(self.blocks, self.kind, self.shape[1])


def dequantize_blocks(blocks: np.ndarray, kind: str, k: int) -> np.ndarray:
    """uint8 block rows [N, K/32 * bytes] of ``kind`` -> float32 [N, K]."""
    n = blocks.shape[0]
    blk = np.ascontiguousarray(blocks).reshape(n, k // BLOCK, BLOCK_BYTES[kind])
    d = np.ascontiguousarray(blk[..., :2]).view("<f2")[..., 0].astype(np.float32)[..., None]  # [N, K/32, 1]
    qs = blk[..., 2:]
    if kind == "q8_0":
        q = qs.view(np.int8).astype(np.float32)
    else:
        q = np.concatenate([qs & np.uint8(15), qs >> np.uint8(4)], axis=-1).astype(np.float32) - np.float32(8)
    with np.errstate(over="ignore", invalid="ignore"):
        return (d * q).reshape(n, k)


def stack(mats: list[QuantizedMatrix]) -> QuantizedMatrix:
    """Matrices of one kind and one K stacked along N (block rows concatenated)."""
    kind, k = mats[0].kind, mats[0].shape[1]
    if any(m.kind != kind or m.shape[1] != k for m in mats):
        raise ValueError("stacking needs one kind and one K")
    b = np.concatenate([m.blocks for m in mats], axis=0) if len(mats) > 1 else np.ascontiguousarray(mats[0].blocks)
    return QuantizedMatrix(kind, b, (b.shape[0], k))
