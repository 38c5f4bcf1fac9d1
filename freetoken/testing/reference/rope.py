"""Reference of ``ops.rope`` (HF convention)."""

import numpy as np


def rope_reference(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """float64 ``x * cos + rotate_half(x) * sin`` for x [T, heads, D], cos/sin [T, D];
    rotate_half(x) = concat(-x2, x1) over the two halves of D."""
    x = np.asarray(x, np.float64)
    half = x.shape[-1] // 2
    rotated = np.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * np.asarray(cos, np.float64)[:, None, :] + rotated * np.asarray(sin, np.float64)[:, None, :]
