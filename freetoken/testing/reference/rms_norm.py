"""Reference of ``ops.rms_norm`` (HF LlamaRMSNorm)."""

import numpy as np


def rms_norm_reference(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """float64 ``x / sqrt(mean(x^2 over the last axis) + eps) * weight`` (weight: the trailing axes of x)."""
    x = np.asarray(x, np.float64)
    return x / np.sqrt((x * x).mean(axis=-1, keepdims=True) + eps) * np.asarray(weight, np.float64)
