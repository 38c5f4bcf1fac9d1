"""MoE routing: softmax over router logits, top-k, optional renormalisation (``cuda/routing.cu``,
``cpu_kernels/routing.py``)."""

from __future__ import annotations

import numpy as np

from freetoken.device.constants import ROUTE_WARPS
from freetoken.ops._common import as_input, check_int32, cuda_kernel, prepare_out, resolve


def route_softmax_topk(logits, k: int, renormalize: bool, *, out_ids=None, out_weights=None, device=None,
                       checked: bool = False):
    """Softmax over the last axis (max-subtracted), the k most probable experts, their probabilities as weights.

    Parameters
    ----------
    logits : float32 array [T, E] (the cpu device converts other float dtypes)
    k : 1 <= k <= E
    renormalize : divide the k weights of each row by their sum
    out_ids : int32 array [T, k], optional
    out_weights : float32 array [T, k], optional
    device : Device or name, optional (default: auto)
    checked : the caller vouches for the arguments (``device`` a Device, ``logits`` a C-contiguous float32 [T, E]
        array on it, 1 <= k <= E, ``out_ids`` / ``out_weights`` given as described): nothing is checked (the
        router block, on the output of its gate)

    Returns
    -------
    (ids int32 [T, k], weights float32 [T, k]) on the device: largest probability first, ties to the lower index and
    NaN ranked as -inf (as :func:`freetoken.ops.topk`); a NaN logit makes its row's probabilities NaN.
    """
    if checked:
        _run(device, logits, k, renormalize, out_ids, out_weights)
        return out_ids, out_weights
    dev = resolve(device)
    logits = dev.as_array(logits)
    if logits.ndim != 2:
        raise ValueError(f"logits must be [T, E], got shape {tuple(logits.shape)}")
    rows, n = logits.shape
    if not 1 <= k <= n:
        raise ValueError(f"k={k} must be in [1, {n}] for {n} experts")
    if dev.kind == "cpu":
        logits = np.ascontiguousarray(logits, dtype=np.float32)
    else:
        logits = as_input(dev, logits, "logits", np.float32, 2)
    ids = prepare_out(dev, out_ids, (rows, k), np.int32, "out_ids")
    w = prepare_out(dev, out_weights, (rows, k), np.float32, "out_weights")
    check_int32("rows", rows)
    check_int32("E", n)
    _run(dev, logits, k, renormalize, ids, w)
    return ids, w


def _run(dev, logits, k: int, renormalize: bool, ids, w) -> None:
    """The kernel on checked arguments."""
    if dev.kind == "cpu":
        from freetoken.cpu_kernels.routing import softmax_topk_rows

        softmax_topk_rows(logits, k, bool(renormalize), ids, w)
        return
    rows, n = logits.shape
    if rows == 0:
        return
    fn = cuda_kernel(dev, "routing.cu", "route_softmax_topk_f32")
    fn((-(-rows // ROUTE_WARPS),), (32 * ROUTE_WARPS,),
       (logits, ids, w, np.int32(rows), np.int32(n), np.int32(k), np.int32(bool(renormalize))))
