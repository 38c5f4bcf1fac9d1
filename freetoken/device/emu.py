"""The emu device: CUDA sources compiled for the host (cuda/emu/ftemu.h) and run on fibers.

Arrays are NumPy; kernels launch synchronously (streams run in order). It exists so every CUDA kernel and the
GPU orchestration path run in CI without a GPU. It is slow: keep shapes small.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Sequence

from freetoken.device import emu_build, graphs, launches
from freetoken.device.args import normalize_dims, pack_args
from freetoken.device.cpu import HostDevice, host_pointer


class EmuKernelError(RuntimeError):
    """A kernel misbehaved under the emulator (divergent barrier, mismatched warp mask, bad launch, ...)."""


class _LaunchArgs(ctypes.Structure):
    # Mirrors ftemu::LaunchArgs in cuda/emu/ftemu.h.
    _fields_ = [
        ("grid", ctypes.c_uint32 * 3),
        ("block", ctypes.c_uint32 * 3),
        ("shmem", ctypes.c_uint64),
        ("nworkers", ctypes.c_uint32),
        ("nargs", ctypes.c_uint32),
        ("args", ctypes.c_void_p),
        ("sizes", ctypes.c_void_p),
        ("kinds", ctypes.c_char_p),
        ("err", ctypes.c_char_p),
        ("errlen", ctypes.c_uint64),
    ]


#: The default cap on worker threads. Every compiled module keeps one fiber-stack arena per worker for the life of
#: the process, two memory mappings per guarded stack: with a worker per core a 64-core machine used 58k of Linux's
#: default 65,530 mappings (vm.max_map_count) for one run of the bundled model, and 128 workers failed outright
#: ("cannot map fiber stacks"). The emulator checks kernels; it does not need every core of a big machine.
MAX_DEFAULT_WORKERS = 8


def emu_workers() -> int:
    """Worker threads that run blocks in parallel: ``$FREETOKEN_EMU_THREADS``, or the CPU count up to
    :data:`MAX_DEFAULT_WORKERS`."""
    default = min(os.cpu_count() or 1, MAX_DEFAULT_WORKERS)
    return max(1, int(os.environ.get("FREETOKEN_EMU_THREADS", default)))


class EmuFunction:
    def __init__(self, module: EmuModule, name: str, max_threads: int):
        self.module = module
        self.name = name
        self.max_threads = max_threads
        fn = getattr(module.lib, f"ftemu_launch_{name}")
        fn.argtypes = [ctypes.POINTER(_LaunchArgs)]
        fn.restype = ctypes.c_int
        self._fn = fn

    def __call__(self, grid, block, args: Sequence[object], shared_mem: int = 0, stream=None) -> None:
        g = normalize_dims(grid, "grid", self.name)
        b = normalize_dims(block, "block", self.name)
        packed = pack_args(self.name, args, host_pointer)
        err = ctypes.create_string_buffer(2048)
        la = _LaunchArgs(
            (ctypes.c_uint32 * 3)(*g), (ctypes.c_uint32 * 3)(*b), int(shared_mem), emu_workers(), len(args),
            packed.params_ptr, ctypes.addressof(packed.sizes), packed.kinds, ctypes.cast(err, ctypes.c_char_p),
            len(err),
        )
        graph = graphs.open_capture()
        if graph is not None:  # recorded, not run: the replay runs it (freetoken.device.graphs)
            graph.record(self.name, ctypes.cast(self._fn, ctypes.c_void_p).value, la, (packed, err))
            return
        launches.record(self.name)
        if self._fn(ctypes.byref(la)) != 0:
            raise EmuKernelError(f"{self.module.name}: {err.value.decode(errors='replace')}")


class EmuModule:
    def __init__(self, source: str, options: Sequence[str], name: str, sanitize: str | None = None):
        self.name = name
        built = emu_build.build(source, name, options, sanitize)
        self.path = built.path
        self.kernels = built.kernels
        self.lib = ctypes.CDLL(str(built.path))
        self._functions: dict[str, EmuFunction] = {}

    def get_function(self, name: str) -> EmuFunction:
        if name not in self.kernels:
            raise KeyError(f"{self.name} has no kernel {name!r}; it defines {sorted(self.kernels)}")
        if name not in self._functions:
            self._functions[name] = EmuFunction(self, name, self.kernels[name])
        return self._functions[name]


class EmuDevice(HostDevice):
    kind = "emu"

    def __init__(self) -> None:
        self._modules: dict[tuple, EmuModule] = {}

    def capture(self, fn, stream=None) -> graphs.EmuGraph:
        """Run ``fn()`` with its kernel launches recorded instead of run; returns the graph that replays them
        (:mod:`freetoken.device.graphs`)."""
        graph = graphs.EmuGraph()
        try:
            with graphs.recording(graph):
                fn()
        finally:
            graph.close()
        return graph

    def load_module(self, source: str, options: Sequence[str] = (), name: str = "module.cu",
                    sanitize: str | None = None) -> EmuModule:
        key = (source, tuple(options), name, sanitize)
        if key not in self._modules:
            self._modules[key] = EmuModule(source, options, name, sanitize)
        return self._modules[key]
