"""What the GGUF block formats kept as the file stores them (q8_0 and the k-quants q4_k, q5_k, q6_k, iq4_xs)
share: the split of GGUF blocks into banks, the packed bit fields, the fp16 header fields and the Q4_K / Q5_K
affine codec.

A GGUF block of ``block`` weights is a header (its scale fields) and its quants. The banks (base.py's table) keep
them apart: ``s`` holds every block's header bytes and ``w`` its quant bytes, each in file order, blocks in order
along the row. ``from_gguf`` / ``to_gguf`` therefore only move bytes, and every ``w`` row stays 16-byte aligned.
Q6_K stores its header after the quants; its banks are the same split.

Packed fields: the k-quants pack small codes into runs of ``group`` bytes, each run holding ``8 / bits``
consecutive runs of ``group`` codes, the first in the lowest bits. Q4_K's 32-byte groups hold sub-block 2g in the
low nibbles and 2g + 1 in the high ones, IQ4_XS does the same with 16-byte groups, Q5_K's ``qh`` is eight 1-bit
fields of 32 bytes and Q6_K's four 2-bit fields: :func:`unpack_fields` / :func:`pack_fields` cover them all.

Decoders are written from the bit fields; the tests compare them with ``gguf.quants`` bit for bit. They compute in
gguf-py's (and ggml's) order: the scale products ``d * sc`` and ``(d * sc) * q`` are exact in float32 (at most
11 + 8 + 7 significant bits), so the only rounding is Q4_K / Q5_K's final subtraction of ``dmin * m``.
"""

from __future__ import annotations

from abc import abstractmethod
from fractions import Fraction

import numpy as np

from freetoken.formats import _fp
from freetoken.formats.base import BankSpec, ExpertFormat

#: Weights per k-quant super-block.
QK_K = 256
#: Largest finite fp16: block scales saturate there instead of becoming inf.
F16_MAX = 65504.0


