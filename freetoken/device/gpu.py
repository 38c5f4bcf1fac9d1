"""The gpu device: CuPy arrays, cubins from NVRTC loaded and launched through the CUDA driver API.

Kernels are compiled by :mod:`freetoken.device.nvrtc` (the same function the NVRTC test uses) and launched
with ``cuLaunchKernel`` on arguments packed by :mod:`freetoken.device.args`, exactly as the emu device packs
them, so a launcher that passes on emu passes the same bytes here.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import numpy as np

from freetoken.device import graphs, launches, nvrtc
from freetoken.device.args import normalize_dims, pack_args
from freetoken.device.base import Device, PinnedArray, rows_contiguous

_CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8
_STATIC_SMEM_LIMIT = 48 * 1024  # above this a kernel must opt in to dynamic shared memory


def gpu_count() -> tuple[int, str]:
    """(number of CUDA devices CuPy sees, reason when 0)."""
    try:
        import cupy
    except Exception as e:
        return 0, f"CuPy is not importable ({e})"
    try:
        n = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:
        return 0, f"no usable CUDA driver/device ({e})"
    return n, "" if n else "CuPy sees no CUDA device"


class GpuFunction:
    def __init__(self, module: GpuModule, name: str):
        from cupy_backends.cuda.api import driver

        self.module = module
        self.name = name
        self._driver = driver
        try:
            self.ptr = driver.moduleGetFunction(module.handle, name)
        except Exception as e:
            raise KeyError(f"{module.name} has no kernel {name!r} ({e})") from None
        self._smem_opt_in = 0

    def __call__(self, grid, block, args: Sequence[object], shared_mem: int = 0, stream=None) -> None:
        g = normalize_dims(grid, "grid", self.name)
        b = normalize_dims(block, "block", self.name)
        packed = pack_args(self.name, args, self.module.device.pointer_of)
        captured = graphs.open_capture()
        if captured is not None:  # stream capture: recorded into the graph, run by its replay
            captured.record(self.name, packed)  # (its parameter buffer kept until the capture ends)
        else:
            launches.record(self.name)
        if shared_mem > _STATIC_SMEM_LIMIT and shared_mem > self._smem_opt_in:
            self._driver.funcSetAttribute(self.ptr, _CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, int(shared_mem))
            self._smem_opt_in = int(shared_mem)
        stream_ptr = stream.ptr if stream is not None else self.module.device.cupy.cuda.get_current_stream().ptr
        self._driver.launchKernel(self.ptr, *g, *b, int(shared_mem), stream_ptr, packed.params_ptr, 0)


class GpuModule:
    def __init__(self, device: GpuDevice, source: str, options: Sequence[str], name: str):
        from cupy_backends.cuda.api import driver

        self.device = device
        self.name = name
        cubin = nvrtc.compile_cubin(source, name, device.arch, options)
        device.activate()
        self.handle = driver.moduleLoadData(cubin)
        self._functions: dict[str, GpuFunction] = {}

    def get_function(self, name: str) -> GpuFunction:
        if name not in self._functions:
            self._functions[name] = GpuFunction(self, name)
        return self._functions[name]


class GpuDevice(Device):
    kind = "gpu"

    def kernel_scope(self):
        """The GPU's work does not compete with host BLAS threads: nothing to limit."""
        return contextlib.nullcontext()

    def __init__(self, index: int = 0) -> None:
        import cupy

        self.cupy = cupy
        self.xp = cupy
        self.index = index
        self._dev = cupy.cuda.Device(index)
        major, minor = (int(c) for c in divmod(int(self._dev.compute_capability), 10))
        self.compute_capability = (major, minor)
        self.arch = nvrtc.best_arch(major, minor)
        self._modules: dict[tuple, GpuModule] = {}
        self._unified_addressing = bool(cupy.cuda.runtime.getDeviceProperties(index)["unifiedAddressing"])
        self.activate()

    def activate(self) -> None:
        """Make this device current and make sure its primary context exists (the driver API needs it)."""
        self._dev.use()
        self.cupy.empty(1, dtype=np.uint8)

    # ---- memory ------------------------------------------------------------------------------------------
    def asarray(self, host, stream=None):
        return self.cupy.asarray(host)

    def to_host(self, arr, stream=None, out=None) -> np.ndarray:
        raw = stream.raw if isinstance(stream, _GpuStream) else stream
        if out is not None:
            return self.cupy.ascontiguousarray(arr).get(stream=raw, out=out)  # straight into ``out`` (pinned: DMA)
        return self.cupy.asnumpy(arr, stream=raw)

    def pinned_empty(self, shape, dtype) -> PinnedArray:
        from cupy.cuda import pinned_memory
        from cupy_backends.cuda.api import runtime

        dtype = np.dtype(dtype)
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        mem = pinned_memory.PinnedMemory(max(nbytes, 1), runtime.hostAllocMapped | runtime.hostAllocPortable)
        ptr = pinned_memory.PinnedMemoryPointer(mem, 0)
        host = np.ndarray(shape, dtype=dtype, buffer=ptr)  # the ndarray keeps the allocation alive
        return PinnedArray(host, self._mapped_device_pointer(mem.ptr), owner=mem)

    def _mapped_device_pointer(self, host_ptr: int) -> int:
        """The device address of mapped pinned memory. Under unified virtual addressing (every 64-bit platform
        CUDA 12+ supports) it is the host address itself, which is what cudaHostGetDevicePointer returns there;
        CuPy 14 no longer wraps that call. (Found on the first lent GPU: CuPy 14 for CUDA 12 and 13 both lack it.)"""
        if not self._unified_addressing:
            raise RuntimeError(f"gpu {self.index}: mapped pinned memory needs unified virtual addressing, "
                               "which this device does not report")
        return host_ptr

    def from_dlpack(self, x):
        return self.cupy.from_dlpack(x)

    def pointer_of(self, a, strided_rows: bool = False) -> int | None:
        if isinstance(a, PinnedArray):
            return a.device_ptr
        if isinstance(a, self.cupy.ndarray):
            if not (a.flags.c_contiguous or a.flags.f_contiguous or strided_rows and rows_contiguous(a)):
                raise ValueError("kernel arguments must be contiguous arrays")
            return a.data.ptr
        if isinstance(a, np.ndarray):
            raise TypeError("a NumPy array cannot be a gpu kernel argument; copy it with device.asarray or use "
                            "device.pinned_empty for host memory kernels read")
        if hasattr(a, "__cuda_array_interface__") or hasattr(a, "__dlpack__"):
            return self.pointer_of(self.as_array(a))
        return None

    # ---- execution ---------------------------------------------------------------------------------------
    def stream(self):
        return _GpuStream(self.cupy.cuda.Stream(non_blocking=True))

    def event(self):
        return _GpuEvent(self.cupy)

    def synchronize(self) -> None:
        self._dev.synchronize()

    def wait_event(self, event, stream=None) -> None:
        s = stream.raw if isinstance(stream, _GpuStream) else (stream or self.cupy.cuda.get_current_stream())
        s.wait_event(event.ev)

    def capture(self, fn, stream=None) -> graphs.GpuGraph:
        """Run ``fn()`` under CUDA stream capture on ``stream`` (default: a new non-blocking one, made current for
        the call): its launches become a CUDA graph, returned ready to replay (:mod:`freetoken.device.graphs`)."""
        raw = stream.raw if isinstance(stream, _GpuStream) else stream or self.cupy.cuda.Stream(non_blocking=True)
        with graphs.recording(graphs.GpuRecord()) as recorded, raw:
            raw.begin_capture()
            try:
                fn()
            finally:
                graph = raw.end_capture()
        return graphs.GpuGraph(graph, raw, recorded.names)

    def load_module(self, source: str, options: Sequence[str] = (), name: str = "module.cu") -> GpuModule:
        key = (source, tuple(options), name)
        if key not in self._modules:
            self._modules[key] = GpuModule(self, source, options, name)
        return self._modules[key]


class _GpuStream:
    """A non-blocking CUDA stream with the same methods as :class:`freetoken.device.base.HostStream`."""

    def __init__(self, stream) -> None:
        self.raw = stream
        self.ptr = stream.ptr

    def synchronize(self) -> None:
        self.raw.synchronize()

    def wait_event(self, event: _GpuEvent) -> None:
        self.raw.wait_event(event.ev)

    def __enter__(self):
        self.raw.__enter__()
        return self

    def __exit__(self, *exc):
        return self.raw.__exit__(*exc)


class _GpuEvent:
    """A CUDA event with the same methods as :class:`freetoken.device.base.HostEvent`."""

    def __init__(self, cupy) -> None:
        self._cupy = cupy
        self.ev = cupy.cuda.Event()

    def record(self, stream=None):
        self.ev.record(stream.raw if isinstance(stream, _GpuStream) else stream)
        return self

    def synchronize(self) -> None:
        self.ev.synchronize()

    def query(self) -> bool:
        return self.ev.done

    def elapsed_ms(self, end: _GpuEvent) -> float:
        end.synchronize()
        return float(self._cupy.cuda.get_elapsed_time(self.ev, end.ev))
