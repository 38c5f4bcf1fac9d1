"""q4_0: GGUF's Q4_0 blocks, with each block's 2-byte ``d`` split into its own bank.

A GGUF block holds 32 weights in 18 bytes: fp16 ``d``, then 16 bytes ``qs``; element j < 16 is the low nibble of
``qs[j]``, element j + 16 its high nibble; the value is ``(q - 8) * d``.

Banks (per expert): ``w`` uint8 [N, K/2] (the 16 ``qs`` bytes of each block, blocks in order), ``s`` uint16
[N, K/32] (fp16 bits of ``d``). Decode: ``(q - 8) * f16(s[n, k // 32])`` (exact in float32).
"""

from __future__ import annotations

import numpy as np
from gguf.quants import GGMLQuantizationType
from gguf.quants import quantize as gguf_quantize

from freetoken.formats import _fp
from freetoken.formats.base import BankSpec, ExpertFormat

BLOCK = 32
GGUF_BLOCK_BYTES = 18


class Q40Format(ExpertFormat):
    """Q4_0. Quantize is ``gguf.quants.quantize(w, Q4_0)`` (llama.cpp's reference: ``d = x[argmax |x|] / -8``,
    ``q = trunc(x / d + 8.5)`` clipped to 15), byte for byte."""

    name = "q4_0"
    bits_per_weight = 8.0 * GGUF_BLOCK_BYTES / BLOCK
    k_multiple = 32

    def bank_specs(self, n: int, k: int) -> list[BankSpec]:
        return [BankSpec("w", np.dtype(np.uint8), (n, k // 2)),
                BankSpec("s", np.dtype(np.uint16), (n, k // BLOCK))]

    def quantize(self, w: np.ndarray) -> dict[str, np.ndarray]:
        """float32 [E, N, K] -> {"w": uint8 [E, N, K/2], "s": uint16 [E, N, K/32]}."""
        w = _fp.check_weights(self, w)
        return _fp.quantize_chunked(self, w, lambda part: from_gguf(gguf_quantize(part, GGMLQuantizationType.Q4_0)))

    def dequantize(self, banks: dict[str, np.ndarray]) -> np.ndarray:
        """Banks -> float32 [E, N, K]."""
        _fp.bank_dims(self, banks, 2)
        qs = _fp.blocks(banks["w"], BLOCK // 2)  # [E, N, K/32, 16]
        q = np.concatenate([qs & np.uint8(15), qs >> np.uint8(4)], axis=-1)  # element order within the block
        v = q.astype(np.int8) - np.int8(8)
        with _fp.decode_errstate():
            return _fp.unblock(v.astype(np.float32) * _fp.f16_decode(banks["s"])[..., None])


FORMAT = Q40Format()


def from_gguf(raw, shape: tuple[int, int, int] | None = None) -> dict[str, np.ndarray]:
    """GGUF Q4_0 expert tensor -> banks {"w": uint8 [E, N, K/2], "s": uint16 [E, N, K/32]}, bytes moved only.

    ``raw``: uint8 [E, N, K/32 * 18] (as ``GGUFReader`` gives it: NumPy order, the reverse of ggml's ne) or any
    uint8 array with ``shape = (E, N, K)`` in NumPy order. The expert dimension is required.
    """
    blk = _fp.gguf_blocks(raw, shape, GGUF_BLOCK_BYTES, "Q4_0")
    FORMAT.check_shape(blk.shape[1], blk.shape[2] * BLOCK, "raw")
    d = np.ascontiguousarray(blk[..., :2]).view("<u2")[..., 0]  # GGUF is little-endian
    w = blk[..., 2:].reshape(blk.shape[0], blk.shape[1], -1)
    return {"w": np.ascontiguousarray(w), "s": d.astype(np.uint16)}


def to_gguf(banks: dict[str, np.ndarray]) -> np.ndarray:
    """Banks -> GGUF Q4_0 bytes uint8 [E, N, K/32 * 18] (inverse of :func:`from_gguf`)."""
    e, n, k = _fp.bank_dims(FORMAT, banks, 2)
    d = banks["s"].astype("<u2")[..., None].view(np.uint8)  # [E, N, K/32, 2]
    out = np.concatenate([d, _fp.blocks(banks["w"], BLOCK // 2)], axis=-1)
    return out.reshape(e, n, k // BLOCK * GGUF_BLOCK_BYTES)
