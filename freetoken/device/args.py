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
import functools
import struct
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


@functools.cache
def _scalar_layout(dtype: np.dtype) -> tuple[str, str]:
    """(kind letter, struct code) of a NumPy scalar type; TypeError for one no kernel takes."""
    kind = _scalar_kind(np.zeros((), dtype)[()])
    n = dtype.itemsize
    if kind in "bs":  # bfloat16, structs: their raw bytes
        return kind, f"{n}s"
    # struct's standard sizes ("<"), by kind and width (NumPy's type chars are the platform's C types: "l" is 8
    # bytes on Linux and 4 in struct's standard mode)
    code = {"f": {4: "f", 8: "d"}, "h": {2: "e"}, "i": {1: "b", 2: "h", 4: "i", 8: "q"},
            "u": {1: "B", 2: "H", 4: "I", 8: "Q"}}[kind][n] if dtype.kind != "b" else "?"
    return kind, code


@functools.cache
def _layout(codes: tuple[str, ...]) -> tuple[str, tuple[int, ...], int, ctypes.Array]:
    """For the arguments' struct codes: (struct format, each argument's offset in the buffer, the buffer's size, the
    sizes array) -- one argument per 8-byte-aligned slot (every kernel parameter type is aligned by it). The sizes
    array is shared by every call of the layout: nothing writes it."""
    offsets, at, fmt = [], 0, ["<"]
    sizes = []
    for code in codes:
        size = struct.calcsize("<" + code)
        pad = -at % 8
        fmt.append(f"{pad}x" if pad else "")
        at += pad
        offsets.append(at)
        fmt.append(code)
        sizes.append(size)
        at += size
    n = max(len(codes), 1)
    return "".join(fmt), tuple(offsets), max(at, 8), (ctypes.c_uint64 * n)(*sizes)


def pack_args(
    kernel: str, args: Sequence[object], pointer_of: Callable[[object], int | None]
) -> PackedArgs:
    """Pack ``args`` for ``kernel``; ``pointer_of(a)`` returns an array's address or None if ``a`` is no array.

    The values go into one buffer, each at its own 8-byte-aligned offset, by one ``struct.pack_into``; the layout
    (format, offsets, sizes) is made once per sequence of argument types. The buffer is the call's own (a launch
    reads it during the call: the driver copies the parameters, the emulator runs the kernel before returning)."""
    codes, kinds, values = [], [], []
    for i, a in enumerate(args):
        if isinstance(a, np.generic):
            kind, code = _scalar_layout(a.dtype)
            values.append(a.tobytes() if kind in "bs" else a)
        else:
            if isinstance(a, (bool, int, float)):  # (np.float64 is a float too: caught above)
                raise TypeError(
                    f"kernel {kernel}: argument {i} is a Python {type(a).__name__}; pass a NumPy scalar "
                    "(np.int32, np.int64, np.float32, ...) that states the parameter's type"
                )
            ptr = pointer_of(a)
            if ptr is None:
                raise TypeError(
                    f"kernel {kernel}: argument {i} of type {type(a).__name__} is neither an array on this "
                    "device nor a NumPy scalar"
                )
            kind, code = "p", "Q"
            values.append(ptr)
        codes.append(code)
        kinds.append(kind)
    fmt, offsets, total, sizes = _layout(tuple(codes))
    buf = ctypes.create_string_buffer(total)
    struct.pack_into(fmt, buf, 0, *values)
    base = ctypes.addressof(buf)
    params = (ctypes.c_void_p * max(len(offsets), 1))(*[base + o for o in offsets])
    return PackedArgs(params, sizes, "".join(kinds).encode(), [buf])


def normalize_dims(dims: int | Sequence[int], what: str, kernel: str) -> tuple[int, int, int]:
    """``5`` or ``(5,)`` or ``(5, 2)`` -> ``(5, 1, 1)`` / ``(5, 2, 1)``; every entry a positive int."""
    t = (dims,) if isinstance(dims, (int, np.integer)) else tuple(dims)
    if not 1 <= len(t) <= 3:
        raise ValueError(f"kernel {kernel}: {what} must have 1 to 3 dimensions, got {dims!r}")
    t = tuple(int(v) for v in t) + (1,) * (3 - len(t))
    if any(v < 1 for v in t):
        raise ValueError(f"kernel {kernel}: {what} {dims!r} has a dimension below 1")
    return t  # type: ignore[return-value]
