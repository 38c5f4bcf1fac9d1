"""The int8 row dots of the 4-bit formats (``cpu_kernels/moe_int8.py``), their panel micro-kernel
(``cpu_kernels/moe_int8_tile.py``) and the 8-bit activations (``cpu_kernels/q8_act.py``), at every SIMD level the
kernels compile to.

The level is fixed when Numba compiles, from its target features (``cpu_kernels/simd.py``), so this machine's
level runs in-process and the others run in subprocesses that compile for them (``NUMBA_CPU_NAME`` plus a feature
string with the wider features removed): the avx2 path and the portable path are compiled *and run* here, on
whichever CPU the suite has (AVX2 code runs on AVX-512 machines; the avx512_vnni path runs where the CPU has it and
is compiled for it elsewhere only when the host can run it).

Each dot is checked against float64 arithmetic on the dequantized weights and the dequantized 8-bit activations
(``quantize_q8_reference``, whose bytes must equal the kernel quantizer's): the integer part of the kernels is
exact, so the only difference is float32 accumulation of ``nblk`` block terms (tolerance ``1e-5`` of the sum of
|terms|).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numba as nb
import numpy as np
import pytest
from freetoken.cpu_kernels import moe_int8 as mi
from freetoken.cpu_kernels.moe_int8_tile import PANEL_BLOCK_BYTES, PANEL_ROWS, TILE_TOKENS
from freetoken.cpu_kernels.moe_memory import addr
from freetoken.cpu_kernels.moe_rows import E4M3_TABLE, E8M0_TABLE, FORMAT_CODES, block_split_perm
from freetoken.cpu_kernels.moe_rows_q8 import Q8_OFFSETS, panel_repack, panel_tile
from freetoken.cpu_kernels.q8_act import q8_buffers, quantize_rows

from freetoken import formats
from freetoken.device.simd import LEVELS, avx2_only_features, level_of, simd_level, target_features
from freetoken.formats import RecordLayout
from freetoken.testing import random_record
from freetoken.testing.reference.moe_experts import q8_round_trip, quantize_q8_reference

KINDS = {"q4_0": "q4", "mxfp4": "mx", "ds_fp4": "mx", "nvfp4": "nv"}  # format -> intrinsic family
_CODES = {"q4": 0, "mx": 1, "nv": 2}  # the family argument of _dots
BLOCKS = (1, 2, 3, 4, 5, 7, 24)


@nb.njit
def _dots(kind, w, s, stab, g, qa, nc, dx, kp, r, nblk, out):
    """out[0..9]: dot1(r0), dot2(r0, r1), dot4(r0..r3), dot1x2(r0) (rows w and w + 1)."""
    if kind == 0:
        out[0] = mi.q4_q8_dot1(w, s, stab, g, qa, nc, dx, kp, r[0], nblk)
        out[1:3] = mi.q4_q8_dot2(w, s, stab, g, qa, nc, dx, kp, r[0], r[1], nblk)
        out[3:7] = mi.q4_q8_dot4(w, s, stab, g, qa, nc, dx, kp, r[0], r[1], r[2], r[3], nblk)
        out[7:9] = mi.q4_q8_dot1x2(w, s, stab, g, qa, nc, dx, kp, r[0], nblk)
    elif kind == 1:
        out[0] = mi.mx_q8_dot1(w, s, stab, g, qa, nc, dx, kp, r[0], nblk)
        out[1:3] = mi.mx_q8_dot2(w, s, stab, g, qa, nc, dx, kp, r[0], r[1], nblk)
        out[3:7] = mi.mx_q8_dot4(w, s, stab, g, qa, nc, dx, kp, r[0], r[1], r[2], r[3], nblk)
        out[7:9] = mi.mx_q8_dot1x2(w, s, stab, g, qa, nc, dx, kp, r[0], nblk)
    else:
        out[0] = mi.nv_q8_dot1(w, s, stab, g, qa, nc, dx, kp, r[0], nblk)
        out[1:3] = mi.nv_q8_dot2(w, s, stab, g, qa, nc, dx, kp, r[0], r[1], nblk)
        out[3:7] = mi.nv_q8_dot4(w, s, stab, g, qa, nc, dx, kp, r[0], r[1], r[2], r[3], nblk)
        out[7:9] = mi.nv_q8_dot1x2(w, s, stab, g, qa, nc, dx, kp, r[0], nblk)


def check_format(fmt: str, nblk: int, seed: int = 0) -> None:
    """Rows 3 and 4 of expert 1's gate matrix (k = 32 * nblk) against 5 token rows (tokens used in a shuffled
    order), every dot arity."""
    k = 32 * nblk
    layout = RecordLayout(formats.get(fmt), k, 32)
    banks = random_record(layout, 2, seed=seed, scale=0.3)
    deq = layout.dequantize(banks)["gate"][1].astype(np.float64)  # [32, k]
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((5, k)).astype(np.float32) * np.float32(3.0)
    x[2, :32] = 0.0  # an all-zero block: scale 0
    kind = KINDS[fmt]
    xs = np.ascontiguousarray(x[:, block_split_perm(k)]) if kind != "q4" else x
    qa, nc, dx, cs = q8_buffers(5, k)
    quantize_rows(xs, np.int32(mi.OFFSET[kind]), kind != "q4", qa, nc, dx, cs)
    q_ref, d_ref = quantize_q8_reference(xs)
    np.testing.assert_array_equal(qa[:, :k], q_ref)
    np.testing.assert_array_equal(dx[:, :nblk], d_ref)
    xq = q8_round_trip(x)  # natural order (the split order permutes within blocks only)
    row_bytes, scale_bytes = 16 * nblk, banks["gate.s"][0].nbytes // 32
    w = banks["gate.w"].ctypes.data + (32 + 3) * row_bytes
    s = banks["gate.s"].ctypes.data + (32 + 3) * scale_bytes
    stab = E4M3_TABLE if kind == "nv" else E8M0_TABLE
    g = np.float32(banks["gate.g"][1]) if "gate.g" in banks else np.float32(1.0)
    order = np.array([4, 0, 2, 1], np.int64)
    out = np.full(9, np.nan, np.float32)
    _dots(_CODES[kind], np.uint64(w), np.uint64(s), np.uint64(stab.ctypes.data), g, np.uint64(qa.ctypes.data),
          np.uint64(nc.ctypes.data), np.uint64(dx.ctypes.data), np.uint64(qa.shape[1]), order, np.uint64(nblk), out)
    want = [(3, order[0]), (3, order[0]), (3, order[1]), *((3, t) for t in order), (3, order[0]), (4, order[0])]
    for i, (n, t) in enumerate(want):
        terms = deq[n] * xq[t]
        ref = terms.sum()
        tol = 1e-5 * np.abs(terms).sum() + 1e-30
        assert abs(out[i] - ref) <= tol, f"{fmt} nblk={nblk} level={simd_level()} out[{i}]={out[i]} ref={ref}"


@nb.njit
def _panel(fmt, w, s, g, e, n, rows, k, panel, pscale, xq, toks, out):
    panel_repack(fmt, w, s, g, e, n, rows, k, addr(panel), addr(pscale))
    panel_tile(fmt, addr(panel), addr(pscale), xq, addr(toks), k, addr(out))


def check_panel(fmt: str, nblk: int, seed: int = 0) -> None:
    """Rows 16-31 of expert 1's gate matrix against TILE_TOKENS of 11 token rows (shuffled, one repeated) through
    the panel micro-kernel."""
    k = 32 * nblk
    layout = RecordLayout(formats.get(fmt), k, 2 * PANEL_ROWS)
    banks = random_record(layout, 2, seed=seed, scale=0.3)
    deq = layout.dequantize(banks)["gate"][1].astype(np.float64)[PANEL_ROWS:]
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((11, k)).astype(np.float32) * np.float32(3.0)
    x[2, :32] = 0.0
    code = FORMAT_CODES[fmt]
    xs = np.ascontiguousarray(x[:, block_split_perm(k)]) if KINDS[fmt] != "q4" else x
    qa, nc, dx, cs = q8_buffers(11, k)
    quantize_rows(xs, np.int32(Q8_OFFSETS[code]), KINDS[fmt] != "q4", qa, nc, dx, cs)
    panel = np.full(nblk * PANEL_BLOCK_BYTES, 0xFF, np.uint8)
    pscale = np.full(nblk * 2 * PANEL_ROWS, np.nan, np.float32)
    toks = np.append(rng.permutation(11), [4] * TILE_TOKENS)[:TILE_TOKENS].astype(np.int64)
    toks[-1] = toks[0]
    out = np.full(TILE_TOKENS * PANEL_ROWS, np.nan, np.float32)
    g = banks["gate.g"] if "gate.g" in banks else np.zeros(2, np.float32)
    xq = tuple(np.uint64(v) for v in (qa.ctypes.data, nc.ctypes.data, dx.ctypes.data, qa.shape[1], cs.ctypes.data))
    _panel(code, np.uint64(banks["gate.w"].ctypes.data), np.uint64(banks["gate.s"].ctypes.data),
           np.uint64(g.ctypes.data), 1, PANEL_ROWS, 2 * PANEL_ROWS, k, panel, pscale, xq, toks, out)
    xq64 = q8_round_trip(x)[toks]
    want, size = xq64 @ deq.T, np.abs(xq64) @ np.abs(deq).T
    got = out.reshape(TILE_TOKENS, PANEL_ROWS)
    bad = np.abs(got - want) > 1e-5 * size + 1e-30
    assert not bad.any(), f"{fmt} nblk={nblk} level={simd_level()} panel: {np.argwhere(bad)[:4]} {got[bad][:4]}"


def run_all() -> None:
    for fmt in KINDS:
        for nblk in BLOCKS:
            check_format(fmt, nblk, seed=nblk)
            check_panel(fmt, nblk, seed=nblk)


def test_quantizer_matches_reference_and_propagates_nan():
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((3, 96)) * np.array([1e-30, 1.0, 1e30])[:, None]).astype(np.float32)
    x[1, 40] = np.nan
    x[2, 70] = np.inf
    qa, nc, dx, cs = q8_buffers(3, 96)
    quantize_rows(x, np.int32(8), True, qa, nc, dx, cs)
    q, d = quantize_q8_reference(x)
    np.testing.assert_array_equal(qa[:, :96], q)
    np.testing.assert_array_equal(dx[:, :3], d)
    assert np.isnan(dx[1, 1]) and np.isnan(dx[2, 2]) and not np.isnan(dx[0]).any()
    assert (qa[:, 96:] == 0).all() and (dx[:, 3] == 0).all() and (nc[:, 24:] == 0).all()
    np.testing.assert_array_equal(nc, -8 * qa.astype(np.int32).reshape(3, 32, 4).sum(-1))
    sums4 = nc.reshape(3, 4, 8)
    np.testing.assert_array_equal(cs[:, 0::2], sums4[..., [0, 1, 4, 5]].sum(-1))
    np.testing.assert_array_equal(cs[:, 1::2], sums4[..., [2, 3, 6, 7]].sum(-1))
    quantize_rows(x, np.int32(8), False, qa, nc, dx, cs)  # natural order: values 0-15 and 16-31
    np.testing.assert_array_equal(cs[:, 0::2], sums4[..., :4].sum(-1))
    np.testing.assert_array_equal(cs[:, 1::2], sums4[..., 4:].sum(-1))


def test_level_matches_features():
    assert simd_level() == level_of(target_features()) and simd_level() in LEVELS
    assert level_of({"avx2", "fma", "f16c"}) == "avx2"
    assert level_of({"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl"}) == "avx2"  # no VNNI: the avx2 path
    assert level_of({"avx512f", "avx512bw", "avx512vl", "avx512vnni", "avx2", "fma", "f16c"}) == "avx512_vnni"
    assert level_of({"neon"}) == "none"


@pytest.mark.parametrize("fmt", list(KINDS))
def test_dots_this_level(fmt):
    for nblk in BLOCKS:
        check_format(fmt, nblk, seed=nblk)


@pytest.mark.parametrize("fmt", list(KINDS))
def test_panel_this_level(fmt):
    for nblk in BLOCKS:
        check_panel(fmt, nblk, seed=nblk)


def _features_for(level: str) -> str | None:
    """A Numba feature string compiling for ``level`` on this host, or None where the host cannot run it."""
    have = target_features()
    if level == "avx2":
        return avx2_only_features() if {"avx2", "fma", "f16c"} <= have else None
    if level == "none":  # AVX without AVX2/FMA (an Ivy Bridge): F16C stays, the float path's q4_0 scales need it
        if "f16c" not in have:
            return None
        return ",".join(f if not f[1:].startswith(("avx2", "fma")) else "-" + f[1:]
                        for f in avx2_only_features().split(","))
    return None


@pytest.mark.slow
@pytest.mark.parametrize("level", ["avx2", "none"])
def test_dots_other_levels(level, tmp_path):
    if simd_level() == level:
        pytest.skip(f"{level} is this machine's level: test_dots_this_level ran it")
    features = _features_for(level)
    if features is None:
        pytest.skip(f"this CPU cannot run code compiled for {level}")
    env = dict(os.environ, NUMBA_CPU_NAME="haswell" if level == "avx2" else "ivybridge",
               NUMBA_CPU_FEATURES=features, FREETOKEN_CACHE_DIR=str(tmp_path), NUMBA_CACHE_DIR=str(tmp_path))
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import test_int8_dots as t; "
            "from freetoken.device.simd import simd_level; "
            f"assert simd_level() == {level!r}, simd_level(); t.run_all(); print('ok', simd_level())")
    r = subprocess.run([sys.executable, "-c", code, str(Path(__file__).parent)], env=env, capture_output=True,
                       text=True, timeout=900)
    assert r.returncode == 0 and r.stdout.strip() == f"ok {level}", r.stdout + r.stderr[-3000:]
