"""Reference of ``ops.transpose``."""

import numpy as np


def transpose_reference(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(np.asarray(x).T)
