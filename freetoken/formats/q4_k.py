"""q4_k: GGUF's Q4_K super-blocks, each split into its 16-byte header and its 128 bytes of quants.

A GGUF block holds 256 weights in 144 bytes: fp16 ``d``, fp16 ``dmin``, ``scales[12]`` (a 6-bit scale ``sc_j`` and
min ``m_j`` for each of 8 sub-blocks of 32, packed as :func:`freetoken.formats._kquant.unpack_scale_min` reads
them), ``qs[128]``: 4 groups of 32 bytes, group g holding sub-block 2g in the low nibbles and 2g + 1 in the high
nibbles. Weight 32j + i is ``d * sc_j * q - dmin * m_j``.

Banks (per expert): ``w`` uint8 [N, K/256 * 128] (``qs``), ``s`` uint8 [N, K/256 * 16] (``d``, ``dmin``,
``scales``), blocks in order.

Quantize (a simple min/max recipe, not llama.cpp's iterative search): per sub-block of 32, the range
[min(x, 0), max(x)] gives the scale ``(max - min) / 15`` and the min ``-min(x, 0)`` (>= 0: ggml's convention);
per super-block ``d`` and ``dmin`` are the largest scale and min / 63, rounded up to fp16 (saturating at 65504);
the 6-bit ``sc_j`` and ``m_j`` are the nearest multiples of those; each weight takes the nearest code 0..15 given
the quantized scale and min. An all-zero block stores zeros.
"""

from __future__ import annotations

import numpy as np

from freetoken.formats import _kquant

#: Nibble runs: a 32-byte group holds two sub-blocks.
GROUP = 32


class Q4KFormat(_kquant.GGUFBlockFormat):
    """Q4_K: 4-bit affine sub-blocks of 32 with 6-bit scales and mins (see the module docstring)."""

    name = "q4_k"
    gguf_type = "Q4_K"
    block = _kquant.QK_K
    header_bytes = _kquant.AFFINE_HEADER
    quant_bytes = 128

    def encode(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        header, q = _kquant.affine_encode(x, 15)
        return header, _kquant.pack_fields(q, 4, GROUP)

    def decode(self, header: np.ndarray, quants: np.ndarray) -> np.ndarray:
        return _kquant.affine_decode(header, _kquant.unpack_fields(quants, 4, GROUP))


FORMAT = Q4KFormat()
#: GGUF Q4_K bytes uint8 [E, N, K/256 * 144] (or flat with ``shape``) <-> banks; see ``GGUFBlockFormat``.
from_gguf = FORMAT.from_gguf
to_gguf = FORMAT.to_gguf
