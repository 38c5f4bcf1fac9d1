"""RMSNorm over the last axis (``cuda/rms_norm.cu``, ``cpu_kernels/rms_norm.py``): HF LlamaRMSNorm in float32."""

from __future__ import annotations

import numpy as np

from freetoken.device.constants import NORM_THREADS
from freetoken.ops._common import check_int32, cuda_kernel, into_out, prepare_out, resolve


def rms_norm_arrays(xp, x, weight, eps: float):
    """The array-module form (numpy or cupy): ``x / sqrt(mean(x^2) + eps) * weight``, broadcasting ``weight``."""
    var = xp.mean(x * x, axis=-1, keepdims=True)
    return x / xp.sqrt(var + np.float32(eps)) * weight


def rms_norm(x, weight, eps: float, *, out=None, device=None):
    """``x * rsqrt(mean(x^2 over the last axis) + eps) * weight`` (HF LlamaRMSNorm, float32).

    Parameters
    ----------
    x : float32 array [..., D]
    weight : float32 array whose shape equals the trailing axes of ``x``: [D], or [H, D] over x [T, H, D] (per-head
        norms), ...
    eps : float
    out : float32 array of x's shape, C-contiguous, optional
    device : Device or name, optional (default: auto)

    Returns
    -------
    float32 array of x's shape on the device.

    The cpu device runs :func:`freetoken.cpu_kernels.rms_norm.rms_norm_rows` (mean of squares accumulated in float64,
    the rest NumPy's float32 arithmetic) and falls back to array ops for inputs outside that contract (another
    dtype, an empty ``x``); gpu/emu run ``rms_norm_f32`` and refuse such inputs.
    """
    dev = resolve(device)
    x, weight = dev.as_array(x), dev.as_array(weight)
    if dev.kind == "cpu":
        if (x.dtype == np.float32 and weight.dtype == np.float32 and 1 <= weight.ndim <= x.ndim
                and x.shape[x.ndim - weight.ndim:] == weight.shape and x.size):
            from freetoken.cpu_kernels.rms_norm import rms_norm_rows

            d = x.shape[-1]
            x2 = np.ascontiguousarray(x).reshape(-1, d)
            y = prepare_out(dev, out, x.shape, np.float32)
            rms_norm_rows(x2, np.ascontiguousarray(weight).reshape(-1, d), np.float32(eps), y.reshape(-1, d))
            return y
        return into_out(dev, out, rms_norm_arrays(np, x, weight, eps))
    if x.dtype != np.float32 or weight.dtype != np.float32:
        raise TypeError(f"x and weight must be float32, got {x.dtype} and {weight.dtype}")
    if not 1 <= weight.ndim <= x.ndim or tuple(x.shape[x.ndim - weight.ndim:]) != tuple(weight.shape):
        raise ValueError(f"weight shape {tuple(weight.shape)} must equal the trailing axes of x {tuple(x.shape)}")
    xp = dev.xp
    x = xp.ascontiguousarray(x)
    weight = xp.ascontiguousarray(weight)
    y = prepare_out(dev, out, x.shape, np.float32)
    d = int(x.shape[-1])
    if x.size == 0:
        return y
    rows, wrows = x.size // d, weight.size // d
    threads = min(NORM_THREADS, 32 * -(-d // 32))
    fn = cuda_kernel(dev, "rms_norm.cu", "rms_norm_f32")
    fn((check_int32("rows", rows),), (threads,), (x, weight, y, np.int32(rows), check_int32("D", d),
                                                  np.int32(wrows), np.float32(eps)))
    return y