class GGUFBlockFormat(ExpertFormat):
    """An expert format whose banks are GGUF blocks split into header (``s``) and quants (``w``).

    Subclasses give the block geometry (class attributes) and the codec of one block's bytes: :meth:`encode` and
    :meth:`decode` work on [..., blocks, ...] arrays, so one call handles a whole stack of experts.
    """

    #: GGUF's name of the type (for messages), e.g. "Q4_K".
    gguf_type: str
    #: Weights per block.
    block: int
    #: Bytes of a block's header (its scale fields) and of its quants.
    header_bytes: int
    quant_bytes: int
    #: Whether the file stores the header before the quants (Q6_K stores it after).
    header_first: bool = True
    #: dtype of the ``s`` bank: q8_0 keeps its one fp16 ``d`` as uint16 bits, as q4_0 does.
    s_dtype: np.dtype = np.dtype(np.uint8)

    @property
    def block_bytes(self) -> int:
        return self.header_bytes + self.quant_bytes

    @property
    def bits_per_weight(self) -> float:
        return 8.0 * self.block_bytes / self.block

    @property
    def k_multiple(self) -> int:
        return self.block

    @abstractmethod
    def encode(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """float32 weights [..., B, block] (finite) -> (header uint8 [..., B, header_bytes], quants uint8
        [..., B, quant_bytes]): the blocks' bytes as GGUF stores them."""

    @abstractmethod
    def decode(self, header: np.ndarray, quants: np.ndarray) -> np.ndarray:
        """header uint8 [..., B, header_bytes] and quants uint8 [..., B, quant_bytes] -> float32 [..., B, block]."""

    def bank_specs(self, n: int, k: int) -> list[BankSpec]:
        b = k // self.block
        return [BankSpec("w", np.dtype(np.uint8), (n, b * self.quant_bytes)),
                BankSpec("s", self.s_dtype, (n, b * self.header_bytes // self.s_dtype.itemsize))]

    def quantize(self, w: np.ndarray) -> dict[str, np.ndarray]:
        """float32 [E, N, K] -> {"w", "s"} (the recipe is in the format's docstring)."""
        return _fp.quantize_chunked(self, _fp.check_weights(self, w), self._quantize)

    def _quantize(self, w: np.ndarray) -> dict[str, np.ndarray]:
        return self._banks(*self.encode(_fp.blocks(w, self.block)))

    def dequantize(self, banks: dict[str, np.ndarray]) -> np.ndarray:
        """Banks -> float32 [E, N, K]."""
        header, quants = self._block_bytes(banks)
        with _fp.decode_errstate():
            return _fp.unblock(self.decode(header, quants))

    def from_gguf(self, raw, shape: tuple[int, int, int] | None = None) -> dict[str, np.ndarray]:
        """GGUF expert tensor of this type -> banks {"w", "s"}, bytes moved only.

        ``raw``: uint8 [E, N, K/block * block_bytes] (as ``GGUFReader`` gives it: NumPy order, the reverse of
        ggml's ne) or any uint8 array with ``shape = (E, N, K)`` in NumPy order. The expert dimension is required.
        """
        blk = _fp.gguf_blocks(raw, shape, self.block_bytes, self.gguf_type, self.block)
        self.check_shape(blk.shape[1], blk.shape[2] * self.block, "raw")
        cut = self.header_bytes if self.header_first else self.quant_bytes
        first, second = blk[..., :cut], blk[..., cut:]
        return self._banks(*((first, second) if self.header_first else (second, first)))

    def to_gguf(self, banks: dict[str, np.ndarray]) -> np.ndarray:
        """Banks -> GGUF bytes uint8 [E, N, K/block * block_bytes] (inverse of :meth:`from_gguf`)."""
        header, quants = self._block_bytes(banks)
        out = np.concatenate((header, quants) if self.header_first else (quants, header), axis=-1)
        return out.reshape(out.shape[0], out.shape[1], out.shape[2] * self.block_bytes)

    def _banks(self, header: np.ndarray, quants: np.ndarray) -> dict[str, np.ndarray]:
        """Blocks' header and quant bytes [e, N, B, ...] -> banks (``s`` as little-endian fields of ``s_dtype``)."""
        e, n, b = header.shape[:3]
        s = np.ascontiguousarray(header).view(self.s_dtype.newbyteorder("<")).astype(self.s_dtype, copy=False)
        return {"w": np.ascontiguousarray(quants).reshape(e, n, b * self.quant_bytes),
                "s": s.reshape(e, n, b * self.header_bytes // self.s_dtype.itemsize)}

    def _block_bytes(self, banks: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
        """Checked banks -> (header uint8 [E, N, B, header_bytes], quants uint8 [E, N, B, quant_bytes])."""
        e, n, k = _fp.bank_dims(self, banks, Fraction(self.block, self.quant_bytes))
        b = k // self.block
        s = np.ascontiguousarray(banks["s"], dtype=self.s_dtype.newbyteorder("<"))
        return s.view(np.uint8).reshape(e, n, b, self.header_bytes), banks["w"].reshape(e, n, b, self.quant_bytes)


# ---- packed fields ----------------------------------------------------------------------------------------


def _shifts(bits: int) -> np.ndarray:
    """Bit offsets of the ``8 / bits`` fields of a byte, as a column [8 / bits, 1] (one per run of codes)."""
    return (np.arange(8 // bits, dtype=np.uint8) * np.uint8(bits))[:, None]


def unpack_fields(packed: np.ndarray, bits: int, group: int) -> np.ndarray:
    """uint8 [..., M] -> codes uint8 [..., M * 8 / bits]: each run of ``group`` bytes gives ``8 / bits`` runs of
    ``group`` codes, lowest bits first (see the module docstring)."""
    m = packed.shape[-1]
    runs = packed.reshape(packed.shape[:-1] + (m // group, 1, group))
    codes = (runs >> _shifts(bits)) & np.uint8((1 << bits) - 1)
    return codes.reshape(packed.shape[:-1] + (m * (8 // bits),))


def pack_fields(codes: np.ndarray, bits: int, group: int) -> np.ndarray:
    """Codes [..., M * 8 / bits] (each below 2^bits) -> uint8 [..., M] (inverse of :func:`unpack_fields`)."""
    per = 8 // bits
    m = codes.shape[-1] // per
    runs = codes.astype(np.uint8, copy=False).reshape(codes.shape[:-1] + (m // group, per, group))
    return np.bitwise_or.reduce(runs << _shifts(bits), axis=-2).reshape(codes.shape[:-1] + (m,))


# ---- fp16 header fields -----------------------------------------------------------------------------------


def f16_field(header: np.ndarray, offset: int) -> np.ndarray:
    """The little-endian fp16 at byte ``offset`` of each header [..., H] -> float32 [...] (exact)."""
    return _fp.f16_decode(np.ascontiguousarray(header[..., offset:offset + 2]).view("<u2")[..., 0])


def f16_cover(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A super-block scale: float32 [...] -> (fp16 as float32 [...], its bytes uint8 [..., 2]), the fp16 of least
    magnitude >= |x| with x's sign, saturating at +-65504; a zero is stored as +0.

    Rounding away from zero, not to nearest, means the largest sub-block scale never needs a code beyond the top
    one, and a tiny nonzero scale never becomes 0 (which would zero its whole super-block): that matters for fp16
    subnormals, where nearest rounding moves a scale by up to 50 %.
    """
    x = np.clip(x, -F16_MAX, F16_MAX) + np.float32(0)  # + 0 turns -0 into +0
    h = x.astype("<f2")
    short = np.abs(h.astype(np.float32)) < np.abs(x)
    np.nextafter(h, np.where(x < 0, -np.inf, np.inf).astype("<f2"), out=h, where=short)
    return h.astype(np.float32), h[..., None].view(np.uint8)


# ---- quantizer pieces -------------------------------------------------------------------------------------


def signed_absmax(x: np.ndarray) -> np.ndarray:
    """The element of largest magnitude along the last axis, with its sign (symmetric scales map it to the code
    grid's longer end)."""
    return np.take_along_axis(x, np.abs(x).argmax(axis=-1)[..., None], axis=-1)[..., 0]


def codes_for(x: np.ndarray, step: np.ndarray, lo: int, hi: int) -> np.ndarray:
    """Nearest integers ``round(x / step)`` clipped to [lo, hi] (float32), 0 where ``step`` is 0: the codes of
    ``x`` given scales that are already quantized, so that rounding is to the grid the decoder sees."""
    ratio = np.zeros(np.broadcast_shapes(x.shape, step.shape), np.float32)
    with np.errstate(over="ignore"):  # a tiny step overflows the ratio to inf; the clip saturates it
        np.divide(x, step, out=ratio, where=step != 0)
    return np.clip(np.rint(ratio), lo, hi)


# ---- Q4_K / Q5_K: 8 sub-blocks of 32 with 6-bit scales and mins -------------------------------------------

#: Weights per Q4_K / Q5_K sub-block, and the largest 6-bit scale or min.
AFFINE_SUB = 32
SIX_BITS = 63
#: Bytes of the Q4_K / Q5_K header: d, dmin (fp16), scales[12].
AFFINE_HEADER = 16


def unpack_scale_min(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K ``scales`` uint8 [..., 12] -> (sc, m) uint8 [..., 8], the sub-blocks' 6-bit scales and mins.

    Bytes 0-3 hold sc 0-3 and bytes 4-7 m 0-3 in their low 6 bits; bytes 8-11 hold the low 4 bits of sc 4-7
    (low nibble) and m 4-7 (high nibble), whose top 2 bits are the top bits of bytes 0-3 (sc) and 4-7 (m).
    """
    a, b, c = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    top = np.uint8(6)
    sc = np.concatenate([a & np.uint8(SIX_BITS), (c & np.uint8(15)) | ((a >> top) << np.uint8(4))], axis=-1)
    m = np.concatenate([b & np.uint8(SIX_BITS), (c >> np.uint8(4)) | ((b >> top) << np.uint8(4))], axis=-1)
    return sc, m


def pack_scale_min(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """6-bit (sc, m) uint8 [..., 8] -> Q4_K ``scales`` uint8 [..., 12] (inverse of :func:`unpack_scale_min`)."""
    top = np.uint8(6)
    a = sc[..., :4] | ((sc[..., 4:] >> np.uint8(4)) << top)
    b = m[..., :4] | ((m[..., 4:] >> np.uint8(4)) << top)
    c = (sc[..., 4:] & np.uint8(15)) | ((m[..., 4:] & np.uint8(15)) << np.uint8(4))
    return np.concatenate([a, b, c], axis=-1)


def affine_decode(header: np.ndarray, q: np.ndarray) -> np.ndarray:
    """Q4_K / Q5_K: headers uint8 [..., 16] (d, dmin, scales[12]) and codes uint8 [..., 256] -> float32
    [..., 256], ``d * sc_j * q - dmin * m_j`` for sub-block j of 32."""
    sc, m = unpack_scale_min(header[..., 4:AFFINE_HEADER])
    scale = f16_field(header, 0)[..., None] * sc  # [..., 8], exact
    offset = f16_field(header, 2)[..., None] * m
    return _fp.unblock(_fp.blocks(q, AFFINE_SUB) * scale[..., None] - offset[..., None])


def _six_bit_codes(v: np.ndarray, unit: np.ndarray) -> np.ndarray:
    """Non-negative sub-block values [..., 8] in units of their super-block's fp16 ``unit`` [...] -> uint8 0..63."""
    return codes_for(v, unit[..., None], 0, SIX_BITS).astype(np.uint8)


def affine_encode(x: np.ndarray, qmax: int) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K (``qmax`` 15) / Q5_K (31): weights float32 [..., 256] -> (headers uint8 [..., 16], codes uint8
    [..., 256]), the recipe of :mod:`freetoken.formats.q4_k`."""
    sub = _fp.blocks(x, AFFINE_SUB)  # [..., 8, 32]
    lo = np.minimum(sub.min(axis=-1), 0)  # the decode's offset -dmin * m is never positive
    with np.errstate(over="ignore"):  # weights near float32's maximum: the scale saturates below
        scale = (sub.max(axis=-1) - lo) / np.float32(qmax)
    d, d_bytes = f16_cover(scale.max(axis=-1) / np.float32(SIX_BITS))
    mins = -lo
    dmin, dmin_bytes = f16_cover(mins.max(axis=-1) / np.float32(SIX_BITS))
    sc, m = _six_bit_codes(scale, d), _six_bit_codes(mins, dmin)
    step, offset = d[..., None] * sc, dmin[..., None] * m
    q = codes_for(sub + offset[..., None], step[..., None], 0, qmax).astype(np.uint8)
    header = np.concatenate([d_bytes, dmin_bytes, pack_scale_min(sc, m)], axis=-1)
    return header, _fp.unblock(q)
