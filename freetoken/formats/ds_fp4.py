"""ds_fp4: DeepSeek-V4's FP4 routed experts, which are OCP MXFP4 in row-major packing.

Banks and decode are identical to :mod:`freetoken.formats.mxfp4`: ``w`` uint8 [N, K/2] (e2m1 pairs, low nibble =
even k), ``s`` uint8 [N, K/32] (e8m0 bits); ``e2m1(nib(n, k)) * 2^(s[n, k // 32] - 127)``. Quantize is mxfp4's.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from freetoken.formats import _fp
from freetoken.formats.mxfp4 import BLOCK, MXFP4Format


class DSFP4Format(MXFP4Format):
    """DeepSeek-V4 FP4 experts (same banks, decode and quantizer as mxfp4)."""

    name = "ds_fp4"


FORMAT = DSFP4Format()


def from_deepseek(weight, scale) -> dict[str, np.ndarray]:
    """Stacked DeepSeek-V4 expert tensors (``experts.{j}.w{1,2,3}``) -> banks, without conversion.

    ``weight``: packed e2m1 [E, N, K/2] as int8 or uint8 (low nibble = even k); ``scale``: e8m0 [E, N, K/32] as
    uint8 bits or ``ml_dtypes.float8_e8m0fnu``. The expert dimension is required. Returns {"w", "s"} (may share
    memory with the inputs).
    """
    w = _fp.as_bits(weight, "weight", np.uint8, np.int8)
    _fp.expect_ndim(w, "weight", 3, "[E, N, K/2]")
    e, n, half_k = w.shape
    FORMAT.check_shape(n, 2 * half_k, "weight")
    s = _fp.as_bits(scale, "scale", np.uint8, ml_dtypes.float8_e8m0fnu)
    _fp.expect_shape(s, "scale", (e, n, 2 * half_k // BLOCK), "[E, N, K/32]")
    return {"w": np.ascontiguousarray(w), "s": np.ascontiguousarray(s)}
