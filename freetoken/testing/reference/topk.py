"""Reference of ``ops.topk``."""

import numpy as np


def topk_reference(x: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """(idx int32 [rows, k], val [rows, k]): largest first, ties to the lower index, NaN ranked as -inf."""
    key = np.where(np.isnan(x), -np.inf, x)
    idx = np.argsort(-key, axis=1, kind="stable")[:, :k].astype(np.int32)
    return idx, np.take_along_axis(x, idx, axis=1)
