"""Reference of ``ops.route_softmax_topk``."""

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
