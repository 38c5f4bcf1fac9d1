"""Parity cases of ``ops.transpose`` (``cuda/transpose.cu``)."""

from __future__ import annotations

import numpy as np

from freetoken import ops
from freetoken.testing.cases.base import KernelCase, poisoned
from freetoken.testing.reference.transpose import transpose_reference


# ---- transpose.cu -----------------------------------------------------------------------------------------
def _make_transpose(rng, size):
    rows, cols = (70, 45) if size == "small" else (8192, 8192)
    return {"x": rng.standard_normal((rows, cols)).astype(np.float32)}


def _setup_transpose(dev, inp):
    x = dev.asarray(inp["x"])
    return {"x": x, "out_out": poisoned(dev, x.shape[::-1], x.dtype)}


def _launch_transpose(dev, st):
    ops.transpose(st["x"], out=st["out_out"], device=dev)


CASES = [
    KernelCase("transpose_u32", "transpose.cu", _make_transpose, _setup_transpose, _launch_transpose,
               lambda inp: {"out": transpose_reference(inp["x"])}, bytes_moved=lambda inp: 2 * inp["x"].nbytes,
               op="transpose"),
]
