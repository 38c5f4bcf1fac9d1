"""The single-threaded copy of a ``parallel=True`` kernel, cached in files of its own.

A few kernels come in two builds from one Python function: the ``prange`` dispatcher, and the same loops on the
calling thread for products too small to repay starting the threads (``_gemv_serial`` of
:mod:`~freetoken.cpu_kernels.gemv`, ...). Numba names a function's cache files after its module, ``__qualname__``
and first line, and keys the entries by signature, target machine and bytecode; the ``parallel`` flag is in neither.
Compiled with ``nb.njit(...)(kernel.py_func)``, the two builds therefore shared one index file and its entries: the
first of the two to compile a signature saved its code, and the other then loaded that code instead of compiling, in
the same process and every later one (the serial copy the threaded code, with its start-up cost on tiny products; or
the ``prange`` dispatcher the single-threaded code: 2 threads, f32 8192 x 4096, 6.6-7.6 ms instead of 2.8-3.9).
:func:`serial_copy` compiles a copy of the function renamed ``<name>_serial``, so its cache files are
``<module>.<name>_serial-<line>`` beside the kernel's ``<module>.<name>-<line>``.
"""

from __future__ import annotations

import sys
import types

import numba as nb
from numba.core.caching import NullCache

__all__ = ["SUFFIX", "serial_copy"]

#: Appended to the kernel's name (and so to its cache files' names) for the serial copy.
SUFFIX = "_serial"


def renamed(func: types.FunctionType, name: str) -> types.FunctionType:
    """A copy of ``func`` named ``name`` (``__name__``, ``__qualname__``, the code's ``co_name`` and, from Python
    3.11, ``co_qualname``): the same code, globals, defaults and closure; the same source file and first line."""
    qualname = func.__qualname__.rpartition(".")[0] + "." + name if "." in func.__qualname__ else name
    fields = {"co_name": name}
    if sys.version_info >= (3, 11):
        fields["co_qualname"] = qualname
    copy = types.FunctionType(func.__code__.replace(**fields), func.__globals__, name, func.__defaults__,
                              func.__closure__)
    copy.__qualname__ = qualname
    copy.__kwdefaults__ = func.__kwdefaults__
    copy.__doc__ = func.__doc__
    copy.__module__ = func.__module__
    return copy


def serial_copy(kernel):
    """``kernel`` (a ``parallel=True`` Numba dispatcher) compiled without threads (``prange`` runs as ``range``):
    the same options otherwise (``cache=True`` when the kernel caches), from a copy of its function named
    ``<name>_serial`` so that the two builds never share cache files."""
    options = {k: v for k, v in kernel.targetoptions.items() if k not in ("parallel", "nopython")}
    if not isinstance(kernel._cache, NullCache):  # cache=True
        options["cache"] = True
    return nb.njit(**options)(renamed(kernel.py_func, kernel.py_func.__name__ + SUFFIX))
