"""The device interface the runner is written against, and the host-side pieces cpu and emu share."""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from freetoken.paths import cuda_source


def rows_contiguous(a) -> bool:
    """Each row (index along the first axis) of ``a`` contiguous, rows any distance apart: a slot bank's view of
    slot rows sized for a larger record."""
    return a.ndim < 2 or a.shape[0] == 0 or a[0].flags.c_contiguous


class PinnedArray:
    """Host memory a kernel can read: page-locked and device-mapped on gpu, plain on cpu/emu.

    ``host`` is the NumPy view, ``device_ptr`` the address kernels use (pass the PinnedArray itself as a
    kernel argument and the device picks the right address).
    """

    def __init__(self, host: np.ndarray, device_ptr: int, owner: Any = None):
        self.host = host
        self.device_ptr = device_ptr
        self._owner = owner

    shape = property(lambda self: self.host.shape)
    dtype = property(lambda self: self.host.dtype)
    nbytes = property(lambda self: self.host.nbytes)

    def __repr__(self) -> str:
        return f"PinnedArray(shape={self.shape}, dtype={self.dtype}, device_ptr=0x{self.device_ptr:x})"


class HostStream:
    """A stream on a host device: work runs when issued, so ordering holds trivially."""

    ptr = 0

    def synchronize(self) -> None:
        pass

    def wait_event(self, event: HostEvent) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class HostEvent:
    """An event on a host device: records the wall-clock time at which it was recorded."""

    def __init__(self) -> None:
        self.t: float | None = None

    def record(self, stream: HostStream | None = None) -> HostEvent:
        self.t = time.perf_counter()
        return self

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def elapsed_ms(self, end: HostEvent) -> float:
        """Milliseconds from this event to ``end`` (both recorded)."""
        if self.t is None or end.t is None:
            raise RuntimeError("elapsed_ms needs both events recorded")
        return (end.t - self.t) * 1e3


class Device(ABC):
    """One execution target. ``xp`` is its array module (numpy or cupy)."""

    kind: str
    xp: Any

    # ---- memory ------------------------------------------------------------------------------------------
    def empty(self, shape, dtype=np.float32):
        return self.xp.empty(shape, dtype=dtype)

    def zeros(self, shape, dtype=np.float32):
        return self.xp.zeros(shape, dtype=dtype)

    def full(self, shape, value, dtype=np.float32):
        return self.xp.full(shape, value, dtype=dtype)

    @abstractmethod
    def asarray(self, host: Any, stream: Any = None):
        """Copy a host array to the device (no copy on host devices when already a NumPy array)."""

    def weights(self, host: Any, stream: Any = None):
        """A weight array the kernels read on every step, on the device (:meth:`asarray`; the cpu device places it in
        huge pages)."""
        return self.asarray(host, stream)

    @abstractmethod
    def to_host(self, arr: Any, stream: Any = None, out: np.ndarray | None = None) -> np.ndarray:
        """Copy a device array to a NumPy array (into ``out`` when given, e.g. a pinned buffer's host view)."""

    @abstractmethod
    def pinned_empty(self, shape, dtype) -> PinnedArray:
        """Host memory that kernels on this device can read directly (see :class:`PinnedArray`)."""

    @abstractmethod
    def from_dlpack(self, x: Any):
        """View an array from another framework (anything with ``__dlpack__`` on this device) as ``xp``."""

    def as_array(self, x: Any, *, copy_host: bool = False):
        """``x`` if it already is an ``xp`` array, else its DLPack view; a clear error if neither works.

        ``copy_host``: ``x`` is only read, so a host NumPy array is copied to this device (a GPU cannot view host
        memory through DLPack). Outputs and arrays a kernel updates in place never take that path: a copy would
        drop what the kernel writes."""
        if isinstance(x, self.xp.ndarray):
            return x
        if copy_host and isinstance(x, np.ndarray):
            return self.asarray(x)
        if hasattr(x, "__dlpack__"):
            try:
                return self.from_dlpack(x)
            except Exception as e:
                raise TypeError(f"cannot view {type(x).__name__} on the {self.kind} device through DLPack: {e}") from e
        raise TypeError(f"expected an array on the {self.kind} device, got {type(x).__name__}")

    # ---- execution ---------------------------------------------------------------------------------------
    @abstractmethod
    def stream(self): ...

    @abstractmethod
    def event(self): ...

    def wait_event(self, event, stream=None) -> None:  # noqa: B027 - host devices run work in issue order
        """Make ``stream`` (default: the current stream) wait until ``event`` has completed."""

    def synchronize(self) -> None:  # noqa: B027 - host devices finish work when it is issued
        """Wait until all work issued on this device has finished."""

    def kernel_scope(self):
        """Context manager around a forward pass: on host devices NumPy's BLAS keeps to one thread so freetoken's
        kernels get the cores (see :mod:`freetoken.device.blas`)."""
        from freetoken.device.blas import single_threaded_blas

        return single_threaded_blas()

    def capture(self, fn, stream=None):
        """Run ``fn()`` with its kernel launches captured into a graph that replays them with one host call (gpu:
        a CUDA graph; emu: the same semantics; :mod:`freetoken.device.graphs`)."""
        raise NotImplementedError(f"the {self.kind} device runs Numba kernels: there are no launches to capture")

    def load_module(self, source: str, options: Sequence[str] = (), name: str = "module.cu"):
        raise NotImplementedError(
            f"the {self.kind} device does not run CUDA modules (it uses Numba kernels); use gpu or emu"
        )

    def load_cuda(self, file_name: str, options: Sequence[str] = ()):
        """Load ``cuda/<file_name>`` as a module (compiled once, cached on disk).

        Every kernel launch asks for its module here, so the answer is kept per (file, options): reading the
        source and hashing it for :meth:`load_module`'s key cost ~40 us a launch, more than a decode kernel."""
        key = (file_name, tuple(options))
        loaded = self.__dict__.setdefault("_cuda_files", {})
        if key not in loaded:
            path: Path = cuda_source(file_name)
            loaded[key] = self.load_module(path.read_text(), options, name=file_name)
        return loaded[key]

    def __repr__(self) -> str:
        return f"<freetoken device {self.kind}>"
