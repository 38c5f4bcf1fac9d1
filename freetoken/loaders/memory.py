"""How much host memory a load may take, checked before anything is allocated.

The loaders state what a model will allocate (:func:`check_load_bytes`: a breakdown such as float32 copies of the
non-expert weights, the expert banks, the KV cache) and compare the total with what this process can still get:
the kernel's ``MemAvailable`` (plus free swap) and, when the process runs under an address-space limit
(``ulimit -v`` / ``RLIMIT_AS``), what is left below it. A file that declares a model larger than that fails with
a :class:`LoadError` naming the file and the figures, instead of a ``MemoryError`` (or the OOM killer) halfway
through the load. ``FREETOKEN_SKIP_MEMORY_CHECK=1`` turns the check off (the estimate is deliberately on the
high side: host copies that a GPU load frees again are all counted).
"""

from __future__ import annotations

import os
import resource

from freetoken.loaders.errors import LoadError

SKIP_ENV = "FREETOKEN_SKIP_MEMORY_CHECK"


def _meminfo() -> dict[str, int]:
    out = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                key, _, rest = line.partition(":")
                parts = rest.split()
                if parts and parts[0].isdigit():
                    out[key] = int(parts[0]) * 1024
    except OSError:
        pass
    return out


def _vm_size() -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmSize:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def available_bytes() -> tuple[int | None, str]:
    """(bytes this process can still allocate, where the figure comes from); (None, "") when unknown."""
    limits: list[tuple[int, str]] = []
    info = _meminfo()
    if "MemAvailable" in info:
        limits.append((info["MemAvailable"] + info.get("SwapFree", 0), "MemAvailable + SwapFree"))
    else:
        try:
            limits.append((os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"), "free physical memory"))
        except (ValueError, OSError, AttributeError):
            pass
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft != resource.RLIM_INFINITY:
        limits.append((max(0, soft - _vm_size()), "the address-space limit (RLIMIT_AS) less what is mapped"))
    if not limits:
        return None, ""
    return min(limits)


def gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**28 else f"{n / 2**20:.1f} MiB"


def check_load_bytes(file, need: dict[str, int]) -> int:
    """Refuse (LoadError naming ``file``) a load whose allocations ``need`` ({what: bytes}) exceed the memory
    available; returns the total."""
    total = sum(need.values())
    if os.environ.get(SKIP_ENV, "") not in ("", "0"):
        return total
    avail, source = available_bytes()
    if avail is not None and total > avail:
        parts = ", ".join(f"{k} {gib(v)}" for k, v in need.items() if v)
        raise LoadError(file, f"loading needs about {gib(total)} of host memory ({parts}) but only {gib(avail)} "
                              f"is available ({source}); {SKIP_ENV}=1 skips this check")
    return total
