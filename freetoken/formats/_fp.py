"""Low-level helpers shared by the format codecs: small float types, nibble packing, validation.

Decoders here are written from the bit fields (table lookups), not through ``ml_dtypes``, so that the tests,
which decode through ``ml_dtypes``, check them independently. Encoders round to nearest even: e4m3 and bf16
through ``ml_dtypes``' casts (after saturating, because ml_dtypes turns e4m3 overflow into NaN), e2m1 with
explicit midpoints.

Shapes: every function works elementwise on any shape unless its docstring says otherwise.
"""

from __future__ import annotations

from collections.abc import Callable
from fractions import Fraction

import ml_dtypes
import numpy as np

from freetoken.formats.base import ExpertFormat

# ---- e2m1 (FP4) -------------------------------------------------------------------------------------------

#: float32 value of each e2m1 code 0..15 (bit 3 is the sign; code 8 is -0).
E2M1_VALUES = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], dtype=np.float32)
E2M1_MAX = 6.0

# Midpoints between consecutive magnitudes 0, .5, 1, 1.5, 2, 3, 4, 6 and, for each, whether a tie rounds up:
# ties go to the even code (mantissa bit 0), i.e. up exactly when the upper neighbour's code is even.
_E2M1_MIDPOINTS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False))


def e2m1_decode(codes: np.ndarray) -> np.ndarray:
    """uint8 codes (0..15, one per element) -> float32 values."""
    return E2M1_VALUES[codes]


def e2m1_encode(x: np.ndarray) -> np.ndarray:
    """float32 -> uint8 e2m1 codes (0..15): round to nearest, ties to even, saturating at +-6.

    The sign bit follows ``x``'s sign bit, so small negatives become -0 (code 8), as an IEEE cast does.
    NaN is not representable; callers reject it before encoding (it would become +-0 here).
    """
    a = np.minimum(np.abs(x), np.float32(E2M1_MAX))
    code = np.zeros(a.shape, np.uint8)
    for mid, tie_up in _E2M1_MIDPOINTS:
        code += (a >= mid) if tie_up else (a > mid)
    code |= np.signbit(x).astype(np.uint8) << np.uint8(3)
    return code


def pack_nibbles(codes: np.ndarray) -> np.ndarray:
    """uint8 codes [..., 2m] -> bytes [..., m]: byte i holds element 2i (low nibble) and 2i + 1 (high nibble)."""
    codes = codes.astype(np.uint8, copy=False)
    return codes[..., 0::2] | (codes[..., 1::2] << np.uint8(4))


def unpack_nibbles(packed: np.ndarray) -> np.ndarray:
    """Bytes [..., m] -> uint8 codes [..., 2m] (inverse of :func:`pack_nibbles`)."""
    out = np.empty(packed.shape[:-1] + (2 * packed.shape[-1],), np.uint8)
    out[..., 0::2] = packed & np.uint8(15)
    out[..., 1::2] = packed >> np.uint8(4)
    return out


# ---- e4m3fn (FP8) -----------------------------------------------------------------------------------------

E4M3_MAX = 448.0


def _e4m3_table() -> np.ndarray:
    """float32 value of each of the 256 e4m3fn bit patterns: bias 7, subnormals at exponent 0, S.1111.111 NaN."""
    c = np.arange(256)
    sign = np.where(c & 0x80, -1.0, 1.0)
    exp, man = (c >> 3) & 15, c & 7
    mag = np.where(exp == 0, man * 2.0**-9, (1 + man / 8.0) * 2.0 ** (exp - 7))
    mag = np.where((c & 0x7F) == 0x7F, np.nan, mag)
    return (sign * mag).astype(np.float32)


E4M3_TABLE = _e4m3_table()


def e4m3_decode(bits: np.ndarray) -> np.ndarray:
    """uint8 e4m3fn bits -> float32 (0x7F / 0xFF are NaN, 0x80 is -0)."""
    return E4M3_TABLE[bits]


def e4m3_encode(x: np.ndarray) -> np.ndarray:
    """float32 -> uint8 e4m3fn bits, round to nearest even, saturating at +-448 (never NaN for finite x)."""
    x = np.clip(x, -E4M3_MAX, E4M3_MAX)
    return x.astype(ml_dtypes.float8_e4m3fn).view(np.uint8)


# ---- e8m0 (power-of-two scale) ----------------------------------------------------------------------------

E8M0_BIAS = 127
E8M0_NAN = 255


