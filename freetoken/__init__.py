"""freetoken: huge Mixture-of-Experts models on one consumer GPU plus host memory."""

# First: Numba's cache directory, keyed by every kernel source, must be set before any module defines a cached kernel.
from freetoken.device.numba_cache import configure as _configure_numba_cache

_configure_numba_cache()

from freetoken.device import get_device  # noqa: E402
from freetoken.version import __version__  # noqa: E402


def load(path=None, device="auto", **kwargs):
    """Load a model (see :func:`freetoken.engine.loading.load.load`); imported lazily to keep ``import freetoken``
    light."""
    from freetoken.engine.loading.load import load as _load

    return _load(path, device, **kwargs)


__all__ = ["__version__", "get_device", "load"]
