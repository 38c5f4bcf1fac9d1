"""q5_k: GGUF's Q5_K super-blocks, each split into its 16-byte header and its 160 bytes of quants.

A GGUF block holds 256 weights in 176 bytes: ``d``, ``dmin``, ``scales[12]`` as Q4_K (:mod:`freetoken.formats.q4_k`),
then ``qh[32]`` and ``qs[128]``. The code of weight 32j + i is Q4_K's 4-bit code plus 16 times bit j of ``qh[i]``;
its value ``d * sc_j * q - dmin * m_j``.

Banks (per expert): ``w`` uint8 [N, K/256 * 160] (``qh`` then ``qs``), ``s`` uint8 [N, K/256 * 16] (``d``,
``dmin``, ``scales``), blocks in order.

Quantize: Q4_K's min/max recipe with codes 0..31 (scale ``(max - min) / 31``).
"""

from __future__ import annotations

import numpy as np

from freetoken.formats import _kquant

#: Bytes of ``qh`` (one bit of every weight), before ``qs``.
QH_BYTES = 32
#: Nibble runs of ``qs`` (as Q4_K) and bit runs of ``qh``.
GROUP = 32


class Q5KFormat(_kquant.GGUFBlockFormat):
    """Q5_K: 5-bit affine sub-blocks of 32 with 6-bit scales and mins (see the module docstring)."""

    name = "q5_k"
    gguf_type = "Q5_K"
    block = _kquant.QK_K
    header_bytes = _kquant.AFFINE_HEADER
    quant_bytes = QH_BYTES + 128

    def encode(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        header, q = _kquant.affine_encode(x, 31)
        qh = _kquant.pack_fields(q >> np.uint8(4), 1, GROUP)
        return header, np.concatenate([qh, _kquant.pack_fields(q & np.uint8(15), 4, GROUP)], axis=-1)

    def decode(self, header: np.ndarray, quants: np.ndarray) -> np.ndarray:
        high = _kquant.unpack_fields(quants[..., :QH_BYTES], 1, GROUP) << np.uint8(4)
        return _kquant.affine_decode(header, _kquant.unpack_fields(quants[..., QH_BYTES:], 4, GROUP) | high)


FORMAT = Q5KFormat()
#: GGUF Q5_K bytes uint8 [E, N, K/256 * 176] (or flat with ``shape``) <-> banks; see ``GGUFBlockFormat``.
from_gguf = FORMAT.from_gguf
to_gguf = FORMAT.to_gguf
