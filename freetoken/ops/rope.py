"""Rotary position embedding, HF convention (``cuda/rope.cu``, ``cpu_kernels/rope.py``): :func:`rope`, and
:func:`rope_qkv_cache` (a fused q/k/v projection normed, rotated and written into the KV cache in one pass)."""

from __future__ import annotations

import numpy as np

from freetoken.device.constants import NORM_THREADS
from freetoken.ops._common import as_input, check_int32, cpu_module, cuda_kernel, into_out, prepare_out, resolve

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
    x, cos, sin = (dev.as_array(a, copy_host=True) for a in (x, cos, sin))
    if dev.kind == "cpu":
        if (x.ndim == 3 and x.shape[-1] % 2 == 0 and x.dtype == np.float32 and cos.dtype == sin.dtype == np.float32
                and cos.shape == sin.shape == (x.shape[0], x.shape[2])):
            rope_rows = cpu_module("rope").rope_rows

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


def rope_qkv_cache(qkv, norm, eps: float, cos, sin, k_cache, v_cache, start: int, *, out=None, device=None,
                   checked: bool = False):
    """A fused q/k/v projection into attention's inputs in one pass: q and k heads RMS-normed per head (Qwen3's
    q/k norms; ``norm`` None: as projected), rotated (:func:`rope`), the keys and values written into the KV cache.

    Parameters
    ----------
    qkv : float32 array [T, (H + 2 Hkv) D] (or [T, H + 2 Hkv, D]), C-contiguous: q heads, k heads, v heads
    norm : float32 array [H + Hkv, D] (the q weight repeated over the q heads, then the k weight over the k heads),
        or None
    eps : float (the norm's)
    cos, sin : float32 arrays [T, D]: the tables' rows of positions start .. start + T - 1
    k_cache, v_cache : float32 arrays [rows, Hkv, D], C-contiguous, rows >= start + T: rows start .. start + T - 1
        receive the rotated keys and the values
    start : int >= 0
    out : float32 array [T, H, D], C-contiguous, optional: the rotated queries
    device : Device or name, optional (default: auto)
    checked : the caller vouches for every argument (``device`` a Device, the arrays on it as described, ``out``
        given): nothing is checked or converted (the attention block, on buffers it made at load time)

    Returns
    -------
    float32 array [T, H, D] on the device: the rotated queries (``out`` when given).

    Bit for bit what :func:`freetoken.ops.rms_norm` over the q/k heads, :func:`rope` and copies of the k/v rows
    into the caches compute one after the other (cpu: :func:`freetoken.cpu_kernels.rope.rope_qkv_cache_rows`;
    gpu/emu: ``rope_qkv_cache_f32`` with rms_norm_f32's block size).
    """
    if not checked:
        dev = resolve(device)
        k_cache, v_cache = as_input(dev, k_cache, "k_cache", np.float32, 3), as_input(dev, v_cache, "v_cache",
                                                                                      np.float32, 3)
        if k_cache.shape != v_cache.shape:
            raise ValueError(f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} differ")
        if not (k_cache.flags.c_contiguous and v_cache.flags.c_contiguous):
            raise ValueError("k_cache and v_cache (written in place) must be C-contiguous")
        rows, kv_heads, d = k_cache.shape
        qkv = as_input(dev, qkv, "qkv", np.float32)
        t = qkv.shape[0]
        width = qkv.shape[1] * (qkv.shape[2] if qkv.ndim == 3 else 1)
        if qkv.ndim not in (2, 3) or d == 0 or d % 2 or width % d or width // d <= 2 * kv_heads or (
                qkv.ndim == 3 and qkv.shape[2] != d):
            raise ValueError(f"qkv {tuple(qkv.shape)} must be [T, (H + 2 Hkv) D] with H > 0 for caches of "
                             f"{kv_heads} heads of even dimension {d}")
        if d > 4 * NORM_THREADS:
            raise ValueError(f"head dim {d} exceeds {4 * NORM_THREADS}")
        heads = width // d - 2 * kv_heads
        if norm is not None:
            norm = as_input(dev, norm, "norm", np.float32)
            if tuple(norm.shape) != (heads + kv_heads, d):
                raise ValueError(f"norm must be [{heads + kv_heads}, {d}], got {tuple(norm.shape)}")
        cos = as_input(dev, cos, "cos", np.float32, 2)
        sin = as_input(dev, sin, "sin", np.float32, 2)
        if tuple(cos.shape) != (t, d) or tuple(sin.shape) != (t, d):
            raise ValueError(f"cos and sin must be [{t}, {d}], got {tuple(cos.shape)} and {tuple(sin.shape)}")
        start = int(start)
        if start < 0 or start + t > rows:
            raise ValueError(f"rows start={start} .. start + T={start + t} do not fit caches of {rows} rows")
        check_int32("start + T", start + t)
        out = prepare_out(dev, out, (t, heads, d), np.float32)
        device = dev
    if qkv.shape[0] == 0:
        return out
    _, heads, d = out.shape
    kv_heads = k_cache.shape[1]
    qkv = qkv.reshape(qkv.shape[0], heads + 2 * kv_heads, d)
    if device.kind == "cpu":
        rope_qkv_cache_rows = cpu_module("rope").rope_qkv_cache_rows

        rope_qkv_cache_rows(qkv, _no_norm(d) if norm is None else norm, norm is not None, np.float32(eps), cos,
                            sin, k_cache, v_cache, start, out)
        return out
    threads = min(NORM_THREADS, 32 * -(-d // 32))
    cuda_kernel(device, "rope.cu", "rope_qkv_cache_f32")(
        (qkv.shape[0], heads + 2 * kv_heads), (threads,),
        (qkv, qkv if norm is None else norm, np.int32(norm is not None), np.float32(eps), cos, sin, k_cache, v_cache,
         np.int32(start), out, np.int32(heads), np.int32(kv_heads), np.int32(d)))
    return out


_NO_NORM: dict[int, np.ndarray] = {}


def _no_norm(d: int) -> np.ndarray:
    """The cpu kernel's placeholder weight where there is no norm."""
    w = _NO_NORM.get(d)
    if w is None:
        w = _NO_NORM[d] = np.ones((1, d), np.float32)
    return w
