"""The cpu device: NumPy arrays, Numba kernels; the whole model on the host."""

from __future__ import annotations

import numpy as np

from freetoken.device.base import Device, HostEvent, HostStream, PinnedArray


class HostDevice(Device):
    """Memory and streams shared by the cpu and emu devices: everything is a NumPy array on the host."""

    xp = np

    def asarray(self, host, stream=None):
        return np.asarray(host)

    def to_host(self, arr, stream=None) -> np.ndarray:
        return np.asarray(arr)

    def pinned_empty(self, shape, dtype) -> PinnedArray:
        host = np.empty(shape, dtype=dtype)
        return PinnedArray(host, host.ctypes.data)

    def from_dlpack(self, x):
        return np.from_dlpack(x)

    def pointer_of(self, a) -> int | None:
        """The address a kernel uses for ``a`` (NumPy array or PinnedArray), None for non-arrays."""
        from freetoken.device.emu import _host_pointer

        return _host_pointer(a)

    def stream(self) -> HostStream:
        return HostStream()

    def event(self) -> HostEvent:
        return HostEvent()


class CpuDevice(HostDevice):
    kind = "cpu"
