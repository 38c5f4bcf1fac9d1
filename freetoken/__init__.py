"""freetoken: huge Mixture-of-Experts models on one consumer GPU plus host memory."""

from freetoken.device import get_device

__version__ = "0.1.0"

__all__ = ["__version__", "get_device"]
