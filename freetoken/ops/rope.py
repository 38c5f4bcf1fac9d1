"""Rotary position embedding, HF convention (``cuda/rope.cu``, ``cpu_kernels/rope.py``)."""

from __future__ import annotations

import numpy as np

from freetoken.ops._common import as_input, check_int32, cuda_kernel, into_out, prepare_out, resolve

_THREADS = 256


def rope_arrays(xp, x, cos, sin):
    """The array-module form (numpy or cupy): ``x * cos + rotate_half(x) * sin`` over x [T, heads, D]."""
    half = x.shape[-1] // 2
    rotated = xp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def rope(x, cos, sin, *, out=None, device=None):
    """Rotate x by position: ``x * cos + rotate_half(x) * sin``, ``rotate_half(x) = concat(-x2, x1)`` over the two
    halves of the head dimension.

    Parameters
    ----------
    x : float32 array [T, heads, D], D even
    cos, sin : float32 arrays [T, D] (frequencies repeated over both halves, as
        :func:`freetoken.models.rope.rope_tables` makes them)
    out : float32 array [T, heads, D], C-contiguous, not aliasing x, optional
    device : Device or name, optional (default: auto)

    Returns
    -------
    float32 array [T, heads, D] on the device.

    The cpu device runs :func:`freetoken.cpu_kernels.rope.rope_rows` (NumPy's float32 arithmetic element for element)
    and falls back to array ops for inputs outside that contract; gpu/emu run ``rope_f32`` and refuse them.
    """
    dev = resolve(device)
    x, cos, sin = dev.as_array(x), dev.as_array(cos), dev.as_array(sin)
    if dev.kind == "cpu":
        if (x.ndim == 3 and x.shape[-1] % 2 == 0 and x.dtype == np.float32 and cos.dtype == sin.dtype == np.float32
                and cos.shape == sin.shape == (x.shape[0], x.shape[2])):
            from freetoken.cpu_kernels.rope import rope_rows

            y = prepare_out(dev, out, x.shape, np.float32)
            rope_rows(x, cos, sin, y)
            return y
        return into_out(dev, out, rope_arrays(np, x, cos, sin))
    x = as_input(dev, x, "x", np.float32, 3)
    t, heads, d = x.shape
    if d % 2:
        raise ValueError(f"head dim {d} must be even")
    cos = as_input(dev, cos, "cos", np.float32, 2)
    sin = as_input(dev, sin, "sin", np.float32, 2)
    if tuple(cos.shape) != (t, d) or tuple(sin.shape) != (t, d):
        raise ValueError(f"cos and sin must be [{t}, {d}], got {tuple(cos.shape)} and {tuple(sin.shape)}")
    y = prepare_out(dev, out, x.shape, np.float32)
    n = t * heads * d
    if n == 0:
        return y
    fn = cuda_kernel(dev, "rope.cu", "rope_f32")
    grid = (check_int32("blocks", -(-n // _THREADS)),)
    fn(grid, (_THREADS,), (x, cos, sin, y, np.int64(n), check_int32("heads", heads), check_int32("D", d)))
    return y
