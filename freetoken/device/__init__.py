"""Execution targets: ``gpu`` (CuPy + NVRTC), ``cpu`` (NumPy + Numba) and ``emu`` (CUDA sources on the host).

>>> dev = get_device("auto")   # gpu when CuPy sees a GPU, else cpu
>>> dev.kind, dev.xp
"""

from __future__ import annotations

import shutil

from freetoken.device.base import Device, HostEvent, HostStream, PinnedArray

DEVICE_KINDS = ("gpu", "cpu", "emu")
_devices: dict[str, Device] = {}


class DeviceUnavailable(RuntimeError):
    """The requested device cannot be used on this machine; the message says why."""


def device_status() -> dict[str, tuple[bool, str]]:
    """For each device kind: (usable here, reason when not)."""
    from freetoken.device.gpu import gpu_count

    n, why = gpu_count()
    status = {"gpu": (n > 0, why), "cpu": (True, "")}
    if shutil.which("g++") is None:
        status["emu"] = (False, "g++ not found")
    else:
        from freetoken.device.emu_build import EmuBuildError, include_dirs

        try:
            include_dirs()
            status["emu"] = (True, "")
        except EmuBuildError as e:
            status["emu"] = (False, str(e))
    return status


def get_device(name: str | Device = "auto") -> Device:
    """The device called ``name``: "auto" (gpu when CuPy sees a GPU, else cpu), "gpu", "cpu" or "emu"."""
    if isinstance(name, Device):
        return name
    if name not in ("auto", *DEVICE_KINDS):
        raise ValueError(f"unknown device {name!r}; choose one of auto, gpu, cpu, emu")
    if name == "auto":
        from freetoken.device.gpu import gpu_count

        name = "gpu" if gpu_count()[0] > 0 else "cpu"
    if name not in _devices:
        if name == "cpu":
            from freetoken.device.cpu import CpuDevice

            _devices[name] = CpuDevice()
        elif name == "emu":
            ok, why = device_status()["emu"]
            if not ok:
                raise DeviceUnavailable(f"the emu device is unavailable: {why}")
            from freetoken.device.emu import EmuDevice

            _devices[name] = EmuDevice()
        else:
            from freetoken.device.gpu import GpuDevice, gpu_count

            n, why = gpu_count()
            if n == 0:
                raise DeviceUnavailable(f"the gpu device is unavailable: {why}")
            _devices[name] = GpuDevice()
    return _devices[name]


__all__ = [
    "DEVICE_KINDS", "Device", "DeviceUnavailable", "HostEvent", "HostStream", "PinnedArray", "device_status",
    "get_device",
]
