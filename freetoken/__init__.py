"""freetoken: huge Mixture-of-Experts models on one consumer GPU plus host memory."""

from freetoken.device import get_device
from freetoken.version import __version__


def load(path=None, device="auto", **kwargs):
    """Load a model (see :func:`freetoken.engine.load.load`); imported lazily to keep ``import freetoken`` light."""
    from freetoken.engine.load import load as _load

    return _load(path, device, **kwargs)


__all__ = ["__version__", "get_device", "load"]
