"""q6_k: GGUF's Q6_K super-blocks, each split into its 192 bytes of quants and its 18-byte header.

A GGUF block holds 256 weights in 210 bytes: ``ql[128]`` (low 4 bits), ``qh[64]`` (high 2 bits), int8
``scales[16]`` (one per sub-block of 16), fp16 ``d``. Each half h of 128 weights uses ``ql[64h:64h + 64]`` (low
nibbles: weights 128h + 0..63, high nibbles: 128h + 64..127) and ``qh[32h:32h + 32]`` (its four 2-bit fields, lowest
first: weights 128h + 32f + l for field f of byte l). Weight w is ``d * scales[w // 16] * (q - 32)``.

Banks (per expert): ``w`` uint8 [N, K/256 * 192] (``ql`` then ``qh``: the block's first 192 bytes), ``s`` uint8
[N, K/256 * 18] (``scales`` then ``d``), blocks in order.

Quantize: per sub-block of 16, the scale that maps the weight of largest magnitude to code -32 (``x / -32``,
signed, so the other side reaches +31); per super-block ``d`` = the scale of largest magnitude / -128, rounded away
from 0 to fp16 (saturating at 65504); the int8 scales are the nearest multiples of ``d`` (clipped to -128..127);
each weight takes the nearest code -32..31 given its quantized scale. An all-zero block stores zeros (codes 32).
"""

from __future__ import annotations

import numpy as np

from freetoken.formats import _fp, _kquant

SUB = 16
#: Bytes of ``ql`` (before ``qh``) and their nibble runs; ``qh``'s 2-bit runs.
QL_BYTES = 128
QL_GROUP = 64
QH_GROUP = 32
#: Codes are stored as q + 32 (6 bits).
ZERO_CODE = 32


class Q6KFormat(_kquant.GGUFBlockFormat):
    """Q6_K: 6-bit symmetric sub-blocks of 16 with int8 scales (see the module docstring)."""

    name = "q6_k"
    gguf_type = "Q6_K"
    block = _kquant.QK_K
    header_bytes = SUB + 2
    quant_bytes = QL_BYTES + 64
    header_first = False

    def encode(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        sub = _fp.blocks(x, SUB)  # [..., 16, 16]
        scale = _kquant.signed_absmax(sub) / np.float32(-ZERO_CODE)
        d, d_bytes = _kquant.f16_cover(_kquant.signed_absmax(scale) / np.float32(-128))
        sc = _kquant.codes_for(scale, d[..., None], -128, 127)
        q = _kquant.codes_for(sub, (d[..., None] * sc)[..., None], -ZERO_CODE, ZERO_CODE - 1) + ZERO_CODE
        q = _fp.unblock(q.astype(np.uint8))
        ql = _kquant.pack_fields(q & np.uint8(15), 4, QL_GROUP)
        qh = _kquant.pack_fields(q >> np.uint8(4), 2, QH_GROUP)
        header = np.concatenate([sc.astype(np.int8).view(np.uint8), d_bytes], axis=-1)
        return header, np.concatenate([ql, qh], axis=-1)

    def decode(self, header: np.ndarray, quants: np.ndarray) -> np.ndarray:
        low = _kquant.unpack_fields(quants[..., :QL_BYTES], 4, QL_GROUP)
        q = low | (_kquant.unpack_fields(quants[..., QL_BYTES:], 2, QH_GROUP) << np.uint8(4))
        v = _fp.blocks(q.astype(np.int8) - np.int8(ZERO_CODE), SUB).astype(np.float32)
        scale = _kquant.f16_field(header, SUB)[..., None] * header[..., :SUB].view(np.int8)  # exact
        return _fp.unblock(scale[..., None] * v)


FORMAT = Q6KFormat()
#: GGUF Q6_K bytes uint8 [E, N, K/256 * 210] (or flat with ``shape``) <-> banks; see ``GGUFBlockFormat``.
from_gguf = FORMAT.from_gguf
to_gguf = FORMAT.to_gguf
