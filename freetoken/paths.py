"""Where freetoken finds its CUDA sources and keeps its caches."""

from __future__ import annotations

import os
from pathlib import Path


def cuda_dir() -> Path:
    """The directory holding ``*.cu``, ``*.cuh`` and ``emu/``.

    In a wheel the sources ship as ``freetoken/cuda``; in a source checkout (editable install) they are the
    top-level ``cuda/`` beside the package.
    """
    here = Path(__file__).resolve().parent
    for cand in (here / "cuda", here.parent / "cuda"):
        if (cand / "emu" / "ftemu.h").is_file():
            return cand
    raise FileNotFoundError(
        f"freetoken's CUDA sources are missing (looked in {here / 'cuda'} and {here.parent / 'cuda'}); "
        "reinstall the package"
    )


def cuda_source(name: str) -> Path:
    """Path of ``cuda/<name>`` (for example ``"topk.cu"``), with a clear error when it does not exist."""
    path = cuda_dir() / name
    if not path.is_file():
        raise FileNotFoundError(f"no CUDA source {name!r} in {cuda_dir()}")
    return path


def cpu_kernels_dir() -> Path:
    """The directory of the Numba kernels, the package ``freetoken.cpu_kernels``.

    In a wheel it is ``freetoken/cpu_kernels``; in a source checkout (editable install) the top-level
    ``cpu_kernels/`` beside the package. Found without importing it.
    """
    here = Path(__file__).resolve().parent
    for cand in (here / "cpu_kernels", here.parent / "cpu_kernels"):
        if (cand / "__init__.py").is_file():
            return cand
    raise FileNotFoundError(
        f"freetoken's Numba kernels are missing (looked in {here / 'cpu_kernels'} and {here.parent / 'cpu_kernels'}); "
        "reinstall the package"
    )


def cache_dir() -> Path:
    """Root of freetoken's on-disk caches: ``$FREETOKEN_CACHE_DIR``, else ``$XDG_CACHE_HOME/freetoken``."""
    env = os.environ.get("FREETOKEN_CACHE_DIR")
    if env:
        root = Path(env)
    else:
        root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "freetoken"
    root.mkdir(parents=True, exist_ok=True)
    return root


def cuda_include_dirs() -> list[Path]:
    """Include directories of the CUDA header wheels (runtime headers, crt, CCCL), those that are installed."""
    dirs = []
    try:
        import nvidia
    except ImportError:
        return dirs
    for base in nvidia.__path__:
        for sub in ("cuda_runtime", "cuda_nvcc", "cuda_cccl"):
            inc = Path(base) / sub / "include"
            if inc.is_dir():
                dirs.append(inc)
    return dirs


def cuda_runtime_include_dir() -> Path | None:
    """The one directory holding the CUDA runtime headers NVRTC needs (cuda_fp16.h, cuda_bf16.h, cuda_fp8.h).

    In order: the CUDA 12 header wheel (``nvidia/cuda_runtime/include``), CUDA 13's single-tree wheels
    (``nvidia/cu13/include``), then a system toolkit (``$CUDA_PATH``, ``$CUDA_HOME``, ``/usr/local/cuda``). Only
    one is used, so headers of two CUDA versions are never mixed."""
    candidates = []
    try:
        import nvidia

        for base in nvidia.__path__:
            candidates += [Path(base) / "cuda_runtime" / "include", Path(base) / "cu13" / "include"]
    except ImportError:
        pass
    for var in ("CUDA_PATH", "CUDA_HOME"):
        if os.environ.get(var):
            candidates.append(Path(os.environ[var]) / "include")
    candidates.append(Path("/usr/local/cuda/include"))
    for inc in candidates:
        if (inc / "cuda_fp16.h").is_file():
            return inc
    return None
