"""References of ``ops.route_softmax_topk`` and ``ops.route_sigmoid_group_topk``."""

import numpy as np


def route_softmax_topk_reference(logits: np.ndarray, k: int, renormalize: bool) -> tuple[np.ndarray, np.ndarray]:
    """(ids int32 [T, k], weights float64 [T, k]): float64 softmax over the last axis (max-subtracted; a NaN logit
    makes its row NaN), the k largest probabilities (ties to the lower index, NaN ranked as -inf), divided by their
    sum when ``renormalize``."""
    z = np.asarray(logits, np.float64)
    with np.errstate(invalid="ignore"):
        m = np.where(np.isnan(z).any(axis=-1, keepdims=True), np.nan, z.max(axis=-1, keepdims=True))
        p = np.exp(z - m)
        p /= p.sum(axis=-1, keepdims=True)
    key = np.where(np.isnan(p), -np.inf, p)
    ids = np.argsort(-key, axis=1, kind="stable")[:, :k].astype(np.int32)
    w = np.take_along_axis(p, ids, axis=1)
    if renormalize:
        w = w / w.sum(axis=-1, keepdims=True)
    return ids, w


def _group_limited_topk(key: np.ndarray, gscore: np.ndarray, topk_group: int, k: int) -> np.ndarray:
    """ids int32 [T, k]: the k largest ``key [T, E]`` among the experts of each row's ``topk_group`` best groups by
    ``gscore [T, n_group]`` (the others masked to -inf), largest first, ties to the lower index (groups too)."""
    t, n_group = gscore.shape
    gsel = np.argsort(-gscore, axis=1, kind="stable")[:, :topk_group]
    keep = np.zeros((t, n_group), bool)
    np.put_along_axis(keep, gsel, True, axis=1)
    masked = np.where(np.repeat(keep, key.shape[1] // n_group, axis=1), key, -np.inf)
    return np.argsort(-masked, axis=1, kind="stable")[:, :k].astype(np.int32)


def route_sigmoid_group_topk_reference(logits: np.ndarray, bias: np.ndarray, k: int, n_group: int, topk_group: int,
                                       renormalize: bool, scale: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """(ids int32 [T, k], weights float64 [T, k]) of DeepSeek-V3's router in float64, written as transformers writes
    it (group scores from the two best keys, groups masked to -inf) with this package's order: largest first, ties
    to the lower index, NaN keys as -inf."""
    z = np.asarray(logits, np.float64)
    t, n = z.shape
    with np.errstate(over="ignore", invalid="ignore"):
        s = 1.0 / (1.0 + np.exp(-z))
    key = s + np.asarray(bias, np.float64)[None]
    key = np.where(np.isnan(key), -np.inf, key)
    gscore = (-np.sort(-key.reshape(t, n_group, n // n_group), axis=-1)[..., :2]).sum(axis=-1)  # the top two
    ids = _group_limited_topk(key, gscore, topk_group, k)
    w = np.take_along_axis(s, ids, axis=1)
    if renormalize:
        w = w / (w.sum(axis=-1, keepdims=True) + 1e-20)
    return ids, w * scale


def route_softmax_group_topk_reference(logits: np.ndarray, k: int, n_group: int, topk_group: int,
                                       renormalize: bool, scale: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """(ids int32 [T, k], weights float64 [T, k]) of DeepSeek-V2's router in float64, as transformers writes it
    (softmax; a group scored by its largest probability; the other groups masked) with this package's order:
    largest first, ties to the lower index, NaN as -inf."""
    z = np.asarray(logits, np.float64)
    t, n = z.shape
    with np.errstate(invalid="ignore", over="ignore"):
        e = np.exp(z - z.max(axis=-1, keepdims=True))
        p = e / e.sum(axis=-1, keepdims=True)
    key = np.where(np.isnan(p), -np.inf, p)
    ids = _group_limited_topk(key, key.reshape(t, n_group, n // n_group).max(axis=-1), topk_group, k)
    w = np.take_along_axis(p, ids, axis=1)
    if renormalize:
        w = w / w.sum(axis=-1, keepdims=True)
    return ids, w * scale
