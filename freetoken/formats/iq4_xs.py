"""iq4_xs: GGUF's IQ4_XS super-blocks, each split into its 8-byte header and its 128 bytes of quants.

A GGUF block holds 256 weights in 136 bytes: fp16 ``d``, ``scales_h`` (uint16: bits 2j, 2j + 1 are the top bits of
sub-block j's scale), ``scales_l[4]`` (the low 4 bits of the scales of sub-blocks 2i (low nibble) and 2i + 1),
``qs[128]``. Sub-block j of 32 (6-bit scale ``ls_j``) uses ``qs[16j:16j + 16]``: weight 32j + i is the low nibble
of byte i for i < 16, the high nibble of byte i - 16 otherwise. Its value is ``d * (ls_j - 32) * KVALUES[q]``.

Banks (per expert): ``w`` uint8 [N, K/256 * 128] (``qs``), ``s`` uint8 [N, K/256 * 8] (``d``, ``scales_h``,
``scales_l``), blocks in order.

Quantize (no search, unlike llama.cpp): per sub-block of 32, the scale that maps the weight of largest magnitude
to the table's -127 (signed); per super-block ``d`` = the scale of largest magnitude / -32, rounded away from 0 to
fp16 (saturating at 65504); ``ls_j - 32`` the nearest multiples of ``d`` (clipped to -32..31); each weight takes
the nearest table value given its quantized scale. An all-zero block stores zeros.
"""

from __future__ import annotations

import numpy as np

from freetoken.formats import _fp, _kquant

SUB = 32
#: ggml's ``kvalues_iq4nl``: the non-linear 4-bit grid (ascending).
KVALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.float32)
_MIDPOINTS = (KVALUES[1:] + KVALUES[:-1]) / 2
#: Scales are stored as ls - 32 (6 bits).
SCALE_BIAS = 32
#: Nibble runs of ``qs``: a 16-byte group holds one sub-block.
GROUP = 16


def _nearest_value(x: np.ndarray) -> np.ndarray:
    """float32 in table units -> uint8 code of the nearest :data:`KVALUES` entry."""
    return np.searchsorted(_MIDPOINTS, x).astype(np.uint8)


class IQ4XSFormat(_kquant.GGUFBlockFormat):
    """IQ4_XS: a non-linear 4-bit grid on sub-blocks of 32 with 6-bit scales (see the module docstring)."""

    name = "iq4_xs"
    gguf_type = "IQ4_XS"
    block = _kquant.QK_K
    header_bytes = 8
    quant_bytes = 128

    def encode(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        sub = _fp.blocks(x, SUB)  # [..., 8, 32]
        scale = _kquant.signed_absmax(sub) / KVALUES[0]
        d, d_bytes = _kquant.f16_cover(_kquant.signed_absmax(scale) / np.float32(-SCALE_BIAS))
        ls = _kquant.codes_for(scale, d[..., None], -SCALE_BIAS, SCALE_BIAS - 1)
        step = (d[..., None] * ls)[..., None]
        ratio = np.zeros(sub.shape, np.float32)
        with np.errstate(over="ignore"):  # a tiny step: inf takes the table's end
            np.divide(sub, step, out=ratio, where=step != 0)
        ls = (ls + SCALE_BIAS).astype(np.uint8)
        scales_h = _kquant.pack_fields(ls >> np.uint8(4), 2, 1)  # the uint16's two little-endian bytes
        header = np.concatenate([d_bytes, scales_h, _fp.pack_nibbles(ls & np.uint8(15))], axis=-1)
        return header, _kquant.pack_fields(_fp.unblock(_nearest_value(ratio)), 4, GROUP)

    def decode(self, header: np.ndarray, quants: np.ndarray) -> np.ndarray:
        ls = _fp.unpack_nibbles(header[..., 4:8]) | (_kquant.unpack_fields(header[..., 2:4], 2, 1) << np.uint8(4))
        scale = _kquant.f16_field(header, 0)[..., None] * (ls.astype(np.int8) - np.int8(SCALE_BIAS))  # exact
        v = KVALUES[_fp.blocks(_kquant.unpack_fields(quants, 4, GROUP), SUB)]
        return _fp.unblock(scale[..., None] * v)


FORMAT = IQ4XSFormat()
#: GGUF IQ4_XS bytes uint8 [E, N, K/256 * 136] (or flat with ``shape``) <-> banks; see ``GGUFBlockFormat``.
from_gguf = FORMAT.from_gguf
to_gguf = FORMAT.to_gguf
