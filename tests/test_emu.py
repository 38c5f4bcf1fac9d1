"""The emu device: each emulated CUDA feature against NumPy, and misuse reported instead of hanging."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from freetoken.device import get_device
from freetoken.device.emu import EmuKernelError
from freetoken.device.emu_build import EmuBuildError

HERE = Path(__file__).parent
pytestmark = pytest.mark.skipif(not __import__("freetoken.device", fromlist=["x"]).device_status()["emu"][0],
                                reason="emu device unavailable")


@pytest.fixture(scope="module")
def emu():
    return get_device("emu")


@pytest.fixture(scope="module")
def features(emu):
    return emu.load_module((HERE / "cuda_emu" / "features.cu").read_text(), name="features.cu")


@pytest.fixture(scope="module")
def misuse(emu):
    return emu.load_module((HERE / "cuda_broken" / "misuse.cu").read_text(), name="misuse.cu")


def test_kernels_discovered(features):
    assert {"index3d", "collectives", "atomics", "fp_types", "math_fns", "struct_arg"} <= set(features.kernels)


def test_index3d(features):
    grid, block = (3, 2, 2), (4, 3, 2)
    nt, nb = 24, 12
    out = np.full((nb * nt, 8), -1, np.int32)
    features.get_function("index3d")(grid, block, (out,))
    want = []
    for bz in range(2):
        for by in range(2):
            for bx in range(3):
                for tz in range(2):
                    for ty in range(3):
                        for tx in range(4):
                            want.append([tx, ty, tz, bx, by, bz, nt, nb + 32000])
    np.testing.assert_array_equal(out, np.array(want, np.int32))


def _collectives_ref(v, width, delta):
    n = v.size
    lanes = np.arange(n) % 32
    warp0 = np.arange(n) - lanes
    seg = lanes & ~(width - 1)
    out = np.zeros((11, n), np.int64)
    src = seg | (((lanes * 7 + 3) & 31) & (width - 1))
    out[0] = v[warp0 + src]
    up = np.where(lanes - delta < seg, lanes, lanes - delta)
    out[1] = v[warp0 + up]
    down = np.where(lanes + delta >= seg + width, lanes, lanes + delta)
    out[2] = v[warp0 + down]
    x = lanes ^ delta
    xo = np.where((x & ~(width - 1)) != seg, lanes, x)
    out[3] = v[warp0 + xo]
    for w in range(n // 32):
        s = slice(32 * w, 32 * w + 32)
        vw = v[s]
        out[4, s] = np.int64(np.sum((vw & 1).astype(np.int64) << np.arange(32))).astype(np.uint32).view(np.int32)
        out[5, s] = int((vw > 90).any())
        out[6, s] = int((vw >= 0).all())
        out[7, s] = -1  # 0xffffffff as int32
        for lane in range(32):
            m = np.sum(((vw & 3) == (vw[lane] & 3)).astype(np.int64) << np.arange(32))
            out[8, 32 * w + lane] = np.array(m, np.uint64).astype(np.uint32).view(np.int32)
        out[9, s] = vw.sum()
        out[10, s] = vw.max()
    return out.astype(np.int32)


@pytest.mark.parametrize("width,delta", [(32, 1), (32, 5), (16, 3), (8, 4), (4, 1), (32, 16)])
def test_warp_collectives(features, width, delta):
    v = np.random.default_rng(width * 10 + delta).integers(0, 100, size=96).astype(np.int32)
    out = np.full((11, 96), -7, np.int32)
    features.get_function("collectives")((3,), (32,), (v, out, np.int32(width), np.int32(delta)))
    np.testing.assert_array_equal(out, _collectives_ref(v, width, delta))


def test_atomics(features):
    nblocks, nthreads = 13, 64
    n = nblocks * nthreads
    i32 = np.array([0, 0, -(2**31), 2**31 - 1, 0, 0, 0], np.int32)
    u32 = np.array([0, 0xFFFFFFFF, 0, 0, 0], np.uint32)
    u64 = np.zeros(2, np.uint64)
    i64 = np.array([-(2**63), 2**63 - 1], np.int64)
    f32 = np.zeros(1, np.float32)
    features.get_function("atomics")((nblocks,), (nthreads,), (i32, u32, u64, i64, f32))
    assert list(i32) == [n, -2 * n, n - 1, -(n - 1), 3 * n, 7, n]
    assert list(u32) == [0xFFFFFFFF, 0, n % 2, n % 10, 2 * n]
    assert list(u64) == [n * (n - 1) // 2, (n - 1) << 40]
    assert list(i64) == [(n - 1) * 10**9, -(n - 1) * 10**9]
    assert f32[0] == 0.5 * n


def test_barrier_reductions(features):
    out = np.zeros(3, np.int32)
    features.get_function("barrier_reductions")((1,), (100,), (out,))
    assert list(out) == [34, 1, 1]


def test_fp_types_match_ml_dtypes(features):
    rng = np.random.default_rng(5)
    x = np.concatenate([rng.standard_normal(200) * 10, [0.0, -0.0, 1e-8, -3e-3, 300.0, 65504.0 / 1000]]).astype(
        np.float32
    )
    out = np.full((x.size, 4), np.nan, np.float32)
    features.get_function("fp_types")((2,), (128,), (x, out, np.int32(x.size)))
    for col, dt in enumerate([np.float16, ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2]):
        np.testing.assert_array_equal(out[:, col], x.astype(dt).astype(np.float32), err_msg=str(dt))


def test_math_intrinsics(features):
    rng = np.random.default_rng(9)
    n = 77
    x = (rng.standard_normal(n) * 3).astype(np.float32)
    u = rng.integers(0, 2**32, size=n, dtype=np.uint64).astype(np.uint32)
    u[:3] = [0, 1, 0x80000000]
    fo = np.full((n, 6), np.nan, np.float32)
    uo = np.zeros((n, 5), np.uint32)
    features.get_function("math_fns")((1,), (96,), (x, u, fo, uo, np.int32(n)))
    np.testing.assert_allclose(fo[:, 0], 1 / np.sqrt(np.abs(x) + 1), rtol=1e-6)
    np.testing.assert_allclose(fo[:, 1], np.exp(x), rtol=1e-5)
    np.testing.assert_allclose(fo[:, 2], x / 3, rtol=1e-6)
    np.testing.assert_array_equal(fo[:, 3], np.clip(x, 0, 1))
    np.testing.assert_allclose(fo[:, 4], np.maximum(x, 0) + np.minimum(x, 1) + np.maximum(-1, x), rtol=1e-6)
    np.testing.assert_array_equal(fo[:, 5], -x)
    bits = np.unpackbits(u.view(np.uint8)).reshape(n, 32)
    np.testing.assert_array_equal(uo[:, 0], bits.sum(1))
    clz = np.array([32 if w == 0 else 31 - int(w).bit_length() + 1 for w in u])
    np.testing.assert_array_equal(uo[:, 1], clz)
    np.testing.assert_array_equal(uo[:, 2], [int(f"{int(w):032b}"[::-1], 2) for w in u])
    y = 0x01234567
    sel = [(0x5140 >> (4 * i)) & 7 for i in range(4)]
    want = [sum((((int(y) << 32 | int(w)) >> (8 * s)) & 0xFF) << (8 * i) for i, s in enumerate(sel)) for w in u]
    np.testing.assert_array_equal(uo[:, 3], want)
    np.testing.assert_array_equal(uo[:, 4], [(int(w) * 0x9E3779B9) >> 32 for w in u])


def test_struct_by_value(features):
    dt = np.dtype([("n", np.int32), ("scale", np.float32), ("offset", np.int64), ("bias", np.float64)], align=True)
    assert dt.itemsize == 24
    p = np.array((50, 0.25, 1000, 0.5), dtype=dt)[()]
    out = np.full(64, np.nan, np.float32)
    features.get_function("struct_arg")((1,), (64,), (p, out))
    np.testing.assert_array_equal(out[:50], 0.25 * np.arange(50, dtype=np.float32) + 1000.5)
    assert np.isnan(out[50:]).all()


def test_static_shared_is_per_block(features):
    x = np.arange(5 * 128, dtype=np.int32)
    out = np.zeros_like(x)
    features.get_function("shared_reverse")((5,), (16, 8), (x, out))
    np.testing.assert_array_equal(out.reshape(5, 128), x.reshape(5, 128)[:, ::-1])


# ---- argument and launch checks --------------------------------------------------------------------------
def test_argument_kind_mismatch(features):
    out = np.zeros(8, np.float32)
    with pytest.raises(EmuKernelError, match="argument 0 must be a struct"):
        features.get_function("struct_arg")((1,), (8,), (np.int32(3), out))
    with pytest.raises(EmuKernelError, match="argument 2 must be a signed integer of 4 bytes; got kind 'i' of 8"):
        features.get_function("fp_types")((1,), (8,), (out, out, np.int64(2)))
    with pytest.raises(EmuKernelError, match="takes 3 arguments, got 2"):
        features.get_function("fp_types")((1,), (8,), (out, out))
    with pytest.raises(TypeError, match="Python int"):
        features.get_function("fp_types")((1,), (8,), (out, out, 2))


def test_launch_bounds_and_block_limits(emu):
    topk = emu.load_cuda("topk.cu").get_function("topk_rows_f32")
    x = np.zeros((1, 4), np.float32)
    args = (x, np.zeros((1, 1), np.int32), np.zeros((1, 1), np.float32), np.int32(1), np.int32(4), np.int32(1))
    with pytest.raises(EmuKernelError, match=r"exceeds its __launch_bounds__\(256\)"):
        topk((1,), (512,), args)
    with pytest.raises(EmuKernelError, match="not a valid CUDA block"):
        topk((1,), (32, 32, 2), args)
    with pytest.raises(EmuKernelError, match="99 KiB"):
        topk((1,), (32,), args, shared_mem=200_000)


def test_unknown_kernel_lists_known(features):
    with pytest.raises(KeyError, match="index3d"):
        features.get_function("nope")


# ---- misuse ------------------------------------------------------------------------------------------------
def test_divergent_barrier_is_reported(misuse):
    x = np.zeros(64, np.float32)
    with pytest.raises(EmuKernelError, match=r"kernel divergent_barrier: __syncthreads\(\) at misuse\.cu:7 reached by "
                                             r"40 of 64 threads"):
        misuse.get_function("divergent_barrier")((2,), (64,), (x, np.int32(40)))
    misuse.get_function("divergent_barrier")((2,), (64,), (x, np.int32(64)))  # uniform: fine


def test_different_barriers_are_reported(misuse):
    with pytest.raises(EmuKernelError, match="split_barrier: threads of one block wait at different __syncthreads"):
        misuse.get_function("split_barrier")((1,), (32,), (np.zeros(32, np.float32),))


def test_mismatched_mask_is_reported(misuse):
    with pytest.raises(EmuKernelError, match="mismatched_mask"):
        misuse.get_function("mismatched_mask")((1,), (32,), (np.zeros(32, np.float32),))


def test_exited_lane_is_reported(misuse):
    with pytest.raises(EmuKernelError, match=r"exited_lane: __shfl_down_sync\(mask=0xffffffff\) .*lane 8 \(exited\)"):
        misuse.get_function("exited_lane")((1,), (32,), (np.zeros(32, np.float32),))


def test_partial_mask_is_fine(misuse):
    x = np.arange(32, dtype=np.float32)
    misuse.get_function("partial_mask_ok")((1,), (32,), (x,))
    np.testing.assert_array_equal(x[:16], np.arange(16) ^ 1)
    np.testing.assert_array_equal(x[16:], np.arange(16, 32))


def test_file_scope_extern_shared_is_refused(emu):
    src = 'extern __shared__ float s[];\nextern "C" __global__ void k(float* x) { x[0] = s[0]; }\n'
    with pytest.raises(EmuBuildError, match="at file scope is not supported"):
        emu.load_module(src, name="filescope.cu")


def test_non_extern_c_kernel_is_refused(emu):
    with pytest.raises(EmuBuildError, match="kernel 'k' is not extern \"C\""):
        emu.load_module("__global__ void k(float* x) { x[0] = 1.0f; }\n", name="cpp.cu")


def test_compile_error_shows_compiler_output(emu):
    with pytest.raises(EmuBuildError, match="bad.cu.*undeclared_name"):
        emu.load_module('extern "C" __global__ void k(float* x) { x[0] = undeclared_name; }\n', name="bad.cu")


def _libasan() -> str | None:
    out = subprocess.run(["g++", "-print-file-name=libasan.so"], capture_output=True, text=True).stdout.strip()
    return out if os.path.isabs(out) and os.path.exists(out) else None


@pytest.mark.slow
@pytest.mark.skipif(_libasan() is None, reason="libasan not installed")
def test_out_of_bounds_read_reported_by_asan(tmp_path):
    script = tmp_path / "probe.py"
    script.write_text(textwrap.dedent(f"""
        import numpy as np
        from freetoken.device import get_device
        dev = get_device("emu")
        src = open({str(HERE / "cuda_broken" / "misuse.cu")!r}).read()
        m = dev.load_module(src, name="misuse.cu", sanitize="address")
        x = np.arange(100, dtype=np.float32); y = np.zeros(100, np.float32)
        m.get_function("partial_mask_ok")((1,), (32,), (y,))
        print("clean kernel ran", flush=True)
        m.get_function("oob_read")((4,), (32,), (x, y, np.int32(100)))
        print("out-of-bounds read NOT detected", flush=True)
    """))
    env = dict(os.environ, LD_PRELOAD=_libasan(), ASAN_OPTIONS="detect_leaks=0")
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=300)
    assert "clean kernel ran" in proc.stdout, proc.stderr[-3000:]
    assert "NOT detected" not in proc.stdout
    assert proc.returncode != 0
    assert "heap-buffer-overflow" in proc.stderr and "misuse.cu:41" in proc.stderr, proc.stderr[-3000:]


def test_fiber_stacks_take_few_mappings(emu):
    """A module's first launch maps its fiber-stack arenas; only the stacks a block runs on get a guard page. Each
    guard page splits the mapping, and the process may hold vm.max_map_count (65530) in all: guarding all 1024
    stacks of every arena took 2048 mappings per arena and module, and a test process with a few dozen modules
    loaded ran out (Numba's JIT then aborted: LLVM could not map a section)."""
    if not os.path.exists("/proc/self/maps"):
        pytest.skip("no /proc/self/maps to count mappings in")
    src = ('extern "C" __global__ void fill_stack_probe(float* y) { y[threadIdx.x] = threadIdx.x; }\n')
    m = emu.load_module(src, name="stack_probe.cu")
    y = np.zeros(64, np.float32)

    def count() -> int:
        with open("/proc/self/maps") as f:
            return sum(1 for _ in f)

    before = count()
    m.get_function("fill_stack_probe")((4,), (64,), (y,))
    grown = count() - before
    np.testing.assert_array_equal(y, np.arange(64, dtype=np.float32))
    assert grown < 600, grown  # about 2 per guarded stack and worker; 4,000+ before the fix
