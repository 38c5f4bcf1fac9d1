"""fp8_block: DeepSeek-V3 style FP8 (e4m3fn) with one float32 scale per 128 x 128 block.

Banks (per expert): ``w`` uint8 [N, K] (e4m3fn bits), ``s`` float32 [ceil(N/128), ceil(K/128)].
Decode: ``e4m3(w[n, k]) * s[n // 128, k // 128]`` (one float32 rounding). Edge blocks are partial when N or K
is not a multiple of 128.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from freetoken.formats import _fp
from freetoken.formats.base import BankSpec, ExpertFormat

BLOCK = 128
#: The float32 value of every e4m3fn code (0x7F and 0xFF are NaN): what the CPU kernels and the dense FP8 rows
#: (:mod:`freetoken.models.qmatrix`) look codes up in.
E4M3_VALUES = _fp.E4M3_TABLE


def _nblocks(x: int) -> int:
    return -(-x // BLOCK)


def expand_scales(s: np.ndarray, n: int, k: int) -> np.ndarray:
    """Block scales [E, ceil(N/128), ceil(K/128)] -> per-element scales [E, N, K]."""
    return np.repeat(np.repeat(s, BLOCK, axis=1)[:, :n], BLOCK, axis=2)[:, :, :k]


def block_amax(w: np.ndarray) -> np.ndarray:
    """max |w| of each 128 x 128 block (partial at the edges): [E, N, K] -> [E, ceil(N/128), ceil(K/128)]."""
    a = np.abs(w)
    a = np.maximum.reduceat(a, np.arange(0, w.shape[1], BLOCK), axis=1)
    return np.maximum.reduceat(a, np.arange(0, w.shape[2], BLOCK), axis=2)


class FP8BlockFormat(ExpertFormat):
    """Block FP8. Quantize: ``s = amax / 448`` per block, values ``e4m3(w / s)`` rounded to nearest even.

    A block whose ``amax / 448`` is 0 (all zeros, or so tiny that the division underflows) gets ``s = 1``:
    any finite positive scale decodes its zero codes exactly, and 1 keeps the decode free of 0 * NaN hazards.
    """

    name = "fp8_block"
    bits_per_weight = 8.0 + 32.0 / (BLOCK * BLOCK)
    k_multiple = 32

    def bank_specs(self, n: int, k: int) -> list[BankSpec]:
        return [BankSpec("w", np.dtype(np.uint8), (n, k)),
                BankSpec("s", np.dtype(np.float32), (_nblocks(n), _nblocks(k)))]

    def quantize(self, w: np.ndarray) -> dict[str, np.ndarray]:
        """float32 [E, N, K] -> {"w": uint8 [E, N, K], "s": float32 [E, ceil(N/128), ceil(K/128)]}."""
        return _fp.quantize_chunked(self, _fp.check_weights(self, w), self._quantize)

    @staticmethod
    def _quantize(w: np.ndarray) -> dict[str, np.ndarray]:
        s = block_amax(w) / np.float32(_fp.E4M3_MAX)
        s = np.where(s > 0, s, np.float32(1.0)).astype(np.float32)
        with np.errstate(over="ignore"):  # w / s can overflow only for subnormal s; e4m3_encode saturates it
            q = _fp.e4m3_encode(w / expand_scales(s, w.shape[1], w.shape[2]))
        return {"w": q, "s": s}

    def dequantize(self, banks: dict[str, np.ndarray]) -> np.ndarray:
        """Banks -> float32 [E, N, K]."""
        _, n, k = _fp.bank_dims(self, banks, 1)
        with _fp.decode_errstate():
            return _fp.e4m3_decode(banks["w"]) * expand_scales(banks["s"], n, k)


FORMAT = FP8BlockFormat()


def from_hf(weight, weight_scale_inv) -> dict[str, np.ndarray]:
    """Stacked HF block-FP8 tensors -> banks, without conversion.

    ``weight``: [E, N, K] e4m3fn, as uint8 bits or ``ml_dtypes.float8_e4m3fn``.
    ``weight_scale_inv``: float32 [E, ceil(N/128), ceil(K/128)] (multiplied, despite its name).
    The expert dimension is required. Returns {"w", "s"} (may share memory with the inputs).
    """
    w = _fp.as_bits(weight, "weight", np.uint8, ml_dtypes.float8_e4m3fn)
    _fp.expect_ndim(w, "weight", 3, "[E, N, K]")
    e, n, k = w.shape
    FORMAT.check_shape(n, k, "weight")
    s = np.asarray(weight_scale_inv)
    if s.dtype != np.float32:
        raise ValueError(f"weight_scale_inv: wants float32, got dtype {s.dtype}")
    _fp.expect_shape(s, "weight_scale_inv", (e, _nblocks(n), _nblocks(k)), "[E, ceil(N/128), ceil(K/128)]")
    return {"w": np.ascontiguousarray(w), "s": np.ascontiguousarray(s)}
