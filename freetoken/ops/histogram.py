"""Counts of each id (``cuda/histogram.cu``, ``cpu_kernels/histogram.py``), e.g. tokens per expert."""

from __future__ import annotations

import numpy as np

from freetoken.ops._common import as_input, check_int32, cpu_module, cuda_kernel, prepare_out, resolve

_MAX_BINS = 101376 // 4  # the per-block counts live in (at most 99 KiB of) shared memory


def histogram(ids, nbins: int, *, out=None, device=None):
    """How often each id in ``[0, nbins)`` occurs; ids outside that range are not counted.

    Parameters
    ----------
    ids : int32 array, any shape
    nbins : 1 <= nbins <= 25344
    out : int32 array [nbins], optional (overwritten)
    device : Device or name, optional (default: auto)

    Returns
    -------
    int32 array [nbins] on the device.
    """
    dev = resolve(device)
    ids = as_input(dev, ids, "ids", np.int32).reshape(-1)
    if not 1 <= nbins <= _MAX_BINS:
        raise ValueError(f"nbins={nbins} must be in [1, {_MAX_BINS}]")
    out = prepare_out(dev, out, (nbins,), np.int32)
    out[...] = 0
    n = ids.shape[0]
    if n == 0:
        return out
    if dev.kind == "cpu":
        histogram_i32 = cpu_module("histogram").histogram_i32

        histogram_i32(ids, out)
        return out
    threads = 256
    grid = min(-(-n // threads), 1024)
    fn = cuda_kernel(dev, "histogram.cu", "histogram_i32")
    fn((grid,), (threads,), (ids, np.int64(n), out, check_int32("nbins", nbins)), shared_mem=4 * nbins)
    return out
