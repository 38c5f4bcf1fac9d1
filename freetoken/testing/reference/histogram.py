"""Reference of ``ops.histogram``."""

import numpy as np


def histogram_reference(ids: np.ndarray, nbins: int) -> np.ndarray:
    """int32 [nbins]: occurrences of each id in [0, nbins); other ids are not counted."""
    return np.bincount(ids[(ids >= 0) & (ids < nbins)], minlength=nbins).astype(np.int32)
