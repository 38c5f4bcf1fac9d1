"""Parity cases of ``ops.histogram`` (``cuda/histogram.cu``)."""

from __future__ import annotations

import numpy as np

from freetoken import ops
from freetoken.testing.cases.base import KernelCase, poisoned
from freetoken.testing.reference.histogram import histogram_reference


# ---- histogram.cu -----------------------------------------------------------------------------------------
def _make_hist(rng, size):
    n, nbins = (10007, 61) if size == "small" else (1 << 24, 256)
    return {"ids": rng.integers(-3, nbins + 3, size=n).astype(np.int32), "nbins": nbins}


def _setup_hist(dev, inp):
    return {"ids": dev.asarray(inp["ids"]), "nbins": inp["nbins"],
            "out_counts": poisoned(dev, (inp["nbins"],), np.int32)}


def _launch_hist(dev, st):
    ops.histogram(st["ids"], st["nbins"], out=st["out_counts"], device=dev)


def _ref_hist(inp):
    return {"counts": histogram_reference(inp["ids"], inp["nbins"])}


CASES = [
    KernelCase("histogram_i32", "histogram.cu", _make_hist, _setup_hist, _launch_hist, _ref_hist,
               bytes_moved=lambda inp: inp["ids"].nbytes, op="histogram"),
]
