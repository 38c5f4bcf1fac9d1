"""Captured launch sequences: record kernel launches once, replay them with one host call (issue 44's captured step).

On a GPU a capture is a CUDA graph made by stream capture (CuPy's ``Stream.begin_capture`` / ``end_capture``):
launches issued on the capturing stream are recorded, not run, and ``Graph.launch`` replays them all. The emu device
gives the same semantics so CI runs the graph path: while a capture is open, each kernel launch packs its arguments
and launch dimensions as it would to run, but keeps them instead of running; :meth:`EmuGraph.replay` hands the whole
list to one C loop (``ftemu_replay``, compiled once with the emu's g++) that calls each kernel's launch wrapper in
order, with no Python between kernels.

What a capture holds is addresses: every array a captured kernel reads or writes must stay alive and in place, and
anything the step varies (positions, tokens, block tables) must be in device memory the caller updates before a
replay. Host work between the launches (a NumPy or CuPy expression on the host side, a copy to the host) is not
captured: it ran once, at capture time. A captured step is therefore built from kernel launches only.
"""

from __future__ import annotations

import ctypes
import hashlib
import subprocess
import threading
from contextlib import contextmanager
from functools import lru_cache
from pathlib import Path

from freetoken.device import launches
from freetoken.paths import cache_dir

_REPLAY_SOURCE = r"""
#include <stdint.h>
typedef int (*ftemu_launch_fn)(void*);
extern "C" __attribute__((visibility("default")))
int64_t ftemu_replay(int64_t n, const uintptr_t* fns, void* const* args) {
    for (int64_t i = 0; i < n; ++i) {
        if (((ftemu_launch_fn)fns[i])(args[i]) != 0) return i + 1;  // 1-based: which launch failed
    }
    return 0;
}
"""


class GraphError(RuntimeError):
    """A capture was misused (nested, replayed while open, empty) or a replayed kernel failed."""


@lru_cache(maxsize=1)
def _replay_library() -> ctypes.CDLL:
    """The emu's replay loop, built once into the cache directory."""
    from freetoken.device.emu_build import gxx_version

    key = hashlib.sha256((_REPLAY_SOURCE + gxx_version()).encode()).hexdigest()[:16]
    out = cache_dir() / "emu" / f"replay-{key}.so"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        src = out.with_suffix(".cpp")
        src.write_text(_REPLAY_SOURCE)
        tmp = out.with_name(out.name + f".{threading.get_ident()}.tmp")
        r = subprocess.run(["g++", "-O2", "-fPIC", "-shared", str(src), "-o", str(tmp)], capture_output=True, text=True)
        if r.returncode != 0:
            raise GraphError(f"building the emu replay loop failed:\n{r.stderr}")
        Path(tmp).replace(out)
    lib = ctypes.CDLL(str(out))
    lib.ftemu_replay.argtypes = [ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p]
    lib.ftemu_replay.restype = ctypes.c_int64
    return lib


class EmuGraph:
    """Launches recorded on the emu device (see the module doc). Made by :meth:`EmuDevice.capture`."""

    def __init__(self) -> None:
        self._fns: list[int] = []
        self._args: list[int] = []
        self._names: list[str] = []
        self._keep: list[object] = []  # the packed arguments, launch structs and error buffers the pointers point into
        self._open = True
        self._fn_array = self._arg_array = None

    def record(self, name: str, fn_address: int, launch_args, keep: tuple) -> None:
        self._fns.append(fn_address)
        self._args.append(ctypes.addressof(launch_args))
        self._names.append(name)
        self._keep.append((launch_args, *keep))

    def close(self) -> None:
        self._open = False
        n = len(self._fns)
        self._fn_array = (ctypes.c_size_t * n)(*self._fns)
        self._arg_array = (ctypes.c_void_p * n)(*self._args)

    @property
    def kernels(self) -> list[str]:
        """The captured launches' kernel names, in order."""
        return list(self._names)

    def replay(self, stream=None) -> None:
        """Run every captured launch in order: one host call."""
        if self._open:
            raise GraphError("a graph cannot be replayed while its capture is still open")
        launches.record("graph_replay")
        if not self._fns:
            return
        failed = _replay_library().ftemu_replay(len(self._fns), self._fn_array, self._arg_array)
        if failed:
            err = self._keep[failed - 1][-1]  # the launch's error buffer
            name = self._names[failed - 1]
            raise GraphError(f"replayed launch {failed} of {len(self._fns)} ({name}) failed: "
                             f"{err.value.decode(errors='replace')}")


class GpuGraph:
    """A CUDA graph from stream capture (see the module doc). Made by :meth:`GpuDevice.capture`."""

    def __init__(self, graph, stream, kernels: list[str]) -> None:
        self._graph, self._stream, self._kernels = graph, stream, kernels

    @property
    def kernels(self) -> list[str]:
        return list(self._kernels)

    def replay(self, stream=None) -> None:
        launches.record("graph_replay")
        raw = getattr(stream, "raw", stream) or self._stream
        self._graph.launch(stream=raw)


class GpuRecord:
    """What a gpu capture keeps of its launches: their names, and their packed arguments alive until it ends."""

    def __init__(self) -> None:
        self.names: list[str] = []
        self._keep: list[object] = []

    def record(self, name: str, packed) -> None:
        self.names.append(name)
        self._keep.append(packed)


#: The capture open on this thread (where a kernel launch puts itself instead of running), or None.
_OPEN = threading.local()


def open_capture():
    return getattr(_OPEN, "graph", None)


@contextmanager
def recording(recorder):
    """Launches on this thread go to ``recorder`` for the block's duration; captures do not nest."""
    if open_capture() is not None:
        raise GraphError("captures do not nest")
    _OPEN.graph = recorder
    try:
        yield recorder
    finally:
        _OPEN.graph = None
