"""mxfp4: OCP microscaling FP4. e2m1 values, one e8m0 (power-of-two) scale per 32 consecutive K.

Banks (per expert): ``w`` uint8 [N, K/2] (e2m1 pairs, low nibble = even k), ``s`` uint8 [N, K/32] (e8m0 bits).
Decode: ``e2m1(nib(n, k)) * 2^(s[n, k // 32] - 127)`` (exact; s = 255 is NaN, s = 0 is the subnormal 2^-127).

Checkpoint conversions: gpt-oss (:func:`from_gpt_oss`, :func:`from_gpt_oss_down`) and GGUF MXFP4
(:func:`from_gguf`, :func:`to_gguf`). All move bits only.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from freetoken.formats import _fp
from freetoken.formats.base import BankSpec, ExpertFormat

BLOCK = 32
#: OCP MX: the largest e2m1 magnitude is 6 = 1.5 * 2^2, so the shared exponent is floor(log2(amax)) - 2.
E2M1_EMAX = 2
#: Scale byte of an all-zero block (2^0): any valid scale decodes zero codes exactly.
ZERO_BLOCK_SCALE = 127
#: Bytes of one GGUF MXFP4 block: the e8m0 byte, then 16 bytes of nibbles.
GGUF_BLOCK_BYTES = 17


class MXFP4Format(ExpertFormat):
    """OCP MXFP4. Quantize, per block of 32: shared exponent ``floor(log2(amax)) - 2`` clamped to e8m0's
    [-127, 127] (an all-zero block gets 2^0), values the nearest e2m1 of ``w / 2^e`` (ties to even), saturating
    at +-6 as the OCP spec prescribes."""

    name = "mxfp4"
    bits_per_weight = 4.0 + 8.0 / BLOCK
    k_multiple = 32

    def bank_specs(self, n: int, k: int) -> list[BankSpec]:
        return [BankSpec("w", np.dtype(np.uint8), (n, k // 2)),
                BankSpec("s", np.dtype(np.uint8), (n, k // BLOCK))]

    def quantize(self, w: np.ndarray) -> dict[str, np.ndarray]:
        """float32 [E, N, K] -> {"w": uint8 [E, N, K/2], "s": uint8 [E, N, K/32]}."""
        return _fp.quantize_chunked(self, _fp.check_weights(self, w), _quantize)

    def dequantize(self, banks: dict[str, np.ndarray]) -> np.ndarray:
        """Banks -> float32 [E, N, K]."""
        _fp.bank_dims(self, banks, 2)
        return decode(banks["w"], banks["s"])


def shared_exponent(amax: np.ndarray) -> np.ndarray:
    """Unbiased OCP shared exponent (int32) of blocks with max magnitude ``amax`` (0 for all-zero blocks)."""
    _, ex = np.frexp(amax)  # amax = m * 2^ex with m in [0.5, 1): floor(log2(amax)) = ex - 1, exact
    e = np.clip(ex.astype(np.int32) - 1 - E2M1_EMAX, -_fp.E8M0_BIAS, _fp.E8M0_BIAS)
    return np.where(amax > 0, e, ZERO_BLOCK_SCALE - _fp.E8M0_BIAS).astype(np.int32)


def _quantize(w: np.ndarray) -> dict[str, np.ndarray]:
    b = _fp.blocks(w, BLOCK)  # [e, N, K/32, 32]
    e = shared_exponent(np.abs(b).max(axis=-1))
    x = np.ldexp(b, -e[..., None])  # exact division by 2^e
    codes = _fp.e2m1_encode(x)
    return {"w": _fp.pack_nibbles(_fp.unblock(codes)), "s": (e + _fp.E8M0_BIAS).astype(np.uint8)}


def decode(w: np.ndarray, s: np.ndarray) -> np.ndarray:
    """Packed values [..., K/2] and e8m0 scales [..., K/32] -> float32 [..., K]."""
    v = _fp.blocks(_fp.e2m1_decode(_fp.unpack_nibbles(w)), BLOCK)
    with _fp.decode_errstate():
        return _fp.unblock(v * _fp.e8m0_decode(s)[..., None])


FORMAT = MXFP4Format()


# ---- checkpoints ------------------------------------------------------------------------------------------


def _blocks_and_scales(blocks, scales, desc: str) -> tuple[np.ndarray, np.ndarray]:
    """Validate gpt-oss ``*_blocks`` uint8 [E, R, C/32, 16] and ``*_scales`` uint8 [E, R, C/32] -> bank shapes."""
    b = _fp.as_bits(blocks, "blocks", np.uint8)
    _fp.expect_ndim(b, "blocks", 4, f"{desc}/32, 16]")
    if b.shape[3] != BLOCK // 2:
        raise ValueError(f"blocks: wants {desc}/32, 16], got {_fp.shape_str(b.shape)}")
    s = _fp.as_bits(scales, "scales", np.uint8, ml_dtypes.float8_e8m0fnu)
    _fp.expect_shape(s, "scales", b.shape[:3], f"{desc}/32]")
    return b.reshape(b.shape[0], b.shape[1], -1), s


def from_gpt_oss(blocks, scales) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """gpt-oss ``gate_up_proj_blocks`` uint8 [E, 2I, H/32, 16] and ``gate_up_proj_scales`` uint8 [E, 2I, H/32]
    -> (gate banks, up banks), each {"w": [E, I, H/2], "s": [E, I, H/32]}.

    gpt-oss interleaves the rows: gate is rows 0, 2, 4, ..., up is rows 1, 3, 5, ... (the ``gate_up_proj_bias``
    [E, 2I] de-interleaves the same way: ``bias[:, 0::2]`` / ``bias[:, 1::2]``).
    """
    w, s = _blocks_and_scales(blocks, scales, "[E, 2I, H")
    if w.shape[1] % 2:
        raise ValueError(f"blocks: gate_up has an odd number of rows ({w.shape[1]}); wants 2I interleaved rows")
    FORMAT.check_shape(w.shape[1] // 2, 2 * w.shape[2], "gate_up")
    gate = {"w": np.ascontiguousarray(w[:, 0::2]), "s": np.ascontiguousarray(s[:, 0::2])}
    up = {"w": np.ascontiguousarray(w[:, 1::2]), "s": np.ascontiguousarray(s[:, 1::2])}
    return gate, up


def from_gpt_oss_down(blocks, scales) -> dict[str, np.ndarray]:
    """gpt-oss ``down_proj_blocks`` uint8 [E, H, I/32, 16] and ``down_proj_scales`` uint8 [E, H, I/32] -> banks
    {"w": [E, H, I/2], "s": [E, H, I/32]}."""
    w, s = _blocks_and_scales(blocks, scales, "[E, H, I")
    FORMAT.check_shape(w.shape[1], 2 * w.shape[2], "down")
    return {"w": np.ascontiguousarray(w), "s": np.ascontiguousarray(s)}


def from_gguf(raw, shape: tuple[int, int, int] | None = None) -> dict[str, np.ndarray]:
    """GGUF MXFP4 expert tensor -> banks {"w": [E, N, K/2], "s": [E, N, K/32]}, re-packing nibbles losslessly.

    ``raw``: uint8 [E, N, K/32 * 17] (as ``GGUFReader`` gives it: NumPy order, the reverse of ggml's ne), or flat
    bytes with ``shape = (E, N, K)``. A GGUF block is one e8m0 byte, then 16 bytes where byte j holds element j
    (low nibble) and element j + 16 (high nibble); our layout pairs elements 2i, 2i + 1 instead.

    Note: ggml decodes e8m0 255 as 2^128, we decode it as NaN (OCP); ggml's quantizer never writes 255.
    """
    blk = _fp.gguf_blocks(raw, shape, GGUF_BLOCK_BYTES, "MXFP4")
    FORMAT.check_shape(blk.shape[1], blk.shape[2] * BLOCK, "raw")
    qs = blk[..., 1:]
    codes = np.concatenate([qs & np.uint8(15), qs >> np.uint8(4)], axis=-1)  # [E, N, K/32, 32] element order
    w = _fp.pack_nibbles(_fp.unblock(codes))
    return {"w": w, "s": np.ascontiguousarray(blk[..., 0])}


def to_gguf(banks: dict[str, np.ndarray]) -> np.ndarray:
    """Banks -> GGUF MXFP4 bytes uint8 [E, N, K/32 * 17] (inverse of :func:`from_gguf`)."""
    e, n, k = _fp.bank_dims(FORMAT, banks, 2)
    codes = _fp.blocks(_fp.unpack_nibbles(banks["w"]), BLOCK)  # [E, N, K/32, 32]
    qs = codes[..., :16] | (codes[..., 16:] << np.uint8(4))
    out = np.concatenate([banks["s"][..., None], qs], axis=-1)
    return out.reshape(e, n, k // BLOCK * GGUF_BLOCK_BYTES)
