"""Parity cases for every kernel: inputs, the NumPy reference, tolerance and bytes moved.

One registry serves the test suite (small, awkward shapes on cpu / emu / gpu) and ``bench/gpu_check``
(large shapes on the GPU, timed). Outputs are poisoned before each launch so unwritten elements fail.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from freetoken import ops
from freetoken.testing import poison


@dataclass(frozen=True)
class KernelCase:
    name: str  # the kernel (or kernel family) exercised
    source: str  # its file in cuda/
    make: Callable[[np.random.Generator, str], dict]  # (rng, "small" | "large") -> inputs
    run: Callable[[object, dict], dict]  # (device, inputs) -> host outputs
    reference: Callable[[dict], dict]  # inputs -> expected outputs
    atol: float = 0.0
    rtol: float = 0.0
    bytes_moved: Callable[[dict], int] = lambda inp: 0


def _poisoned(dev, shape, dtype):
    return dev.asarray(poison(shape, dtype))


# ---- reduce.cu --------------------------------------------------------------------------------------------
def _make_reduce(rng, size):
    rows, cols = (37, 1001) if size == "small" else (8192, 4096)
    return {"x": rng.standard_normal((rows, cols)).astype(np.float32)}


def _run_reduce(dev, inp):
    x = dev.asarray(inp["x"])
    out = _poisoned(dev, (x.shape[0],), np.float32)
    ops.row_sum(x, out=out, device=dev)
    return {"sum": dev.to_host(out)}


# ---- topk.cu ----------------------------------------------------------------------------------------------
def _make_topk(rng, size):
    rows, n, k = (19, 129, 8) if size == "small" else (4096, 256, 8)
    x = rng.standard_normal((rows, n)).astype(np.float32)
    x[1, 3] = np.nan
    x[2, :] = 0.5  # all ties: the lowest indices win
    x[3, ::7] = np.float32(2.0)  # repeated maxima
    return {"x": x, "k": k}


def topk_reference(x: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    key = np.where(np.isnan(x), -np.inf, x)
    idx = np.argsort(-key, axis=1, kind="stable")[:, :k].astype(np.int32)
    return idx, np.take_along_axis(x, idx, axis=1)


def _run_topk(dev, inp):
    x = dev.asarray(inp["x"])
    rows, k = x.shape[0], inp["k"]
    idx, val = _poisoned(dev, (rows, k), np.int32), _poisoned(dev, (rows, k), np.float32)
    ops.topk(x, k, out_idx=idx, out_val=val, device=dev)
    return {"idx": dev.to_host(idx), "val": dev.to_host(val)}


def _ref_topk(inp):
    idx, val = topk_reference(inp["x"], inp["k"])
    return {"idx": idx, "val": val}


# ---- histogram.cu -----------------------------------------------------------------------------------------
def _make_hist(rng, size):
    n, nbins = (10007, 61) if size == "small" else (1 << 24, 256)
    return {"ids": rng.integers(-3, nbins + 3, size=n).astype(np.int32), "nbins": nbins}


def _run_hist(dev, inp):
    ids = dev.asarray(inp["ids"])
    out = _poisoned(dev, (inp["nbins"],), np.int32)
    ops.histogram(ids, inp["nbins"], out=out, device=dev)
    return {"counts": dev.to_host(out)}


def _ref_hist(inp):
    ids, nbins = inp["ids"], inp["nbins"]
    return {"counts": np.bincount(ids[(ids >= 0) & (ids < nbins)], minlength=nbins).astype(np.int32)}


# ---- transpose.cu -----------------------------------------------------------------------------------------
def _make_transpose(rng, size):
    rows, cols = (70, 45) if size == "small" else (8192, 8192)
    return {"x": rng.standard_normal((rows, cols)).astype(np.float32)}


def _run_transpose(dev, inp):
    x = dev.asarray(inp["x"])
    out = _poisoned(dev, x.shape[::-1], x.dtype)
    ops.transpose(x, out=out, device=dev)
    return {"out": dev.to_host(out)}


CASES: list[KernelCase] = [
    KernelCase("reduce_rows_f32", "reduce.cu", _make_reduce, _run_reduce,
               lambda inp: {"sum": inp["x"].astype(np.float64).sum(axis=1)}, atol=1e-3, rtol=1e-5,
               bytes_moved=lambda inp: inp["x"].nbytes),
    KernelCase("topk_rows_f32", "topk.cu", _make_topk, _run_topk, _ref_topk,
               bytes_moved=lambda inp: inp["x"].nbytes),
    KernelCase("histogram_i32", "histogram.cu", _make_hist, _run_hist, _ref_hist,
               bytes_moved=lambda inp: inp["ids"].nbytes),
    KernelCase("transpose_u32", "transpose.cu", _make_transpose, _run_transpose,
               lambda inp: {"out": np.ascontiguousarray(inp["x"].T)},
               bytes_moved=lambda inp: 2 * inp["x"].nbytes),
]
