"""Parity cases of ``ops.rope`` (``cuda/rope.cu``)."""

from __future__ import annotations

import numpy as np

from freetoken import ops
from freetoken.testing.cases.base import KernelCase, poisoned
from freetoken.testing.reference.rope import rope_reference


def _make(rng, size):
    t, heads, d, start = (7, 3, 10, 100) if size == "small" else (512, 40, 128, 4096)  # D/2 odd on small
    x = rng.standard_normal((t, heads, d)).astype(np.float32)
    inv = 1.0 / 10000.0 ** (np.arange(0, d, 2) / d)
    ang = (start + np.arange(t))[:, None] * inv[None, :]
    ang = np.concatenate([ang, ang], axis=-1)
    return {"x": x, "cos": np.cos(ang).astype(np.float32), "sin": np.sin(ang).astype(np.float32)}


def _setup(dev, inp):
    return {"x": dev.asarray(inp["x"]), "cos": dev.asarray(inp["cos"]), "sin": dev.asarray(inp["sin"]),
            "out_y": poisoned(dev, inp["x"].shape, np.float32)}


def _launch(dev, st):
    ops.rope(st["x"], st["cos"], st["sin"], out=st["out_y"], device=dev)


CASES = [
    KernelCase("rope_f32", "rope.cu", _make, _setup, _launch,
               lambda inp: {"y": rope_reference(inp["x"], inp["cos"], inp["sin"])}, atol=1e-6, rtol=1e-6,
               bytes_moved=lambda inp: 2 * inp["x"].nbytes, op="rope"),
]
