"""Row sums (``cuda/reduce.cu``, ``cpu_kernels/reduce.py``)."""

from __future__ import annotations

import numpy as np

from freetoken.ops._common import as_input, check_int32, cpu_module, cuda_kernel, prepare_out, resolve


def row_sum(x, *, out=None, device=None):
    """Sum of each row.

    Parameters
    ----------
    x : float32 array [rows, cols]
    out : float32 array [rows], optional
    device : Device or name, optional (default: auto)

    Returns
    -------
    float32 array [rows] on the device.
    """
    dev = resolve(device)
    x = as_input(dev, x, "x", np.float32, 2)
    rows, cols = x.shape
    out = prepare_out(dev, out, (rows,), np.float32)
    if rows == 0:
        return out
    if dev.kind == "cpu":
        row_sum_f32 = cpu_module("reduce").row_sum_f32

        row_sum_f32(x, out)
        return out
    threads = min(1024, max(32, 32 * -(-min(cols, 256) // 32)))
    fn = cuda_kernel(dev, "reduce.cu", "reduce_rows_f32")
    fn((rows,), (threads,), (x, out, check_int32("rows", rows), check_int32("cols", cols)))
    return out