def _e8m0_table() -> np.ndarray:
    """float32 2^(e - 127) for e = 0..254 (e = 0 is the float32 subnormal 2^-127), NaN for 255."""
    t = np.ldexp(np.float32(1.0), np.arange(E8M0_NAN, dtype=np.int32) - E8M0_BIAS).astype(np.float32)
    return np.append(t, np.float32(np.nan))


E8M0_TABLE = _e8m0_table()


def e8m0_decode(bits: np.ndarray) -> np.ndarray:
    """uint8 e8m0 bits -> float32 2^(e - 127) (255 is NaN)."""
    return E8M0_TABLE[bits]


# ---- 16-bit floats ----------------------------------------------------------------------------------------


def bf16_decode(bits: np.ndarray) -> np.ndarray:
    """uint16 bf16 bits -> float32 (exact: bf16 is the top half of a float32)."""
    return (bits.astype(np.uint32) << np.uint32(16)).view(np.float32)


def bf16_encode(x: np.ndarray) -> np.ndarray:
    """float32 -> uint16 bf16 bits, round to nearest even (NaN stays NaN, overflow becomes inf)."""
    return np.asarray(x, np.float32).astype(ml_dtypes.bfloat16).view(np.uint16)


def f16_decode(bits: np.ndarray) -> np.ndarray:
    """uint16 IEEE half bits -> float32 (exact)."""
    return bits.view(np.float16).astype(np.float32)


def decode_errstate() -> np.errstate:
    """Decoding is float32 arithmetic on stored bits: a huge scale overflowing to inf, or 0 * inf = NaN, is the
    defined result (as on the device), not an error worth a warning."""
    return np.errstate(over="ignore", invalid="ignore")


# ---- blocks -----------------------------------------------------------------------------------------------


