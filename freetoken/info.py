"""What this machine offers freetoken: devices, library versions, GPU and CPU details, cache location."""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
from importlib import metadata
from pathlib import Path

from freetoken.paths import cache_dir

SIMD_FLAGS = ("sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16",
              "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8", "asimd", "asimdhp", "sve", "sve2")


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def library_versions() -> dict[str, str | None]:
    v = {name: _version(name) for name in ("numpy", "numba", "cupy-cuda12x", "ml-dtypes", "gguf", "safetensors",
                                            "tokenizers", "nvidia-cuda-nvrtc-cu12")}
    try:
        from freetoken.device.nvrtc import nvrtc_version

        major, minor = nvrtc_version()
        v["nvrtc"] = f"{major}.{minor}"
    except Exception as e:
        v["nvrtc"] = f"unavailable ({e})"
    try:
        import cupy

        drv = cupy.cuda.runtime.driverGetVersion()  # 0 when no driver is installed
        v["cuda driver"] = f"{drv // 1000}.{drv % 1000 // 10}" if drv else None
    except Exception:
        v["cuda driver"] = None
    gxx = shutil.which("g++")
    v["g++"] = subprocess.run([gxx, "-dumpfullversion"], capture_output=True, text=True).stdout.strip() if gxx else None
    return v


def _pcie_link(bus_id: str) -> str | None:
    """Current/max PCIe link of a device from sysfs (Linux), e.g. '16.0 GT/s PCIe x16 (max 16.0 GT/s x16)'."""
    dev = Path("/sys/bus/pci/devices") / bus_id.lower()
    try:
        read = lambda name: (dev / name).read_text().strip()
        return (f"{read('current_link_speed')} x{read('current_link_width')} "
                f"(max {read('max_link_speed')} x{read('max_link_width')})")
    except OSError:
        return None


def gpu_info() -> list[dict]:
    from freetoken.device.gpu import gpu_count

    n, _ = gpu_count()
    gpus = []
    if not n:
        return gpus
    import cupy

    for i in range(n):
        p = cupy.cuda.runtime.getDeviceProperties(i)
        name = p["name"].decode() if isinstance(p["name"], bytes) else p["name"]
        bus = f"{p.get('pciDomainID', 0):04x}:{p.get('pciBusID', 0):02x}:{p.get('pciDeviceID', 0):02x}.0"
        gpus.append({
            "index": i,
            "name": name,
            "memory_gib": round(p["totalGlobalMem"] / 2**30, 1),
            "compute_capability": f"{p['major']}.{p['minor']}",
            "multiprocessors": p.get("multiProcessorCount"),
            "pci_bus": bus,
            "pcie_link": _pcie_link(bus),
        })
    return gpus


def cpu_info() -> dict:
    info: dict = {"model": platform.processor() or platform.machine(), "logical_cores": os.cpu_count()}
    flags: set[str] = set()
    cores = set()
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        text = ""
    phys = core = None
    for line in text.splitlines():
        key, _, val = line.partition(":")
        key, val = key.strip(), val.strip()
        if key == "model name":
            info["model"] = val
        elif key in ("flags", "Features"):
            flags.update(val.split())
        elif key == "physical id":
            phys = val
        elif key == "core id":
            core = val
            cores.add((phys, core))
    if cores:
        info["physical_cores"] = len(cores)
    info["simd"] = [f for f in SIMD_FLAGS if f in flags]
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                info["memory_gib"] = round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    return info


def collect() -> dict:
    from freetoken.device import device_status
    from freetoken.version import __version__

    return {
        "freetoken": __version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "devices": {k: {"usable": ok, "reason": why} for k, (ok, why) in device_status().items()},
        "libraries": library_versions(),
        "gpus": gpu_info(),
        "cpu": cpu_info(),
        "cache_dir": str(cache_dir()),
    }


def format_report(info: dict) -> str:
    lines = [f"freetoken {info['freetoken']}  (Python {info['python']}, {info['platform']})", "", "Devices"]
    for kind, st in info["devices"].items():
        lines.append(f"  {kind:<4} {'yes' if st['usable'] else 'no '}  {st['reason']}".rstrip())
    lines += ["", "GPU"]
    if info["gpus"]:
        for g in info["gpus"]:
            lines.append(f"  [{g['index']}] {g['name']}  {g['memory_gib']} GiB  compute {g['compute_capability']}  "
                         f"{g['multiprocessors']} SMs")
            lines.append(f"      PCIe {g['pcie_link'] or 'link unknown'}  (bus {g['pci_bus']})")
    else:
        lines.append("  none visible to CuPy")
    c = info["cpu"]
    lines += ["", "CPU", f"  {c['model']}",
              f"  {c.get('physical_cores', '?')} physical / {c['logical_cores']} logical cores, "
              f"{c.get('memory_gib', '?')} GiB memory",
              f"  SIMD: {' '.join(c['simd']) or 'none detected'}", "", "Libraries"]
    for name, ver in info["libraries"].items():
        lines.append(f"  {name:<24} {ver or 'not installed'}")
    lines += ["", f"Cache directory: {info['cache_dir']}"]
    return "\n".join(lines)
