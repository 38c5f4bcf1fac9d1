"""2-D transpose through a shared-memory tile (``cuda/transpose.cu``, ``cpu_kernels/transpose.py``)."""

from __future__ import annotations

from freetoken.ops._common import as_input, check_int32, cpu_module, cuda_kernel, prepare_out, resolve

_TILE = 32
_ROWS_PER_STEP = 8
_KERNELS = {1: "transpose_u8", 2: "transpose_u16", 4: "transpose_u32", 8: "transpose_u64"}


def transpose(x, *, out=None, device=None):
    """``x.T`` as a new C-contiguous array.

    Parameters
    ----------
    x : array [rows, cols] of any dtype with 1, 2, 4 or 8-byte elements
    out : array [cols, rows] of x's dtype, optional
    device : Device or name, optional (default: auto)
    """
    dev = resolve(device)
    x = as_input(dev, x, "x", None, 2)
    size = x.dtype.itemsize
    if size not in _KERNELS:
        raise TypeError(f"transpose supports 1, 2, 4 and 8-byte elements, got {x.dtype}")
    rows, cols = x.shape
    out = prepare_out(dev, out, (cols, rows), x.dtype)
    if rows == 0 or cols == 0:
        return out
    if dev.kind == "cpu":
        transpose_2d = cpu_module("transpose").transpose_2d

        transpose_2d(x.view(f"u{size}"), out.view(f"u{size}"))
        return out
    grid = (-(-cols // _TILE), -(-rows // _TILE))
    if grid[1] > 65535:
        raise ValueError(f"transpose of {rows} rows exceeds the grid's y limit ({65535 * _TILE} rows)")
    fn = cuda_kernel(dev, "transpose.cu", _KERNELS[size])
    fn(grid, (_TILE, _ROWS_PER_STEP), (x, out, check_int32("rows", rows), check_int32("cols", cols)),
       shared_mem=_TILE * (_TILE + 1) * size)
    return out
