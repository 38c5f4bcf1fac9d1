"""Reference of ``ops.row_sum``."""

import numpy as np


def row_sum_reference(x: np.ndarray) -> np.ndarray:
    """float64 sum of each row of x [rows, cols]."""
    return np.asarray(x, np.float64).sum(axis=1)
