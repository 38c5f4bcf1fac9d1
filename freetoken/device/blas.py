"""Host BLAS on one thread while freetoken's own kernels run.

The cpu device's expert kernels (Numba) and the emu device's blocks run on their own thread pools; NumPy's BLAS
(OpenBLAS) keeps a second pool whose threads spin after every call. On a small machine the two pools fight for
the same cores: measured on 2 cores, a 16-layer q4_0 decode step ran at 4.8 tok/s with OpenBLAS on 2 threads and
77 tok/s with it on 1 (prefill of 64 tokens: 163 vs 277 tok/s). The decoder's host matmuls are small (one token's
projections), so one BLAS thread costs nothing and the kernels get the cores.
"""

from __future__ import annotations

import contextlib
from functools import lru_cache


@lru_cache(maxsize=1)
def _controller():
    import numpy  # noqa: F401  (the controller sees the BLAS libraries loaded when it is made)
    from threadpoolctl import ThreadpoolController

    return ThreadpoolController()


def single_threaded_blas():
    """Context manager: NumPy's BLAS limited to one thread inside (a few microseconds to enter)."""
    try:
        return _controller().limit(limits=1, user_api="blas")
    except Exception:  # threadpoolctl cannot see this BLAS: run as is
        return contextlib.nullcontext()
