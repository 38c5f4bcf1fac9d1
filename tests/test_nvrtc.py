"""Every CUDA source compiles through NVRTC for every target architecture, with the gpu device's options (the shared
constants of freetoken/device/constants.py included)."""

import re
from pathlib import Path

import pytest

from freetoken.device import constants
from freetoken.device.constants import CUDA_DEFINES
from freetoken.device.emu_build import EmuBuildError
from freetoken.device.emu_build import build as emu_build
from freetoken.device.nvrtc import TARGET_ARCHS, NvrtcError, compile_cubin
from freetoken.paths import cuda_dir

TESTS = Path(__file__).parent
SOURCES = sorted(cuda_dir().glob("*.cu")) + sorted(TESTS.glob("cuda_*/*.cu"))


def test_sources_found():
    names = {p.name for p in SOURCES}
    assert {"reduce.cu", "topk.cu", "histogram.cu", "transpose.cu"} <= names


@pytest.mark.parametrize("arch", TARGET_ARCHS)
@pytest.mark.parametrize("source", SOURCES, ids=lambda p: p.name)
def test_compiles(source, arch):
    cubin = compile_cubin(source.read_text(), source.name, arch)
    assert cubin[:4] == b"\x7fELF"


def test_error_names_file_and_shows_log():
    with pytest.raises(NvrtcError, match=r"broken\.cu failed to compile for sm_86[\s\S]*undefined_thing"):
        compile_cubin('extern "C" __global__ void k(float* x) { x[0] = undefined_thing; }', "broken.cu", "sm_86")


def test_warnings_are_errors():
    src = 'extern "C" __global__ void k(float* x) { int unused = 3; x[0] = 1.0f; }'
    with pytest.raises(NvrtcError, match=r"warn\.cu compiled for sm_80 with warnings[\s\S]*unused"):
        compile_cubin(src, "warn.cu", "sm_80")


@pytest.mark.parametrize("name", ["moe_prefill.cu", "paged_attention.cu"])
def test_prefill_fallback_compiles_for_gpus(name):
    """FREETOKEN_NO_MMA=1 builds the prefill kernels without tensor cores; that build must stay warning-free too."""
    src = cuda_dir() / name
    compile_cubin(src.read_text(), src.name, "sm_86", ["-DFT_NO_MMA"])


def _package_sources() -> dict[str, str]:
    root = cuda_dir()
    return {p.name: p.read_text() for p in sorted(root.glob("*.cu")) + sorted(root.glob("*.cuh"))}


def test_every_shared_constant_is_used_and_defined_once():
    """Each constant of device/constants.py is used by some source; no source #defines one of them."""
    sources = _package_sources()
    for name in CUDA_DEFINES:
        assert any(re.search(rf"\b{name}\b", s) for s in sources.values()), f"{name} is used by no source"
        for file, text in sources.items():
            assert not re.search(rf"#\s*define\s+{name}\b", text), f"{file} defines {name} itself"


def test_compile_without_the_constants_fails(monkeypatch):
    monkeypatch.setattr(constants, "CUDA_DEFINES", {})
    src = cuda_dir() / "reduce.cu"
    with pytest.raises(NvrtcError, match="FT_\\* constants are missing"):
        compile_cubin(src.read_text(), src.name, "sm_86")
    with pytest.raises(EmuBuildError, match="FT_\\* constants are missing"):
        emu_build(src.read_text(), src.name)
