"""RMSNorm over the last axis (``cuda/rms_norm.cu``, ``cpu_kernels/rms_norm.py``): HF LlamaRMSNorm in float32."""

from __future__ import annotations

import numpy as np

from freetoken.device.constants import NORM_THREADS
from freetoken.ops._common import check_int32, cpu_module, cuda_kernel, into_out, prepare_out, resolve


def rms_norm_arrays(xp, x, weight, eps: float):
    """The array-module form (numpy or cupy): ``x / sqrt(mean(x^2) + eps) * weight``, broadcasting ``weight``."""
    var = xp.mean(x * x, axis=-1, keepdims=True)
    return x / xp.sqrt(var + np.float32(eps)) * weight


def rms_norm(x, weight, eps: float, *, out=None, device=None, checked: bool = False):
    """``x * rsqrt(mean(x^2 over the last axis) + eps) * weight`` (HF LlamaRMSNorm, float32).

    Parameters
    ----------
    x : float32 array [..., D]
    weight : float32 array whose shape equals the trailing axes of ``x``: [D], or [H, D] over x [T, H, D] (per-head
        norms), ...
    eps : float
    out : float32 array of x's shape, C-contiguous, optional
    device : Device or name, optional (default: auto)
    checked : the caller vouches for every argument (``device`` a Device, ``x`` and ``weight`` float32 arrays on it
        as described, ``weight`` C-contiguous, ``out`` given, C-contiguous, x's shape): nothing is checked or
        converted (the decoder's blocks, on buffers they made at load time)

    Returns
    -------
    float32 array of x's shape on the device.

    The cpu device runs :func:`freetoken.cpu_kernels.rms_norm.rms_norm_rows` (mean of squares accumulated in float64,
    the rest NumPy's float32 arithmetic) and falls back to array ops for inputs outside that contract (another
    dtype, an empty ``x``); gpu/emu run ``rms_norm_f32`` and refuse such inputs.
    """
    if checked:
        _run(device, x, weight, np.float32(eps), out)
        return out
    dev = resolve(device)
    x, weight = dev.as_array(x, copy_host=True), dev.as_array(weight, copy_host=True)
    if dev.kind == "cpu":
        if (x.dtype == np.float32 and weight.dtype == np.float32 and 1 <= weight.ndim <= x.ndim
                and x.shape[x.ndim - weight.ndim:] == weight.shape and x.size):
            rms_norm_rows = cpu_module("rms_norm").rms_norm_rows

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
    check_int32("rows", x.size // max(1, int(x.shape[-1])))
    check_int32("D", int(x.shape[-1]))
    _run(dev, x, weight, np.float32(eps), y)
    return y


def _run(dev, x, weight, eps: np.float32, y, add=None) -> None:
    """The kernel on checked arguments: ``y = rms_norm(x (+= add))``; x any layout on cpu (viewed or copied as rows,
    written back when ``add`` updates it), C-contiguous on gpu/emu; ``weight`` and ``y`` C-contiguous."""
    d = x.shape[-1]
    if dev.kind == "cpu":
        kernels = cpu_module("rms_norm")
        if add is None:
            kernels.rms_norm_rows(x.reshape(-1, d), weight.reshape(-1, d), eps, y.reshape(-1, d))
        else:
            kernels.add_rms_norm_rows(x.reshape(-1, d), add.reshape(-1, d), weight.reshape(-1, d), eps,
                                      y.reshape(-1, d))
        return
    if x.size == 0:
        return
    rows, wrows = x.size // d, weight.size // d
    threads = min(NORM_THREADS, 32 * -(-d // 32))
    if add is None:
        cuda_kernel(dev, "rms_norm.cu", "rms_norm_f32")(
            (rows,), (threads,), (x, weight, y, np.int32(rows), np.int32(d), np.int32(wrows), eps))
    else:
        cuda_kernel(dev, "rms_norm.cu", "add_rms_norm_f32")(
            (rows,), (threads,), (x, add, weight, y, np.int32(rows), np.int32(d), np.int32(wrows), eps))


def add_rms_norm(x, y, weight, eps: float, *, out=None, device=None, checked: bool = False):
    """The residual add and the next RMSNorm in one pass: ``x += y`` (in place), returns ``rms_norm(x, weight,
    eps)`` (:func:`rms_norm`, bit for bit on the cpu device).

    Parameters
    ----------
    x : float32 array [..., D], C-contiguous: the residual stream, updated in place
    y : float32 array of x's shape (any layout on the cpu device)
    weight : float32 array whose shape equals the trailing axes of ``x`` (as :func:`rms_norm`)
    eps : float
    out : float32 array of x's shape, C-contiguous, not aliasing ``y``, optional
    device : Device or name, optional (default: auto)
    checked : as :func:`rms_norm` (``y`` then C-contiguous too on gpu/emu)

    Returns
    -------
    float32 array of x's shape on the device (``out`` when given).

    The cpu device runs :func:`freetoken.cpu_kernels.rms_norm.add_rms_norm_rows`; gpu/emu run ``add_rms_norm_f32``.
    """
    if checked:
        _run(device, x, weight, np.float32(eps), out, y)
        return out
    dev = resolve(device)
    x, y, weight = dev.as_array(x), dev.as_array(y), dev.as_array(weight, copy_host=True)
    if x.dtype != np.float32 or y.dtype != np.float32 or weight.dtype != np.float32:
        raise TypeError(f"x, y and weight must be float32, got {x.dtype}, {y.dtype} and {weight.dtype}")
    if tuple(y.shape) != tuple(x.shape):
        raise ValueError(f"y shape {tuple(y.shape)} differs from x shape {tuple(x.shape)}")
    if not 1 <= weight.ndim <= x.ndim or tuple(x.shape[x.ndim - weight.ndim:]) != tuple(weight.shape):
        raise ValueError(f"weight shape {tuple(weight.shape)} must equal the trailing axes of x {tuple(x.shape)}")
    if not x.flags.c_contiguous:
        raise ValueError("x (updated in place) must be C-contiguous")
    xp = dev.xp
    if dev.kind != "cpu":
        y = xp.ascontiguousarray(y)
    weight = xp.ascontiguousarray(weight)
    o = prepare_out(dev, out, x.shape, np.float32)
    if x.size == 0:
        return o
    check_int32("rows", x.size // max(1, int(x.shape[-1])))
    check_int32("D", int(x.shape[-1]))
    _run(dev, x, weight, np.float32(eps), o, y)
    return o
