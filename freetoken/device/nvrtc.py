"""Run-time CUDA compilation through NVRTC, with an on-disk cubin cache.

The same function serves the gpu device (for the card's own architecture) and the test suite's compile check
(for every target architecture), so the check compiles with exactly the options the gpu device uses. NVRTC
needs no GPU and no driver. It has no warnings-as-errors switch, so any warning in the log fails the compile.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from collections.abc import Sequence

from freetoken.device.constants import define_options
from freetoken.paths import cache_dir, cuda_dir, cuda_runtime_include_dir

#: The architectures every source must compile for: A100/3090 (80/86), 4090 (89), H100 (90), 5090 (120).
TARGET_ARCHS = ("sm_80", "sm_86", "sm_89", "sm_90", "sm_120")


class NvrtcError(RuntimeError):
    """A CUDA source failed to compile (or compiled with warnings); the message carries the NVRTC log."""


def _nvrtc():
    try:
        from cupy.cuda import nvrtc
    except Exception as e:  # pragma: no cover - depends on the installation
        raise NvrtcError(f"NVRTC is not available through CuPy ({e}); install cupy-cuda12x and "
                         "nvidia-cuda-nvrtc-cu12") from e
    return nvrtc


def nvrtc_version() -> tuple[int, int]:
    return tuple(_nvrtc().getVersion())  # type: ignore[return-value]


def base_options(arch: str) -> list[str]:
    """The options the gpu device compiles with for ``arch`` (``"sm_86"``): the shared constants
    (:func:`freetoken.device.constants.define_options`) included."""
    opts = ["-std=c++17", f"--gpu-architecture={arch}", f"-I{cuda_dir()}", "-DNDEBUG", *define_options()]
    runtime_headers = cuda_runtime_include_dir()
    if runtime_headers is not None:
        opts.append(f"-I{runtime_headers}")
    return opts


def include_tree_digest() -> str:
    """Hash of every shared header under cuda/, so editing a ``.cuh`` invalidates cached binaries."""
    h = hashlib.sha256()
    root = cuda_dir()
    for p in sorted(root.rglob("*")):
        if p.is_file() and p.suffix in (".cuh", ".h"):
            h.update(str(p.relative_to(root)).encode())
            h.update(p.read_bytes())
    return h.hexdigest()


def compile_cubin(source: str, name: str, arch: str, options: Sequence[str] = ()) -> bytes:
    """Compile ``source`` (named ``name`` in messages) to a cubin for ``arch``; cached on disk by content."""
    nvrtc = _nvrtc()
    opts = base_options(arch) + list(options)
    key = hashlib.sha256(
        "\0".join([source, name, *opts, repr(nvrtc_version()), include_tree_digest()]).encode()
    ).hexdigest()
    path = cache_dir() / "nvrtc" / f"{key}.cubin"
    if path.is_file():
        return path.read_bytes()
    prog = nvrtc.createProgram(source, name, [], [])
    try:
        try:
            nvrtc.compileProgram(prog, opts)
        except nvrtc.NVRTCError as e:
            raise NvrtcError(f"{name} failed to compile for {arch}: {e}\n{nvrtc.getProgramLog(prog)}") from None
        log = nvrtc.getProgramLog(prog)
        if "warning" in log:
            raise NvrtcError(f"{name} compiled for {arch} with warnings (warnings are errors):\n{log}")
        cubin = nvrtc.getCUBIN(prog)
    finally:
        nvrtc.destroyProgram(prog)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
    with os.fdopen(fd, "wb") as f:
        f.write(cubin)
    os.replace(tmp, path)
    return cubin


def best_arch(major: int, minor: int) -> str:
    """The newest architecture NVRTC supports that a device of compute capability major.minor can run."""
    supported = sorted(_nvrtc().getSupportedArchs())
    cc = major * 10 + minor
    same_major = [a for a in supported if a // 10 == major and a <= cc]
    if not same_major:
        raise NvrtcError(f"NVRTC {nvrtc_version()} cannot target compute capability {major}.{minor}")
    return f"sm_{same_major[-1]}"
