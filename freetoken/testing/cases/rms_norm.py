"""Parity cases of ``ops.rms_norm`` (``cuda/rms_norm.cu``)."""

from __future__ import annotations

import numpy as np

from freetoken import ops
from freetoken.testing.cases.base import KernelCase, poisoned
from freetoken.testing.reference.rms_norm import add_rms_norm_reference, rms_norm_reference


def _make(kind: str):
    def make(rng, size):
        if kind == "rows":  # [T, D] with a [D] weight: the block norms; D not a multiple of 32
            shape, wshape = ((5, 1000), (1000,)) if size == "small" else ((64, 4096), (4096,))
        else:  # per-head q/k norms: x [T, H, D] with a [H, D] weight (one row per head), and a 1-token batch
            shape, wshape = ((3, 5, 24), (5, 24)) if size == "small" else ((16, 40, 128), (40, 128))
        x = (3.0 * rng.standard_normal(shape)).astype(np.float32)
        x[0] *= 1e-3  # a small row: eps matters
        w = (1.0 + 0.1 * rng.standard_normal(wshape)).astype(np.float32)
        return {"x": x, "w": w, "eps": 1e-6}

    def setup(dev, inp):
        return {"x": dev.asarray(inp["x"]), "w": dev.asarray(inp["w"]), "eps": inp["eps"],
                "out_y": poisoned(dev, inp["x"].shape, np.float32)}

    def launch(dev, st):
        ops.rms_norm(st["x"], st["w"], st["eps"], out=st["out_y"], device=dev)

    return KernelCase(f"rms_norm_{kind}", "rms_norm.cu", make, setup, launch,
                      lambda inp: {"y": rms_norm_reference(inp["x"], inp["w"], inp["eps"])}, atol=1e-6, rtol=2e-6,
                      bytes_moved=lambda inp: 2 * inp["x"].nbytes, op="rms_norm")


def _make_add(rng, size):
    shape, wshape = ((5, 1000), (1000,)) if size == "small" else ((64, 4096), (4096,))
    x = (3.0 * rng.standard_normal(shape)).astype(np.float32)
    y = (3.0 * rng.standard_normal(shape)).astype(np.float32)
    y[0] = -x[0] + np.float32(1e-3) * y[0]  # a row that nearly cancels: eps matters
    w = (1.0 + 0.1 * rng.standard_normal(wshape)).astype(np.float32)
    return {"x": x, "y": y, "w": w, "eps": 1e-6}


def _setup_add(dev, inp):
    return {"out_x": dev.asarray(inp["x"].copy()), "y": dev.asarray(inp["y"]), "w": dev.asarray(inp["w"]),
            "eps": inp["eps"], "out_y": poisoned(dev, inp["x"].shape, np.float32)}


def _launch_add(dev, st):
    ops.add_rms_norm(st["out_x"], st["y"], st["w"], st["eps"], out=st["out_y"], device=dev)


def _reference_add(inp):
    s, y = add_rms_norm_reference(inp["x"], inp["y"], inp["w"], inp["eps"])
    return {"x": s, "y": y}


CASES = [_make("rows"), _make("heads"),
         KernelCase("add_rms_norm_rows", "rms_norm.cu", _make_add, _setup_add, _launch_add, _reference_add, atol=1e-6,
                    rtol=2e-6, bytes_moved=lambda inp: 4 * inp["x"].nbytes, op="add_rms_norm")]
