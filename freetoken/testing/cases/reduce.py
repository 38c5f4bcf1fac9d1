"""Parity cases of ``ops.row_sum`` (``cuda/reduce.cu``)."""

from __future__ import annotations

import numpy as np

from freetoken import ops
from freetoken.testing.cases.base import KernelCase, poisoned
from freetoken.testing.reference.reduce import row_sum_reference


# ---- reduce.cu --------------------------------------------------------------------------------------------
def _make_reduce(rng, size):
    rows, cols = (37, 1001) if size == "small" else (8192, 4096)
    return {"x": rng.standard_normal((rows, cols)).astype(np.float32)}


def _setup_reduce(dev, inp):
    x = dev.asarray(inp["x"])
    return {"x": x, "out_sum": poisoned(dev, (x.shape[0],), np.float32)}


def _launch_reduce(dev, st):
    ops.row_sum(st["x"], out=st["out_sum"], device=dev)


CASES = [
    KernelCase("reduce_rows_f32", "reduce.cu", _make_reduce, _setup_reduce, _launch_reduce,
               lambda inp: {"sum": row_sum_reference(inp["x"])}, atol=1e-3, rtol=1e-5,
               bytes_moved=lambda inp: inp["x"].nbytes, op="row_sum"),
]
