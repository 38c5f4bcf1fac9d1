"""Top-k of each row (``cuda/topk.cu``, ``cpu_kernels/topk.py``): the selection step of MoE routing."""

from __future__ import annotations

import numpy as np

from freetoken.ops._common import as_input, check_int32, cpu_module, cuda_kernel, prepare_out, resolve

_WARPS_PER_BLOCK = 4


def topk(x, k: int, *, out_idx=None, out_val=None, device=None):
    """The k largest entries of each row, largest first; ties go to the lower index; NaN ranks as -inf.

    Parameters
    ----------
    x : float32 array [rows, n]
    k : 1 <= k <= n
    out_idx : int32 array [rows, k], optional
    out_val : float32 array [rows, k], optional (the original values, NaN included)
    device : Device or name, optional (default: auto)

    Returns
    -------
    (idx, val): int32 [rows, k] and float32 [rows, k] on the device.
    """
    dev = resolve(device)
    x = as_input(dev, x, "x", np.float32, 2)
    rows, n = x.shape
    if not 1 <= k <= n:
        raise ValueError(f"k={k} must be in [1, {n}] for rows of {n} elements")
    idx = prepare_out(dev, out_idx, (rows, k), np.int32, "out_idx")
    val = prepare_out(dev, out_val, (rows, k), np.float32, "out_val")
    if rows == 0:
        return idx, val
    if dev.kind == "cpu":
        topk_rows_f32 = cpu_module("topk").topk_rows_f32

        topk_rows_f32(x, k, idx, val)
        return idx, val
    fn = cuda_kernel(dev, "topk.cu", "topk_rows_f32")
    grid = -(-rows // _WARPS_PER_BLOCK)
    fn((grid,), (32 * _WARPS_PER_BLOCK,), (x, idx, val, check_int32("rows", rows), check_int32("n", n), np.int32(k)))
    return idx, val
