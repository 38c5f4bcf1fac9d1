"""bf16: plain bfloat16 matrices, stored as uint16 bits.

Banks (per expert): ``w`` uint16 [N, K] (bf16 bits). Decode: ``bf16(w[n, k])`` (exact in float32).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from freetoken.formats import _fp
from freetoken.formats.base import BankSpec, ExpertFormat


class BF16Format(ExpertFormat):
    """bfloat16 weights: quantize rounds to nearest even (NaN and inf are kept, as bf16 can hold them)."""

    name = "bf16"
    bits_per_weight = 16.0
    k_multiple = 32

    def bank_specs(self, n: int, k: int) -> list[BankSpec]:
        return [BankSpec("w", np.dtype(np.uint16), (n, k))]

    def quantize(self, w: np.ndarray) -> dict[str, np.ndarray]:
        """float32 [E, N, K] -> {"w": uint16 [E, N, K]}."""
        w = _fp.check_weights(self, w, finite=False)
        return {"w": _fp.bf16_encode(w)}

    def dequantize(self, banks: dict[str, np.ndarray]) -> np.ndarray:
        """{"w": uint16 [E, N, K]} -> float32 [E, N, K]."""
        _fp.bank_dims(self, banks, 1)
        return _fp.bf16_decode(banks["w"])


FORMAT = BF16Format()


def from_hf(weight) -> dict[str, np.ndarray]:
    """A stacked HF bf16 expert weight -> banks, without conversion.

    ``weight``: [E, N, K] as uint16 bits or ``ml_dtypes.bfloat16`` (the expert dimension is required: stack
    single matrices with ``w[None]``). Returns {"w": uint16 [E, N, K]} (may share memory with ``weight``).
    """
    w = _fp.as_bits(weight, "weight", np.uint16, ml_dtypes.bfloat16)
    _fp.expect_ndim(w, "weight", 3, "[E, N, K]")
    FORMAT.check_shape(w.shape[1], w.shape[2], "weight")
    return {"w": np.ascontiguousarray(w)}
