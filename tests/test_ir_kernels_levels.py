"""The explicit-vector CPU kernels (16-lane IR: ``cpu_kernels/lanes.py``) compiled for the SIMD levels this machine
is not: the decode attention (``paged_decode``), the few-token dense GEMV (``gemv._gemv16_kernel``), the fp8_block
expert rows (``moe_fp8``) and the bf16-token rows of bf16 and fp8_block (``moe_bf16act``: their portable code, where
this machine runs vdpbf16ps in-process) against float64 references, in subprocesses that compile for AVX2-only and
for AVX without AVX2/FMA (as tests/test_int8_dots.py does for the int8 dots). This machine's own level runs them
in-process in tests/test_paged_attention.py, tests/test_linear.py and tests/test_cpu_experts.py."""

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from test_int8_dots import _features_for

from freetoken.device.simd import simd_level


def _decode_attention():
    from freetoken import get_device, ops
    from freetoken.testing.reference.paged_attention import KV_DTYPES, paged_attention_reference

    cpu = get_device("cpu")
    rng = np.random.default_rng(0)
    for kind in ("f32", "f16", "bf16"):
        total, kv_heads, dim, heads = 700, 2, 48, 6
        k = rng.standard_normal((total, kv_heads, dim)).astype(np.float32)
        v = rng.standard_normal((total, kv_heads, dim)).astype(np.float32)
        table = rng.permutation(total // 64 + 2).astype(np.int32)
        pools = [np.zeros((table.size, 64, kv_heads, dim), KV_DTYPES[kind]) for _ in range(2)]
        ops.kv_store(k, v, pools[0], pools[1], None, None, table, 0, device=cpu)
        q = rng.standard_normal((1, heads, dim)).astype(np.float32)
        got = ops.paged_attention(q, pools[0], pools[1], None, None, table, total - 1, device=cpu)
        want = paged_attention_reference(q, pools[0], pools[1], None, None, table, total - 1)
        assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max(), kind


def _gemv():
    from freetoken.cpu_kernels import gemv as G

    rng = np.random.default_rng(1)
    for dtype in (np.float32, np.float16):
        w = rng.standard_normal((37, 80)).astype(dtype)
        wv = w.astype(np.float64)
        for t in (1, 3):
            x = rng.standard_normal((t, 80)).astype(np.float32)
            out = np.full((t, 37), np.nan, np.float32)
            G._gemv16_kernel(x, G.storage_view(w), out)
            want = x.astype(np.float64) @ wv.T
            assert np.abs(out - want).max() <= 1e-5 * np.abs(want).max(), dtype


def _fp8_rows():
    import numba
    from freetoken.cpu_kernels.moe_fp8 import fp8_dot1, fp8_dot2, fp8_dot4
    from freetoken.cpu_kernels.moe_memory import addr
    from freetoken.cpu_kernels.moe_rows import E4M3_TABLE

    @numba.njit
    def dots(w, s, x, out):  # row r: k codes at w[r], one scale per 128 values at s[r]; tokens: rows of x
        k = w.shape[1]
        for r in range(w.shape[0]):
            wa, sa = addr(w) + np.uint64(r * k), addr(s) + np.uint64(r * s.shape[1] * 4)
            out[0, r] = fp8_dot1(wa, sa, addr(x), 0, k)
            out[1, r], out[2, r] = fp8_dot2(wa, sa, addr(x), k, 2 * k, k)
            out[3, r], out[4, r], out[5, r], out[6, r] = fp8_dot4(wa, sa, addr(x), 3 * k, 4 * k, 5 * k, 6 * k, k)

    rng = np.random.default_rng(2)
    k = 160  # one whole 128-block and a tail of two chunks
    w = rng.integers(0, 256, (5, k)).astype(np.uint8)
    w[(w & 0x7F) == 0x7F] = 0x10  # no NaN codes here (tests/test_cpu_experts.py checks those)
    s = rng.uniform(0.5, 2.0, (5, 2)).astype(np.float32)
    x = rng.standard_normal((7, k)).astype(np.float32)
    out = np.full((7, 5), np.nan, np.float32)
    dots(w, s, x, out)
    wv = E4M3_TABLE[w].astype(np.float64) * np.repeat(s.astype(np.float64), 128, axis=1)[:, :k]
    want = x.astype(np.float64) @ wv.T
    assert np.abs(out - want).max() <= 1e-5 * np.abs(want).max()


def _bf16_token_rows():
    """The bf16-token row dots (``moe_bf16act``: vdpbf16ps where the target has AVX512-BF16 + VBMI, portable code
    elsewhere) and the tokens' rounding, against float64 on the bf16-rounded tokens: the products are exact, so only
    float32 summation separates them. K of one 32-chunk, a whole 128-block plus a tail, and several blocks."""
    import ml_dtypes
    import numba
    from freetoken.cpu_kernels.moe_bf16act import (
        bf16_bfa_dot1,
        bf16_bfa_dot2,
        bf16_bfa_dot4,
        bf16_round_row,
        fp8_bfa_dot1,
        fp8_bfa_dot2,
        fp8_bfa_dot4,
    )
    from freetoken.cpu_kernels.moe_memory import addr
    from freetoken.cpu_kernels.moe_rows import E4M3_TABLE

    @numba.njit
    def dots(w, s, wb, xb, out):
        k = w.shape[1]
        for r in range(w.shape[0]):
            wa, sa = addr(w) + np.uint64(r * k), addr(s) + np.uint64(r * s.shape[1] * 4)
            out[0, 0, r] = fp8_bfa_dot1(wa, sa, addr(xb), 0, k)
            out[0, 1, r], out[0, 2, r] = fp8_bfa_dot2(wa, sa, addr(xb), k, 2 * k, k)
            out[0, 3, r], out[0, 4, r], out[0, 5, r], out[0, 6, r] = fp8_bfa_dot4(wa, sa, addr(xb), 3 * k, 4 * k,
                                                                                  5 * k, 6 * k, k)
            ba = addr(wb) + np.uint64(2 * r * k)
            out[1, 0, r] = bf16_bfa_dot1(ba, addr(xb), 0, k)
            out[1, 1, r], out[1, 2, r] = bf16_bfa_dot2(ba, addr(xb), k, 2 * k, k)
            out[1, 3, r], out[1, 4, r], out[1, 5, r], out[1, 6, r] = bf16_bfa_dot4(ba, addr(xb), 3 * k, 4 * k, 5 * k,
                                                                                   6 * k, k)

    rng = np.random.default_rng(3)
    for k in (32, 160, 416):
        w = rng.integers(0, 256, (5, k)).astype(np.uint8)
        w[(w & 0x7F) == 0x7F] = 0x21
        s = rng.uniform(0.5, 2.0, (5, -(-k // 128))).astype(np.float32)
        wb = rng.standard_normal((5, k)).astype(ml_dtypes.bfloat16)
        x = (rng.standard_normal((7, k)) * 3).astype(np.float32)
        x[0, :3] = [np.inf, -np.inf, 3.3e38]  # rounding at the top of the range
        xr = np.zeros((7, 2 * k), np.int8)
        for t in range(7):
            bf16_round_row(x, t, xr)
        assert np.array_equal(xr.view(np.uint16), x.astype(ml_dtypes.bfloat16).view(np.uint16)), k
        x[0, :3] = 1.0
        xb = x.astype(ml_dtypes.bfloat16)
        out = np.full((2, 7, 5), np.nan, np.float32)
        dots(w, s, wb.view(np.uint16), xb.view(np.uint16), out)
        wv = E4M3_TABLE[w].astype(np.float64) * np.repeat(s.astype(np.float64), 128, axis=1)[:, :k]
        for i, want in enumerate((xb.astype(np.float64) @ wv.T, xb.astype(np.float64) @ wb.astype(np.float64).T)):
            assert np.abs(out[i] - want).max() <= 1e-5 * np.abs(want).max(), (k, i)


def run_all():
    _decode_attention()
    _gemv()
    _fp8_rows()
    _bf16_token_rows()


@pytest.mark.slow
@pytest.mark.parametrize("level", ["avx2", "none"])
def test_ir_kernels_other_levels(level, tmp_path):
    if simd_level() == level:
        pytest.skip(f"{level} is this machine's level: the kernels' own tests ran it")
    features = _features_for(level)
    if features is None:
        pytest.skip(f"this CPU cannot run code compiled for {level}")
    env = dict(os.environ, NUMBA_CPU_NAME="haswell" if level == "avx2" else "ivybridge",
               NUMBA_CPU_FEATURES=features, FREETOKEN_CACHE_DIR=str(tmp_path), NUMBA_CACHE_DIR=str(tmp_path))
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import test_ir_kernels_levels as t; "
            "from freetoken.device.simd import simd_level; "
            f"assert simd_level() == {level!r}, simd_level(); t.run_all(); print('ok', simd_level())")
    r = subprocess.run([sys.executable, "-c", code, str(Path(__file__).parent)], env=env, capture_output=True,
                       text=True, timeout=900)
    assert r.returncode == 0 and r.stdout.strip() == f"ok {level}", r.stdout + r.stderr[-3000:]


def test_ir_kernels_this_level():
    """The same checks in-process (this machine's level), so the subprocess body is known to pass here."""
    run_all()
