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
    v = {name: _version(name) for name in ("numpy", "numba", "ml-dtypes", "gguf", "safetensors", "tokenizers")}
    # CuPy and NVRTC come as CUDA 12 or CUDA 13 wheels (a lent H200 had cupy-cuda13x): report what is installed
    cupy_dists = [d for d in ("cupy-cuda12x", "cupy-cuda13x", "cupy") if _version(d)]
    v["cupy"] = f"{_version(cupy_dists[0])} ({cupy_dists[0]})" if cupy_dists else None
    nvrtc_dists = [d for d in ("nvidia-cuda-nvrtc-cu12", "nvidia-cuda-nvrtc") if _version(d)]
    v["nvrtc wheel"] = f"{_version(nvrtc_dists[0])} ({nvrtc_dists[0]})" if nvrtc_dists else None
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
    try:  # what the CPU kernels compile to (Numba's target: NUMBA_CPU_NAME / NUMBA_CPU_FEATURES can narrow it)
        from freetoken.device.simd import bf16_dots, simd_level

        info["kernel_simd"] = simd_level()
        info["kernel_bf16_dots"] = bf16_dots()
    except Exception as e:  # llvmlite missing or broken: say so rather than fail the report
        info["kernel_simd"] = f"unknown ({e})"
    from freetoken.device.hugepages import thp_mode

    info["transparent_hugepages"] = thp_mode()
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                info["memory_gib"] = round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    return info


def _parallel_probe(a):
    """A tiny parallel Numba kernel (compiled on first use, then cached) that starts the threading layer."""
    global _probe
    if _probe is None:
        import numba

        @numba.njit(parallel=True, cache=True)
        def probe(a):
            s = 0.0
            for i in numba.prange(a.shape[0]):
                s += a[i]
            return s

        _probe = probe
    return _probe(a)


_probe = None


def threading_info() -> dict:
    """The cpu device's thread pools: Numba's threading layer (the one its parallel kernels run on: started here
    with a tiny cached kernel if none has run yet) and thread count against the cores this process may use, and
    the native pools threadpoolctl sees (BLAS, OpenMP) with their thread counts, and the BLAS limit freetoken
    applies while its kernels run (:mod:`freetoken.device.blas`)."""
    info: dict = {"cores_available": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else
                  os.cpu_count()}
    try:
        import numba
        import numpy as np

        info["numba_threads"] = numba.get_num_threads()
        info["numba_max_threads"] = numba.config.NUMBA_NUM_THREADS
        info["numba_layer_requested"] = str(numba.config.THREADING_LAYER)
        try:
            layer = numba.threading_layer()
        except ValueError:  # no parallel kernel has run: start the pool with a tiny one (cached after the first)
            _parallel_probe(np.ones(64, np.float32))
            layer = numba.threading_layer()
        info["numba_layer"] = layer
    except Exception as e:
        info["numba_error"] = f"{type(e).__name__}: {e}"
    info["omp_env"] = {k: os.environ[k] for k in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT",
                                                  "NUMBA_NUM_THREADS", "NUMBA_THREADING_LAYER",
                                                  "OPENBLAS_NUM_THREADS") if k in os.environ}
    pools = []
    try:
        from threadpoolctl import threadpool_info

        for p in threadpool_info():
            pools.append({"api": p.get("user_api"), "library": p.get("internal_api"),
                          "threads": p.get("num_threads"), "version": p.get("version"),
                          "path": p.get("filepath")})
    except Exception as e:
        info["pools_error"] = f"{type(e).__name__}: {e}"
    info["pools"] = pools
    try:
        from freetoken.device.blas import single_threaded_blas

        with single_threaded_blas():
            from threadpoolctl import threadpool_info

            limited = [p.get("num_threads") for p in threadpool_info() if p.get("user_api") == "blas"]
        info["blas_threads_in_kernels"] = max(limited) if limited else None
    except Exception:
        info["blas_threads_in_kernels"] = None
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
        "threads": threading_info(),
        "cache_dir": str(cache_dir()),
    }


#: The instructions the int8 expert dots compile to at each level (freetoken.device.simd).
_INT8_DOTS = {"avx512_vnni": "vpdpbusd, 512-bit", "avx2": "vpmaddubsw + vpmaddwd, 256-bit"}


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
              f"  SIMD: {' '.join(c['simd']) or 'none detected'}",
              f"  CPU kernels compiled for: {c.get('kernel_simd', '?')} (int8 expert dots: "
              f"{_INT8_DOTS.get(c.get('kernel_simd'), 'portable code, slow')}; bf16/fp8_block expert dots: "
              f"{'vdpbf16ps against bf16 tokens' if c.get('kernel_bf16_dots') else 'portable, fp8_block float32'})",
              f"  transparent huge pages: {_THP_NOTE.get(c.get('transparent_hugepages'), 'not available')}"]
    lines += _format_threads(info.get("threads"), c)
    lines += ["", "Libraries"]
    for name, ver in info["libraries"].items():
        lines.append(f"  {name:<24} {ver or 'not installed'}")
    lines += ["", f"Cache directory: {info['cache_dir']}"]
    return "\n".join(lines)


#: What each THP setting means for the weights the cpu device streams (freetoken.device.hugepages).
_THP_NOTE = {"always": "always (dense weights and expert banks on 2 MiB pages)",
             "madvise": "madvise (freetoken advises huge pages for the dense weights and expert banks)",
             "never": "never (weights on 4 KiB pages: decode reads them up to a third slower; "
                      "echo madvise > /sys/kernel/mm/transparent_hugepage/enabled)"}


def _format_threads(t: dict | None, cpu: dict) -> list[str]:
    if not t:
        return []
    lines = ["", "CPU threads"]
    cores = f"{t['cores_available']} usable cores ({cpu.get('physical_cores', '?')} physical)"
    if "numba_error" in t:
        lines.append(f"  Numba: unavailable ({t['numba_error']})")
    else:
        lines.append(f"  Numba: {t['numba_layer']} threading layer (requested: {t['numba_layer_requested']}), "
                     f"{t['numba_threads']} threads (at most {t['numba_max_threads']}) on {cores}")
    for p in t.get("pools", []):
        lines.append(f"  {p['api']} pool: {p['library']} {p['version'] or ''}, {p['threads']} threads  "
                     f"({p['path']})")
    blas = t.get("blas_threads_in_kernels")
    lines.append("  BLAS while freetoken's kernels run: "
                 + (f"limited to {blas} thread{'s' if blas != 1 else ''} (threadpoolctl)" if blas is not None
                    else "not limited (threadpoolctl cannot see this BLAS)"))
    if t.get("omp_env"):
        lines.append("  environment: " + " ".join(f"{k}={v}" for k, v in t["omp_env"].items()))
    return lines
