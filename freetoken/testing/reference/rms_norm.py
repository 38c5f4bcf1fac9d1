"""Reference of ``ops.rms_norm`` (HF LlamaRMSNorm)."""

import numpy as np


def rms_norm_reference(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """float64 ``x / sqrt(mean(x^2 over the last axis) + eps) * weight`` (weight: the trailing axes of x)."""
    x = np.asarray(x, np.float64)
    return x / np.sqrt((x * x).mean(axis=-1, keepdims=True) + eps) * np.asarray(weight, np.float64)


def add_rms_norm_reference(x: np.ndarray, y: np.ndarray, weight: np.ndarray,
                           eps: float) -> tuple[np.ndarray, np.ndarray]:
    """(the updated residual ``x + y`` rounded to float32 as the op stores it, :func:`rms_norm_reference` of it)."""
    s = (np.asarray(x, np.float32) + np.asarray(y, np.float32)).astype(np.float32)
    return s, rms_norm_reference(s, weight, eps)
