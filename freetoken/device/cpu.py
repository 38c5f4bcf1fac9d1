"""The cpu device: NumPy arrays, Numba kernels; the whole model on the host."""

from __future__ import annotations

import numpy as np

from freetoken.device.base import Device, HostEvent, HostStream, PinnedArray, rows_contiguous


def host_pointer(a, strided_rows: bool = False) -> int | None:
    """The address of a host array (NumPy, PinnedArray, or anything DLPack/array-interface on the CPU); None if ``a``
    is no array. Kernel arguments must be contiguous (``strided_rows``: or each row contiguous, for kernels that take
    the row stride)."""
    if isinstance(a, PinnedArray):
        return a.device_ptr
    if isinstance(a, np.ndarray):
        if not (a.flags.c_contiguous or a.flags.f_contiguous or strided_rows and rows_contiguous(a)):
            raise ValueError("kernel arguments must be contiguous arrays")
        return a.ctypes.data
    if hasattr(a, "__dlpack__") or hasattr(a, "__array_interface__"):
        try:
            return host_pointer(np.from_dlpack(a) if hasattr(a, "__dlpack__") else np.asarray(a))
        except (TypeError, BufferError, RuntimeError):
            return None
    return None


class HostDevice(Device):
    """Memory and streams shared by the cpu and emu devices: everything is a NumPy array on the host."""

    xp = np

    def asarray(self, host, stream=None):
        return np.asarray(host)

    def to_host(self, arr, stream=None, out=None) -> np.ndarray:
        if out is not None:
            np.copyto(out, arr)
            return out
        return np.asarray(arr)

    def pinned_empty(self, shape, dtype) -> PinnedArray:
        host = np.empty(shape, dtype=dtype)
        return PinnedArray(host, host.ctypes.data)

    def from_dlpack(self, x):
        return np.from_dlpack(x)

    def pointer_of(self, a, strided_rows: bool = False) -> int | None:
        """The address a kernel uses for ``a`` (NumPy array or PinnedArray), None for non-arrays; ``strided_rows``:
        accept rows that are each contiguous but further apart (the kernel takes the stride)."""
        return host_pointer(a, strided_rows)

    def stream(self) -> HostStream:
        return HostStream()

    def event(self) -> HostEvent:
        return HostEvent()


class CpuDevice(HostDevice):
    kind = "cpu"

    def __init__(self):
        self._arena = None

    def weights(self, host, stream=None):
        """``host`` in huge-page memory (:mod:`freetoken.device.hugepages`): the kernels stream these arrays on every
        decode step. An array already there (an arena's, or NumPy's own large allocation) stays as it is
        (:func:`~freetoken.device.hugepages.wants_huge_pages`)."""
        from freetoken.device.hugepages import HugePageArena, wants_huge_pages

        a = np.ascontiguousarray(host)
        if not wants_huge_pages(a):
            return a
        if self._arena is None:
            self._arena = HugePageArena()
        return self._arena.copy(a)
