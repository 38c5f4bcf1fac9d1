"""q8_0: GGUF's Q8_0 blocks, with each block's 2-byte ``d`` split into its own bank.

A GGUF block holds 32 weights in 34 bytes: fp16 ``d``, then 32 int8 ``qs``; weight j is ``d * qs[j]``.

Banks (per expert): ``w`` uint8 [N, K] (the int8 ``qs`` of each block, blocks in order), ``s`` uint16 [N, K/32]
(fp16 bits of ``d``). Decode: ``int8(w[n, k]) * f16(s[n, k // 32])`` (exact in float32).
"""

from __future__ import annotations

import numpy as np
from gguf.quants import GGMLQuantizationType
from gguf.quants import quantize as gguf_quantize

from freetoken.formats import _fp, _kquant


class Q80Format(_kquant.GGUFBlockFormat):
    """Q8_0. Quantize is ``gguf.quants.quantize(w, Q8_0)`` (llama.cpp's reference: ``d = amax / 127``,
    ``qs = round(x / d)`` half away from zero), byte for byte."""

    name = "q8_0"
    gguf_type = "Q8_0"
    block = 32
    header_bytes = 2
    quant_bytes = 32
    s_dtype = np.dtype(np.uint16)

    def encode(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        blk = _fp.blocks(gguf_quantize(_fp.unblock(x), GGMLQuantizationType.Q8_0), self.block_bytes)
        return blk[..., :self.header_bytes], blk[..., self.header_bytes:]

    def decode(self, header: np.ndarray, quants: np.ndarray) -> np.ndarray:
        return quants.view(np.int8) * _kquant.f16_field(header, 0)[..., None]


FORMAT = Q80Format()
#: GGUF Q8_0 bytes uint8 [E, N, K/32 * 34] (or flat with ``shape``) <-> banks; see ``GGUFBlockFormat``.
from_gguf = FORMAT.from_gguf
to_gguf = FORMAT.to_gguf
