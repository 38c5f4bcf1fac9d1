"""MoE routing (``cuda/routing.cu``, ``cpu_kernels/routing.py``): softmax over router logits, top-k, optional
renormalisation (:func:`route_softmax_topk`: Qwen, Mixtral, OLMoE); sigmoid scores with a selection bias and
group-limited top-k (:func:`route_sigmoid_group_topk`: DeepSeek-V3, Kimi-K2, GLM-4.5); softmax with group-limited or
plain greedy top-k and a scale (:func:`route_softmax_group_topk`: DeepSeek-V2)."""

from __future__ import annotations

import numpy as np

from freetoken.device.constants import ROUTE_WARPS
from freetoken.ops._common import as_input, check_int32, cpu_module, cuda_kernel, prepare_out, resolve


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
    logits = dev.as_array(logits, copy_host=True)
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
        softmax_topk_rows = cpu_module("routing").softmax_topk_rows

        softmax_topk_rows(logits, k, bool(renormalize), ids, w)
        return
    rows, n = logits.shape
    if rows == 0:
        return
    fn = cuda_kernel(dev, "routing.cu", "route_softmax_topk_f32")
    fn((-(-rows // ROUTE_WARPS),), (32 * ROUTE_WARPS,),
       (logits, ids, w, np.int32(rows), np.int32(n), np.int32(k), np.int32(bool(renormalize))))


#: Most expert groups route_sigmoid_group_topk takes (one warp lane holds each group's score).
MAX_EXPERT_GROUPS = 32


def check_groups(n: int, k: int, n_group: int, topk_group: int) -> None:
    """ValueError unless ``n`` experts split into ``n_group`` equal groups of at least two (a group scores by its
    two best experts), ``topk_group`` of them in play can hold ``k`` experts."""
    if not 1 <= n_group <= min(n, MAX_EXPERT_GROUPS):
        raise ValueError(f"n_group={n_group} must be in [1, {min(n, MAX_EXPERT_GROUPS)}] for {n} experts")
    if n % n_group or n // n_group < 2:
        raise ValueError(f"{n} experts do not split into {n_group} equal groups of at least 2")
    if not 1 <= topk_group <= n_group:
        raise ValueError(f"topk_group={topk_group} must be in [1, n_group={n_group}]")
    if not 1 <= k <= topk_group * (n // n_group):
        raise ValueError(f"k={k} must be in [1, {topk_group * (n // n_group)}]: {topk_group} group(s) of "
                         f"{n // n_group} experts are in play")


def _checked_group_outputs(dev, logits, k, n_group, topk_group, scale, out_ids, out_weights):
    """The group routers' shared checks: (scale as a float, ids [T, k], weights [T, k] on the device)."""
    rows, n = logits.shape
    check_groups(n, k, n_group, topk_group)
    scale = float(scale)
    if not np.isfinite(scale):
        raise ValueError(f"scale={scale} is not finite")
    ids = prepare_out(dev, out_ids, (rows, k), np.int32, "out_ids")
    w = prepare_out(dev, out_weights, (rows, k), np.float32, "out_weights")
    check_int32("rows", rows)
    check_int32("E", n)
    return scale, ids, w


def route_sigmoid_group_topk(logits, bias, k: int, n_group: int, topk_group: int, renormalize: bool,
                             scale: float = 1.0, *, out_ids=None, out_weights=None, device=None,
                             checked: bool = False):
    """DeepSeek-V3's router (also Kimi-K2's and GLM-4.5's), as transformers computes it in float32.

    Scores ``s = sigmoid(logit)``; selection keys ``s + bias`` (``e_score_correction_bias``: it steers which experts
    are chosen, not their weights). The experts form ``n_group`` equal consecutive groups; a group's score is the sum
    of its two largest keys; the experts of the ``topk_group`` best groups stay in play and the k largest keys among
    them are chosen. Their weights are their scores ``s``, divided by (the k scores' sum + 1e-20) when
    ``renormalize`` (``norm_topk_prob``), then times ``scale`` (``routed_scaling_factor``).

    Parameters
    ----------
    logits : float32 array [T, E]
    bias : float32 array [E] (zeros for a router without one)
    k, n_group, topk_group : see :func:`check_groups`
    renormalize : bool
    scale : float
    out_ids : int32 array [T, k], optional
    out_weights : float32 array [T, k], optional
    device : Device or name, optional (default: auto)
    checked : the caller vouches for the arguments (the router block, on its gate's output): nothing is checked

    Returns
    -------
    (ids int32 [T, k], weights float32 [T, k]) on the device: largest key first, ties to the lower index, NaN keys
    ranked as -inf (for groups and experts alike); a NaN logit gives its expert a NaN weight if chosen.
    """
    if checked:
        _run_group(device, logits, bias, k, n_group, topk_group, renormalize, scale, out_ids, out_weights)
        return out_ids, out_weights
    dev = resolve(device)
    logits = as_input(dev, logits, "logits", np.float32, 2)
    bias = as_input(dev, bias, "bias", np.float32, 1)
    if bias.shape[0] != logits.shape[1]:
        raise ValueError(f"bias has {bias.shape[0]} entries for {logits.shape[1]} experts")
    scale, ids, w = _checked_group_outputs(dev, logits, k, n_group, topk_group, scale, out_ids, out_weights)
    _run_group(dev, logits, bias, k, n_group, topk_group, renormalize, scale, ids, w)
    return ids, w


def _run_group(dev, logits, bias, k, n_group, topk_group, renormalize, scale, ids, w) -> None:
    if dev.kind == "cpu":
        sigmoid_group_topk_rows = cpu_module("routing").sigmoid_group_topk_rows

        sigmoid_group_topk_rows(logits, bias, k, n_group, topk_group, bool(renormalize), scale, ids, w)
        return
    rows, n = logits.shape
    if rows == 0:
        return
    fn = cuda_kernel(dev, "routing.cu", "route_sigmoid_group_topk_f32")
    fn((-(-rows // ROUTE_WARPS),), (32 * ROUTE_WARPS,),
       (logits, bias, ids, w, np.int32(rows), np.int32(n), np.int32(k), np.int32(n_group), np.int32(topk_group),
        np.int32(bool(renormalize)), np.float32(scale)))


def route_softmax_group_topk(logits, k: int, n_group: int, topk_group: int, renormalize: bool, scale: float = 1.0,
                             *, out_ids=None, out_weights=None, device=None, checked: bool = False):
    """DeepSeek-V2's router, as transformers computes it in float32: softmax probabilities over the experts; with
    ``n_group`` > 1 ("group_limited_greedy") the experts form equal consecutive groups, a group's score is its
    largest probability, and only the ``topk_group`` best groups' experts stay in play ("greedy": one group); the k
    largest probabilities among them are chosen, their weights the probabilities, divided by their sum when
    ``renormalize``, then times ``scale`` (``routed_scaling_factor``).

    Parameters and returns as :func:`route_sigmoid_group_topk`, without the bias; NaN probabilities are ranked as
    -inf (a NaN logit makes its row's probabilities NaN, as a NumPy softmax does)."""
    if checked:
        _run_softmax_group(device, logits, k, n_group, topk_group, renormalize, scale, out_ids, out_weights)
        return out_ids, out_weights
    dev = resolve(device)
    logits = as_input(dev, logits, "logits", np.float32, 2)
    scale, ids, w = _checked_group_outputs(dev, logits, k, n_group, topk_group, scale, out_ids, out_weights)
    _run_softmax_group(dev, logits, k, n_group, topk_group, renormalize, scale, ids, w)
    return ids, w


def _run_softmax_group(dev, logits, k, n_group, topk_group, renormalize, scale, ids, w) -> None:
    if dev.kind == "cpu":
        softmax_group_topk_rows = cpu_module("routing").softmax_group_topk_rows

        softmax_group_topk_rows(logits, k, n_group, topk_group, bool(renormalize), scale, ids, w)
        return
    rows, n = logits.shape
    if rows == 0:
        return
    fn = cuda_kernel(dev, "routing.cu", "route_softmax_group_topk_f32")
    fn((-(-rows // ROUTE_WARPS),), (32 * ROUTE_WARPS,),
       (logits, ids, w, np.int32(rows), np.int32(n), np.int32(k), np.int32(n_group), np.int32(topk_group),
        np.int32(bool(renormalize)), np.float32(scale)))
