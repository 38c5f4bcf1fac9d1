"""Parity cases of ``ops.topk`` (``cuda/topk.cu``)."""

from __future__ import annotations

import numpy as np

from freetoken import ops
from freetoken.testing.cases.base import KernelCase, poisoned
from freetoken.testing.reference.topk import topk_reference


# ---- topk.cu ----------------------------------------------------------------------------------------------
def _make_topk(rng, size):
    rows, n, k = (19, 129, 8) if size == "small" else (4096, 256, 8)
    x = rng.standard_normal((rows, n)).astype(np.float32)
    x[1, 3] = np.nan
    x[2, :] = 0.5  # all ties: the lowest indices win
    x[3, ::7] = np.float32(2.0)  # repeated maxima
    return {"x": x, "k": k}


def _setup_topk(dev, inp):
    rows, k = inp["x"].shape[0], inp["k"]
    return {"x": dev.asarray(inp["x"]), "k": k, "out_idx": poisoned(dev, (rows, k), np.int32),
            "out_val": poisoned(dev, (rows, k), np.float32)}


def _launch_topk(dev, st):
    ops.topk(st["x"], st["k"], out_idx=st["out_idx"], out_val=st["out_val"], device=dev)


def _ref_topk(inp):
    idx, val = topk_reference(inp["x"], inp["k"])
    return {"idx": idx, "val": val}


CASES = [
    KernelCase("topk_rows_f32", "topk.cu", _make_topk, _setup_topk, _launch_topk, _ref_topk,
               bytes_moved=lambda inp: inp["x"].nbytes, op="topk"),
]
