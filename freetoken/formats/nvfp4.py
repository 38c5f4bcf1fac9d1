"""nvfp4: NVIDIA FP4. e2m1 values, one e4m3fn scale per 16 consecutive K, one float32 global per matrix.

Banks (per expert): ``w`` uint8 [N, K/2] (e2m1 pairs, low nibble = even k), ``s`` uint8 [N, K/16] (e4m3fn bits),
``g`` float32 [] (so the bank is [E]). Decode: ``(e2m1(nib(n, k)) * e4m3(s[n, k // 16])) * g``; the inner product
is exact in float32, so the decode is the correctly rounded product of the three factors.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from freetoken.formats import _fp
from freetoken.formats.base import BankSpec, ExpertFormat

BLOCK = 16


class NVFP4Format(ExpertFormat):
    """NVFP4. Quantize, per matrix (expert): ``g = amax / (6 * 448)`` (1 for an all-zero matrix), block scales
    ``e4m3(amax_block / (6 g))`` rounded to nearest, values the nearest e2m1 of ``w / (scale * g)`` saturating at
    +-6 (blocks whose scale rounds to 0 store zeros)."""

    name = "nvfp4"
    bits_per_weight = 4.0 + 8.0 / BLOCK
    k_multiple = 32

    def bank_specs(self, n: int, k: int) -> list[BankSpec]:
        return [BankSpec("w", np.dtype(np.uint8), (n, k // 2)),
                BankSpec("s", np.dtype(np.uint8), (n, k // BLOCK)),
                BankSpec("g", np.dtype(np.float32), ())]

    def quantize(self, w: np.ndarray) -> dict[str, np.ndarray]:
        """float32 [E, N, K] -> {"w": uint8 [E, N, K/2], "s": uint8 [E, N, K/16], "g": float32 [E]}."""
        return _fp.quantize_chunked(self, _fp.check_weights(self, w), self._quantize)

    @staticmethod
    def _quantize(w: np.ndarray) -> dict[str, np.ndarray]:
        g = np.abs(w).max(axis=(1, 2)) / np.float32(_fp.E2M1_MAX * _fp.E4M3_MAX)
        g = np.where(g > 0, g, np.float32(1.0)).astype(np.float32)  # all-zero (or underflowing) matrix
        g3 = g[:, None, None]
        b = _fp.blocks(w, BLOCK)  # [e, N, K/16, 16]
        s = _fp.e4m3_encode(np.abs(b).max(axis=-1) / (np.float32(_fp.E2M1_MAX) * g3))
        # Divide by the scale as it will be decoded (after e4m3 rounding), so codes are nearest to the decode.
        step = (_fp.e4m3_decode(s) * g3)[..., None]
        x = np.zeros_like(b)
        with np.errstate(over="ignore"):  # a subnormal step can overflow x; e2m1_encode saturates it
            np.divide(b, step, out=x, where=step > 0)
        return {"w": _fp.pack_nibbles(_fp.unblock(_fp.e2m1_encode(x))), "s": s, "g": g}

    def dequantize(self, banks: dict[str, np.ndarray]) -> np.ndarray:
        """Banks -> float32 [E, N, K]."""
        _fp.bank_dims(self, banks, 2)
        v = _fp.blocks(_fp.e2m1_decode(_fp.unpack_nibbles(banks["w"])), BLOCK)  # [E, N, K/16, 16]
        scale = _fp.e4m3_decode(banks["s"])[..., None]
        with _fp.decode_errstate():
            return _fp.unblock(v * scale * banks["g"][:, None, None, None])


FORMAT = NVFP4Format()


def _values_and_scales(weight, weight_scale, names: tuple[str, str]) -> tuple[np.ndarray, np.ndarray]:
    """Validate packed values [E, N, K/2] (uint8) and e4m3 block scales [E, N, K/16]; returns their bits."""
    w = _fp.as_bits(weight, names[0], np.uint8)
    _fp.expect_ndim(w, names[0], 3, "[E, N, K/2]")
    e, n, half_k = w.shape
    FORMAT.check_shape(n, 2 * half_k, names[0])
    s = _fp.as_bits(weight_scale, names[1], np.uint8, ml_dtypes.float8_e4m3fn)
    _fp.expect_shape(s, names[1], (e, n, 2 * half_k // BLOCK), "[E, N, K/16]")
    return np.ascontiguousarray(w), np.ascontiguousarray(s)


def from_modelopt(weight, weight_scale, weight_scale_2) -> dict[str, np.ndarray]:
    """Stacked ModelOpt NVFP4 tensors -> banks, without conversion.

    ``weight``: uint8 [E, N, K/2]; ``weight_scale``: e4m3fn [E, N, K/16] as uint8 bits or
    ``ml_dtypes.float8_e4m3fn``; ``weight_scale_2``: float32 [E] or [E, 1] (ModelOpt's per-matrix scalar, a
    multiplier: it becomes ``g`` as is). The expert dimension is required. Returns {"w", "s", "g"}.
    """
    w, s = _values_and_scales(weight, weight_scale, ("weight", "weight_scale"))
    return {"w": w, "s": s, "g": _fp.per_expert_f32(weight_scale_2, "weight_scale_2", w.shape[0])}


def from_compressed_tensors(weight_packed, weight_scale, weight_global_scale) -> dict[str, np.ndarray]:
    """Stacked compressed-tensors ``nvfp4-pack-quantized`` tensors -> banks.

    ``weight_packed``: uint8 [E, N, K/2]; ``weight_scale``: e4m3fn [E, N, K/16] (uint8 bits or
    ``ml_dtypes.float8_e4m3fn``); ``weight_global_scale``: float32 [E] or [E, 1], a DIVISOR
    (``W = e2m1 * scale / global``). The expert dimension is required.

    We store the multiplier ``g = float32(1 / global)``, which is within half an ulp of the exact reciprocal.
    The decode ``(e2m1 * scale) * g`` therefore differs from the checkpoint's ``(e2m1 * scale) / global`` by at
    most 1 ulp of the decoded weight (the exact product is perturbed by under 1 ulp before the final rounding;
    for power-of-two globals the two are identical; decoded weights in float32's subnormal range can differ by
    1 subnormal step). Raises ValueError when a global's reciprocal is not a finite normal float32 (a zero, inf
    or NaN global, or one so large or small that the reciprocal leaves float32's normal range).
    """
    w, s = _values_and_scales(weight_packed, weight_scale, ("weight_packed", "weight_scale"))
    glob = _fp.per_expert_f32(weight_global_scale, "weight_global_scale", w.shape[0])
    with np.errstate(divide="ignore", over="ignore"):
        g = (np.float32(1.0) / glob).astype(np.float32)
    bad = ~np.isfinite(glob) | ~np.isfinite(g) | (np.abs(g) < np.finfo(np.float32).tiny)
    if bad.any():
        raise ValueError(f"weight_global_scale: experts {np.flatnonzero(bad)[:8].tolist()} have a global "
                         f"({glob[bad][:8].tolist()}) whose float32 reciprocal is not a finite normal number")
    return {"w": w, "s": s, "g": g}
