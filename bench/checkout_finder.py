"""Import ``freetoken.cpu_kernels`` from a plain source checkout on ``PYTHONPATH``, without installing it.

An installed freetoken (a wheel, or ``pip install -e .``) maps the checkout's top-level ``cpu_kernels/`` to
``freetoken.cpu_kernels`` (pyproject.toml's package-dir). A lent GPU machine runs the checkout as it is, so
``bench/gpu_session.sh`` copies this file as ``sitecustomize.py`` into a directory at the front of
``PYTHONPATH``: Python imports it at start-up and the finder below does that mapping. Not used anywhere else.
"""

import importlib.abc
import importlib.util
import os
import sys

_CHECKOUT = os.environ.get("FREETOKEN_CHECKOUT", "")


class _CheckoutFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "freetoken.cpu_kernels" or not _CHECKOUT:
            return None
        package = os.path.join(_CHECKOUT, "cpu_kernels")
        return importlib.util.spec_from_file_location(name, os.path.join(package, "__init__.py"),
                                                      submodule_search_locations=[package])


sys.meta_path.append(_CheckoutFinder())
