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


class _OneThread:
    """NumPy's BLAS libraries on one thread inside, their thread counts restored on exit (re-entrant: each use is
    its own object). One ``get_num_threads`` per library to enter, nothing more once they already run on one thread:
    threadpoolctl's ``limit`` re-reads every library's info on each entry (~15 us, a decode step's worth of small
    kernels)."""

    __slots__ = ("libs", "saved")

    def __init__(self, libs):
        self.libs, self.saved = libs, None

    def __enter__(self):
        saved = []
        for lib in self.libs:
            n = lib.get_num_threads()
            if n != 1:
                lib.set_num_threads(1)
            saved.append(n)
        self.saved = saved
        return self

    def __exit__(self, *exc) -> None:
        for lib, n in zip(self.libs, self.saved or (), strict=False):
            if n != 1:
                lib.set_num_threads(n)


@lru_cache(maxsize=1)
def _blas_libs() -> tuple:
    return tuple(c for c in _controller().lib_controllers if c.user_api == "blas")


def single_threaded_blas():
    """Context manager: NumPy's BLAS limited to one thread inside (about a microsecond to enter)."""
    try:
        return _OneThread(_blas_libs())
    except Exception:  # threadpoolctl cannot see this BLAS: run as is
        return contextlib.nullcontext()
