"""Kernel argument packing (``freetoken.device.args.pack_args``, what the gpu and emu devices hand the driver): every
parameter type's exact bytes, each argument at an 8-byte-aligned address, its size and kind letter; Python numbers
and unknown objects refused with the argument named."""

import ctypes

import ml_dtypes
import numpy as np
import pytest

from freetoken.device.args import pack_args
from freetoken.device.cpu import host_pointer

SCALARS = [np.int8(-3), np.uint8(250), np.int16(-300), np.uint16(60000), np.int32(-7), np.uint32(4_000_000_000),
           np.int64(-(2**40)), np.uint64(2**63 + 5), np.float16(1.5), np.float32(-2.25), np.float64(3.0e-300),
           np.bool_(True), ml_dtypes.bfloat16(-0.375),
           np.array((7, 2.5), dtype=np.dtype([("a", np.int32), ("b", np.float64)], align=True))[()]]
KINDS = "iuiuiuiuhffubs"  # (a bool travels as an unsigned byte)


def test_every_scalar_type_and_an_array():
    arr = np.arange(4, dtype=np.float32)
    args = [arr, *SCALARS]
    packed = pack_args("k", args, host_pointer)
    assert packed.kinds.decode() == "p" + KINDS
    for i, a in enumerate(args):
        addr = packed.params[i]
        assert addr % 8 == 0, (i, addr)
        if i == 0:
            assert packed.sizes[i] == 8 and ctypes.c_uint64.from_address(addr).value == arr.ctypes.data
            continue
        raw = ctypes.string_at(addr, packed.sizes[i])
        assert packed.sizes[i] == a.dtype.itemsize and raw == a.tobytes(), (i, a, raw)


def test_layouts_do_not_share_call_buffers():
    first = pack_args("k", [np.int32(1), np.float32(2.0)], host_pointer)
    second = pack_args("k", [np.int32(3), np.float32(4.0)], host_pointer)
    assert ctypes.c_int32.from_address(first.params[0]).value == 1  # the first call's bytes kept
    assert ctypes.c_int32.from_address(second.params[0]).value == 3


def test_refusals_name_the_argument():
    with pytest.raises(TypeError, match="argument 1 is a Python int"):
        pack_args("k", [np.int32(1), 2], host_pointer)
    with pytest.raises(TypeError, match="argument 0 is a Python float"):
        pack_args("k", [2.0], host_pointer)
    with pytest.raises(TypeError, match="argument 0 of type str is neither an array"):
        pack_args("k", ["x"], host_pointer)
    with pytest.raises(TypeError, match="cannot pass a NumPy scalar of dtype"):
        pack_args("k", [np.complex64(1)], host_pointer)
