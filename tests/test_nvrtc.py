"""Every CUDA source compiles through NVRTC for every target architecture, with the gpu device's options."""

from pathlib import Path

import pytest

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


def test_prefill_fallback_compiles_for_gpus():
    """FREETOKEN_NO_MMA=1 builds the prefill kernels without tensor cores; that build must stay warning-free too."""
    src = cuda_dir() / "moe_prefill.cu"
    compile_cubin(src.read_text(), src.name, "sm_86", ["-DFT_NO_MMA"])
