"""Kernel argument packing, shared by the gpu and emu devices.

Arguments are packed exactly as the CUDA driver's ``kernelParams`` wants them: an array of pointers, each to
the bytes of one argument. The emu device also receives each argument's size and kind so it can reject a
mismatch with the kernel's C++ signature (the GPU would silently read garbage).

Accepted arguments:
  * arrays (device-specific: the caller's ``pointer_of`` returns their address),
  * NumPy scalars of the exact parameter type (``np.int32(n)``, ``np.float32(x)``, ``np.float16``,
    ``ml_dtypes.bfloat16``),
  * NumPy structured scalars (``np.void``) for structs passed by value (build the dtype with ``align=True``).
Python ``int``/``float`` are refused: the parameter's width would be a guess.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np


@dataclass
class PackedArgs:
    params: ctypes.Array  # void*[n], each pointing at one argument's bytes
    sizes: ctypes.Array  # uint64[n]
    kinds: bytes  # one letter per argument: p i u f h b s
    keepalive: list

    @property
    def params_ptr(self) -> int:
        return ctypes.addressof(self.params)


def _scalar_kind(x: np.generic) -> str:
    dt = x.dtype
    if dt.name == "bfloat16":
        return "b"
    if dt == np.float16:
        return "h"
    if dt.kind == "f":
        return "f"
    if dt.kind == "i":
        return "i"
    if dt.kind in "ub":
        return "u"
    if dt.kind == "V" and dt.fields:
        return "s"
    raise TypeError(f"cannot pass a NumPy scalar of dtype {dt} to a kernel")


def pack_args(
    kernel: str, args: Sequence[object], pointer_of: Callable[[object], int | None]
) -> PackedArgs:
    """Pack ``args`` for ``kernel``; ``pointer_of(a)`` returns an array's address or None if ``a`` is no array."""
    n = len(args)
    params = (ctypes.c_void_p * max(n, 1))()
    sizes = (ctypes.c_uint64 * max(n, 1))()
    kinds = []
    keep = []
    for i, a in enumerate(args):
        if isinstance(a, (bool, int, float)) and not isinstance(a, np.generic):  # np.float64 is a float too
            raise TypeError(
                f"kernel {kernel}: argument {i} is a Python {type(a).__name__}; pass a NumPy scalar "
                "(np.int32, np.int64, np.float32, ...) that states the parameter's type"
            )
        if isinstance(a, np.generic):
            kind = _scalar_kind(a)
            raw = np.asarray(a).tobytes()
            buf = ctypes.create_string_buffer(raw, len(raw))
            size = len(raw)
        else:
            ptr = pointer_of(a)
            if ptr is None:
                raise TypeError(
                    f"kernel {kernel}: argument {i} of type {type(a).__name__} is neither an array on this "
                    "device nor a NumPy scalar"
                )
            kind = "p"
            buf = ctypes.c_void_p(ptr)
            size = 8
        keep.append(buf)
        params[i] = ctypes.addressof(buf)
        sizes[i] = size
        kinds.append(kind)
    return PackedArgs(params, sizes, "".join(kinds).encode(), keep)


def normalize_dims(dims: int | Sequence[int], what: str, kernel: str) -> tuple[int, int, int]:
    """``5`` or ``(5,)`` or ``(5, 2)`` -> ``(5, 1, 1)`` / ``(5, 2, 1)``; every entry a positive int."""
    t = (dims,) if isinstance(dims, (int, np.integer)) else tuple(dims)
    if not 1 <= len(t) <= 3:
        raise ValueError(f"kernel {kernel}: {what} must have 1 to 3 dimensions, got {dims!r}")
    t = tuple(int(v) for v in t) + (1,) * (3 - len(t))
    if any(v < 1 for v in t):
        raise ValueError(f"kernel {kernel}: {what} {dims!r} has a dimension below 1")
    return t  # type: ignore[return-value]
