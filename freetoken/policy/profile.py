"""Bandwidth profiles: what ``freetoken bench bw`` measured, stored per (GPU, CPU, expert format).

One JSON file in the cache directory (``bandwidth_profiles.json``) maps a hardware key to the measured figures.
The key names the GPU (or the device kind when there is none), the CPU model and its logical core count, and
the format; a profile measured on other hardware simply has another key, so it is never used here.
:func:`recommend_mode` turns a profile into the ``--moe-mode`` that ``auto`` picks.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from freetoken.paths import cache_dir

FILE_NAME = "bandwidth_profiles.json"


@dataclass(frozen=True)
class Profile:
    gpu: str  # GPU name, or "emu" / "cpu" for devices without one
    cpu: str  # CPU model and logical cores
    fmt: str  # expert format the CPU figure was measured with
    pcie_gbps: float  # host-to-device copy of expert records
    cpu_gbps: float  # CPU executor: expert-record bytes processed per second (decode, one token)
    record_bytes: int  # the record size used
    measured_at: float  # unix time

    @property
    def key(self) -> str:
        return hardware_key(self.gpu, self.cpu, self.fmt)


def hardware_key(gpu: str, cpu: str, fmt: str) -> str:
    return f"{gpu} | {cpu} | {fmt}"


def this_hardware(device) -> tuple[str, str]:
    """(gpu, cpu) identifiers of this machine for ``device``."""
    from freetoken.info import cpu_info, gpu_info

    c = cpu_info()
    cpu = f"{c.get('model', 'unknown cpu')} x{c.get('logical_cores')}"
    if device.kind == "gpu":
        gpus = gpu_info()
        idx = getattr(device, "index", 0)
        gpu = gpus[idx]["name"] if idx < len(gpus) else "unknown gpu"
    else:
        gpu = device.kind
    return gpu, cpu


def profile_path(root: Path | None = None) -> Path:
    return (root or cache_dir()) / FILE_NAME


def _read(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError):
        return {}  # a corrupt file is re-measured, not fatal
    return data if isinstance(data, dict) else {}


def save_profile(p: Profile, root: Path | None = None) -> Path:
    """Store ``p`` under its key (other keys kept); the file is replaced atomically."""
    path = profile_path(root)
    data = _read(path)
    data[p.key] = asdict(p)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True))
    os.replace(tmp, path)
    return path


def load_profile(gpu: str, cpu: str, fmt: str, root: Path | None = None) -> Profile | None:
    """The stored profile of exactly this hardware and format, or None."""
    entry = _read(profile_path(root)).get(hardware_key(gpu, cpu, fmt))
    if not isinstance(entry, dict):
        return None
    try:
        p = Profile(**entry)
    except TypeError:
        return None
    return p if (p.gpu, p.cpu, p.fmt) == (gpu, cpu, fmt) else None


def recommend_mode(p: Profile | None, ratio: float = 4.0) -> str:
    """``auto``'s choice: ``gpu`` when PCIe is so much faster than the CPU that splitting buys nothing, ``cpu``
    when the CPU is that much faster, else ``hybrid``; ``gpu`` without a profile (the cache decides alone)."""
    if p is None:
        return "gpu"
    if p.pcie_gbps >= ratio * p.cpu_gbps:
        return "gpu"
    if p.cpu_gbps >= ratio * p.pcie_gbps:
        return "cpu"
    return "hybrid"


def now() -> float:
    return time.time()