def blocks(x: np.ndarray, size: int) -> np.ndarray:
    """[..., K] -> [..., K / size, size] (a view; K must be a multiple of ``size``)."""
    return x.reshape(x.shape[:-1] + (x.shape[-1] // size, size))


def unblock(x: np.ndarray) -> np.ndarray:
    """[..., B, size] -> [..., B * size]."""
    return x.reshape(x.shape[:-2] + (x.shape[-2] * x.shape[-1],))


# ---- validation -------------------------------------------------------------------------------------------


def shape_str(shape) -> str:
    return "[" + ", ".join(map(str, shape)) + "]"


def check_weights(fmt: ExpertFormat, w: np.ndarray, finite: bool = True) -> np.ndarray:
    """Validate a quantizer input: a real float array [E, N, K] with K a multiple of ``fmt.k_multiple``.

    Returns it as contiguous float32 (other float dtypes are cast first). With ``finite``, NaN and inf are
    rejected: block formats cannot represent them and one would poison its whole block's scale.
    """
    w = np.asarray(w)
    if not (np.issubdtype(w.dtype, np.floating) or w.dtype == ml_dtypes.bfloat16):
        raise ValueError(f"{fmt.name}.quantize: wants float weights [E, N, K], got dtype {w.dtype}")
    if w.ndim != 3:
        raise ValueError(f"{fmt.name}.quantize: wants [E, N, K] (the expert dimension is required), "
                         f"got shape {shape_str(w.shape)}")
    fmt.check_shape(w.shape[1], w.shape[2], "quantize")
    w = np.ascontiguousarray(w, dtype=np.float32)
    if finite and not np.isfinite(w).all():
        raise ValueError(f"{fmt.name}.quantize: weights contain NaN or inf")
    return w


def bank_dims(fmt: ExpertFormat, banks: dict[str, np.ndarray],
              k_per_column: int | Fraction) -> tuple[int, int, int]:
    """(E, N, K) of a bank dict, inferred from its "w" bank ([E, N, K / k_per_column]), after checking every bank.

    ``k_per_column`` is a :class:`~fractions.Fraction` where a block's quants are not a whole number of bytes per
    weight (GGUF Q5_K: 256 weights in 160 bytes)."""
    w = banks.get("w")
    if w is None:
        raise ValueError(f"{fmt.name} banks missing ['w'] (have {sorted(banks)})")
    if w.ndim != 3:
        raise ValueError(f"w: {fmt.name} wants a bank [E, N, ...] with the expert dimension, got {list(w.shape)}")
    n, k = w.shape[1], w.shape[2] * k_per_column
    if k % fmt.k_multiple:  # also catches a fractional K
        raise ValueError(f"w: {fmt.name} bank of shape {list(w.shape)} means K = {k}, not a multiple of "
                         f"{fmt.k_multiple}")
    e = fmt.check_banks(banks, n, int(k))
    return e, n, int(k)


def as_bits(a, what: str, bits: type, *aliases) -> np.ndarray:
    """``a`` as an array of raw bits of dtype ``bits``; arrays of an ``aliases`` dtype (same width) are viewed.

    For example ``as_bits(x, "weight", np.uint8, ml_dtypes.float8_e4m3fn)`` accepts uint8 bits or e4m3 arrays.
    Nothing is converted by value: that would be a re-quantization.
    """
    a = np.asarray(a)
    if a.dtype == np.dtype(bits):
        return a
    for alias in aliases:
        if a.dtype == np.dtype(alias):
            return a.view(bits)
    names = ", ".join(str(np.dtype(t)) for t in (bits, *aliases))
    raise ValueError(f"{what}: wants raw bits as {names}; got dtype {a.dtype}")


def expect_shape(a: np.ndarray, what: str, shape: tuple[int, ...], desc: str) -> None:
    """Raise ValueError unless ``a.shape == shape``; ``desc`` names the dimensions, e.g. "[E, N, K/2]"."""
    if tuple(a.shape) != tuple(shape):
        raise ValueError(f"{what}: wants {desc} = {shape_str(shape)}, got {shape_str(a.shape)}")


def expect_ndim(a: np.ndarray, what: str, ndim: int, desc: str) -> None:
    """Raise ValueError unless ``a`` has ``ndim`` dimensions (checkpoint tensors must carry the expert dimension)."""
    if a.ndim != ndim:
        raise ValueError(f"{what}: wants {desc} (stacked over experts), got shape {shape_str(a.shape)}")


def per_expert_f32(a, what: str, e: int) -> np.ndarray:
    """A float32 per-expert scalar given as [E] or [E, 1, ...] -> float32 [E] (no value conversion)."""
    a = np.asarray(a)
    if a.dtype != np.float32:
        raise ValueError(f"{what}: wants float32 (one per expert), got dtype {a.dtype}")
    if a.ndim == 0 or a.shape[0] != e or a.size != e:
        raise ValueError(f"{what}: wants one value per expert, [E] or [E, 1] with E = {e}, got {shape_str(a.shape)}")
    return np.ascontiguousarray(a.reshape(e))


#: Weights per GGUF block (Q4_0, MXFP4, Q8_0; the k-quants' super-blocks hold 256).
GGUF_BLOCK = 32


def gguf_blocks(raw, shape, block_bytes: int, what: str, block: int = GGUF_BLOCK) -> np.ndarray:
    """GGUF block bytes as uint8 [E, N, K/block, block_bytes]; ``raw`` is [E, N, K/block * block_bytes] or, with
    ``shape`` = (E, N, K) in NumPy order, any uint8 array of that many bytes. ``block``: weights per block."""
    raw = as_bits(raw, "raw", np.uint8)
    if shape is not None:
        if len(shape) != 3:
            raise ValueError(f"shape: wants (E, N, K) in NumPy order, got {shape}")
        e, n, k = map(int, shape)
        if k % block or raw.size != e * n * (k // block) * block_bytes:
            raise ValueError(f"raw: {raw.size} bytes do not hold a {what} tensor of shape {shape_str(shape)}")
        raw = raw.reshape(e, n, k // block * block_bytes)
    expect_ndim(raw, "raw", 3, f"[E, N, K/{block} * {block_bytes}]")
    if raw.shape[2] % block_bytes:
        raise ValueError(f"raw: rows of {raw.shape[2]} bytes are not whole {what} blocks of {block_bytes} bytes")
    return raw.reshape(raw.shape[0], raw.shape[1], -1, block_bytes)


# ---- chunked quantization ---------------------------------------------------------------------------------

#: Elements quantized at once: bounds the float32 temporaries to a few hundred MiB for big expert stacks.
CHUNK_ELEMENTS = 1 << 24


def quantize_chunked(fmt: ExpertFormat, w: np.ndarray,
                     fn: Callable[[np.ndarray], dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """Apply ``fn`` (float32 [e, N, K] -> banks with leading dim e) to groups of experts of ``w`` [E, N, K].

    The output banks are allocated from ``fmt.bank_specs`` so they always match the schema.
    """
    e, n, k = w.shape
    out = {s.name: np.empty((e,) + s.shape, s.dtype) for s in fmt.bank_specs(n, k)}
    step = max(1, CHUNK_ELEMENTS // (n * k))
    for e0 in range(0, e, step):
        part = fn(w[e0:e0 + step])
        for name, bank in out.items():
            bank[e0:e0 + step] = part[name]
    return out
