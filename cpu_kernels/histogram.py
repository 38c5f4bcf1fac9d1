"""Id counts on the CPU (the cpu twin of ``cuda/histogram.cu``)."""

import numba as nb


@nb.njit(error_model="numpy", cache=True)
def histogram_i32(ids, counts):
    nbins = counts.shape[0]
    for i in range(ids.shape[0]):
        v = ids[i]
        if 0 <= v < nbins:
            counts[v] += 1
