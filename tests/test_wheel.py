"""The built wheel carries the CUDA sources and the Numba kernels, and works outside the source tree."""

import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", str(out), str(ROOT)],
        capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    wheels = list(out.glob("freetoken-*.whl"))
    assert len(wheels) == 1
    return wheels[0]


@pytest.mark.slow
def test_wheel_contents(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    for src in (ROOT / "cuda").glob("*.cu*"):
        assert f"freetoken/cuda/{src.name}" in names
    assert "freetoken/cuda/emu/ftemu.h" in names
    assert "freetoken/serve/static/chat.html" in names  # the chat page (GET /)
    for mod in (ROOT / "cpu_kernels").glob("*.py"):
        assert f"freetoken/cpu_kernels/{mod.name}" in names
    for init in (ROOT / "freetoken").rglob("__init__.py"):  # every subpackage (the package list is explicit)
        rel = init.relative_to(ROOT).as_posix()
        assert rel in names, f"{rel} is missing from the wheel: add its package to pyproject.toml"


@pytest.mark.slow
def test_installed_wheel_finds_sources_and_kernels(wheel, tmp_path):
    target = tmp_path / "site"
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--target", str(target), str(wheel)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    probe = textwrap.dedent("""
        import sys, numpy as np
        import freetoken, freetoken.paths
        from freetoken.cpu_kernels.reduce import row_sum_f32
        from freetoken import ops
        from freetoken.device import device_status
        assert freetoken.__file__.startswith(sys.argv[1]), freetoken.__file__
        from freetoken.device import numba_cache
        assert str(numba_cache.kernel_sources()["freetoken.cpu_kernels.reduce"]).startswith(sys.argv[1])
        numba_dir = numba_cache.configured_dir()
        assert numba_dir.parent == freetoken.paths.cache_dir() / "numba", numba_dir
        assert row_sum_f32._cache.cache_path.startswith(str(numba_dir)), row_sum_f32._cache.cache_path
        print("cuda_dir", freetoken.paths.cuda_dir())
        x = np.arange(12, dtype=np.float32).reshape(3, 4)
        assert np.allclose(ops.row_sum(x, device="cpu"), x.sum(1))
        if device_status()["emu"][0]:
            assert np.allclose(ops.row_sum(x, device="emu"), x.sum(1))
            print("emu ok")
        print("wheel ok")
    """)
    env = {"PYTHONPATH": str(target), "PATH": "/usr/bin:/bin", "FREETOKEN_CACHE_DIR": str(tmp_path / "cache"),
           "HOME": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-c", probe, str(target)], capture_output=True, text=True, cwd=tmp_path,
                          env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert f"cuda_dir {target / 'freetoken' / 'cuda'}" in proc.stdout
    assert "wheel ok" in proc.stdout
    from freetoken.device import device_status

    if device_status()["emu"][0]:
        assert "emu ok" in proc.stdout
