"""The preprocessor definitions every CUDA compile receives (NVRTC for the gpu device and the all-architecture
check, g++ for the emu device).

The values are defined once, in Python (:mod:`freetoken.ops.constants`, which registers them here when it is
imported: the device layer sits below ops and does not know them); :func:`define_options` turns the registry into
``-D`` options that :func:`freetoken.device.nvrtc.compile_cubin` and :func:`freetoken.device.emu_build.build` add
to every compile. The sources never define these names themselves; ``cuda/common.cuh`` stops a compile that lacks
them with an ``#error``.
"""

from __future__ import annotations

from collections.abc import Mapping

_DEFINES: dict[str, str] = {}


def register_cuda_defines(values: Mapping[str, str]) -> None:
    """Add ``name -> C literal`` definitions (a name registered twice must keep its value)."""
    for name, literal in values.items():
        old = _DEFINES.get(name)
        if old is not None and old != literal:
            raise ValueError(f"CUDA definition {name} registered as {old!r} and {literal!r}")
        _DEFINES[name] = str(literal)


def cuda_defines() -> dict[str, str]:
    """A copy of the registered definitions."""
    return dict(_DEFINES)


def define_options() -> list[str]:
    """The registered definitions as ``-DNAME=VALUE`` options, sorted by name (stable cache keys)."""
    return [f"-D{name}={_DEFINES[name]}" for name in sorted(_DEFINES)]
