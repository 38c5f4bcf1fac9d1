"""Helpers every op module uses: resolve the device, check inputs, allocate or check outputs."""

from __future__ import annotations

import functools
import importlib

import numpy as np

from freetoken.device import Device, get_device


@functools.cache
def cpu_module(name: str):
    """``freetoken.cpu_kernels.<name>``, imported on the cpu device's first call: gpu/emu never load Numba's modules,
    and a function-level import would cost every call of a decode step a lookup."""
    import freetoken.cpu_kernels  # noqa: F401 - the import edge ops -> cpu_kernels, as the layering check reads it

    return importlib.import_module(f"freetoken.cpu_kernels.{name}")


def resolve(device: Device | str | None) -> Device:
    return get_device("auto" if device is None else device)


def as_input(dev: Device, x, name: str, dtype=None, ndim: int | None = None):
    """``x`` as a contiguous array on ``dev`` (DLPack accepted; a host array copied to a GPU) with the stated dtype
    and rank."""
    a = dev.as_array(x, copy_host=True)
    if dtype is not None and a.dtype != np.dtype(dtype):
        raise TypeError(f"{name} must be {np.dtype(dtype)}, got {a.dtype}")
    if ndim is not None and a.ndim != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(a.shape)}")
    if not a.flags.c_contiguous:
        a = dev.xp.ascontiguousarray(a)
    return a


def prepare_out(dev: Device, out, shape: tuple, dtype, name: str = "out"):
    """Allocate the output, or check that a caller's ``out`` has the right shape, dtype and layout."""
    if out is None:
        return dev.empty(shape, dtype=dtype)
    o = dev.as_array(out)
    if tuple(o.shape) != tuple(shape) or o.dtype != np.dtype(dtype):
        raise ValueError(f"{name} must be {np.dtype(dtype)} of shape {tuple(shape)}, got {o.dtype} {tuple(o.shape)}")
    if not o.flags.c_contiguous:
        raise ValueError(f"{name} must be C-contiguous")
    return o


def into_out(dev: Device, out, y, name: str = "out"):
    """``y`` (a result computed by array code) itself, or copied into the caller's float32 ``out`` of ``y``'s shape
    after checking it."""
    if out is None:
        return y
    o = prepare_out(dev, out, tuple(y.shape), np.float32, name)
    o[...] = y
    return o


def cuda_kernel(dev: Device, source: str, kernel: str, options: tuple[str, ...] = ()):
    """The launchable ``kernel`` from ``cuda/<source>`` on a CUDA-running device (compiled once, cached)."""
    return dev.load_cuda(source, options).get_function(kernel)


def check_int32(name: str, value: int) -> np.int32:
    if not 0 <= value < 2**31:
        raise ValueError(f"{name}={value} does not fit the kernel's int32 parameter")
    return np.int32(value)
