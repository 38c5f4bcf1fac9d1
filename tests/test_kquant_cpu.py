"""The CPU kernels of the GGUF block formats (q8_0, q4_k, q5_k, q6_k, iq4_xs): the row dots of
``cpu_kernels/moe_kquant.py`` through the expert forward (``cpu_kernels/moe_experts.py``) and the dense products
(``cpu_kernels/qgemv.py``), against gguf-py's ``dequantize`` (the authority on the formats) on random GGUF bytes:
every bit of the scales, mins and quants random, only the fp16 fields drawn finite (normal and subnormal). Mixed
records (gate/up in one format, down in another: GGUF Q4_K_M) through ``ops.moe_experts``. The registry cases
(tests/test_kernel_parity.py, moe_decode_*) check every format through the codecs' own quantizer.

The int8 row dots (``cpu_kernels/moe_int8_kquant.py``, q8_0's in ``cpu_kernels/moe_int8.py``) run the same checks
with ``activations="q8"`` against the reference with the same 8-bit rounding of x and h.

Tolerances as in tests/test_cpu_experts.py: float32 dot products against float64, ``2e-5 * max|ref|`` (int8 path:
``Q8_REL_ATOL``); a wrongly decoded weight moves outputs by ~1e-2 of it. The decode itself is bit-exact (the scale
products are exact in float32 and q4_k/q5_k's ``d * sc * q - dmin * m`` rounds once, as gguf-py's does), so
``dequantize_rows`` is compared bit for bit.
"""

import os
import subprocess
import sys
from pathlib import Path

import numba
import numpy as np
import pytest
from freetoken.cpu_kernels.moe_experts import ACT_GPT_OSS, ACT_SWIGLU, FORMAT_CODES, forward, prepare, uses_q8
from freetoken.cpu_kernels.moe_int8_tile import MIN_AT, PANEL_BLOCK_BYTES, PANEL_ROWS, TILE_TOKENS
from freetoken.cpu_kernels.moe_kquant import KQUANT_CODES, kq_dot1, kq_dot1x2, kq_dot2, kq_dot4
from freetoken.cpu_kernels.moe_memory import addr
from freetoken.cpu_kernels.moe_rows_q8 import (
    Q8_OFFSETS,
    panel_repack,
    panel_tile,
    row_q8_dot1,
    row_q8_dot1x2,
    row_q8_dot2,
    row_q8_dot4,
)
from freetoken.cpu_kernels.q8_act import q8_buffers, quantize_rows
from freetoken.cpu_kernels.qgemv import KQUANT_BLOCK_BYTES, dequantize_rows, qmatmul_into

from freetoken import formats, ops
from freetoken.device.simd import simd_level
from freetoken.formats import MATRICES, RecordLayout
from freetoken.testing import assert_close, poison, random_record
from freetoken.testing.cases.moe_experts import PREFILL_REL_ATOL, Q8_REL_ATOL
from freetoken.testing.reference.moe_experts import moe_forward_reference, q8_round_trip

gguf_quants = pytest.importorskip("gguf.quants")
from gguf import GGMLQuantizationType  # noqa: E402

KINDS = ("q8_0", "q4_k", "q5_k", "q6_k", "iq4_xs")
#: weights per block, block bytes, byte offsets of the fp16 fields, magnitude of d (weights of order 0.01 to 0.1)
BLOCKS = {"q8_0": (32, 34, (0,), 1e-3), "q4_k": (256, 144, (0, 2), 1e-4), "q5_k": (256, 176, (0, 2), 5e-5),
          "q6_k": (256, 210, (208,), 2e-5), "iq4_xs": (256, 136, (0,), 2e-5)}


def gguf_bytes(kind: str, shape: tuple, k: int, seed: int) -> np.ndarray:
    """Random GGUF rows uint8 [*shape, K/block * block bytes] of ``kind``: random bytes, the fp16 fields replaced by
    random-signed values of about the kind's magnitude (fp16 subnormals among them)."""
    block, nbytes, halves, mag = BLOCKS[kind]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (*shape, k // block, nbytes), dtype=np.uint8)
    for off in halves:
        d = rng.uniform(0.2, 1.0, raw.shape[:-1]) * mag * rng.choice([-1.0, 1.0], raw.shape[:-1])
        raw[..., off:off + 2] = d.astype("<f2")[..., None].view(np.uint8)
    return raw.reshape(*shape, -1)


def gguf_dequantize(kind: str, raw: np.ndarray, k: int) -> np.ndarray:
    """float32 [..., K] of GGUF rows, by gguf-py."""
    out = gguf_quants.dequantize(raw, GGMLQuantizationType[kind.upper()])
    return np.asarray(out, np.float32).reshape(*raw.shape[:-1], k)


def gguf_record(layout: RecordLayout, experts: int, seed: int, bias: bool = False):
    """Banks of ``experts`` random-byte records (``from_gguf`` of each matrix's format) and their float32 matrices
    as gguf-py decodes them (the reference's ``deq``)."""
    banks, deq = {}, {}
    rng = np.random.default_rng(seed)
    for i, m in enumerate(MATRICES):
        fmt = layout.format_of(m)
        n, k = layout.matrix_shape(m)
        raw = gguf_bytes(fmt.name, (experts, n), k, seed * 3 + i)
        banks.update({f"{m}.{b}": a for b, a in fmt.from_gguf(raw).items()})
        deq[m] = gguf_dequantize(fmt.name, raw, k)
        if bias:
            deq[f"{m}.b"] = banks[f"{m}.b"] = rng.standard_normal((experts, n)).astype(np.float32)
    return banks, deq


def _routes(rng, tokens: int, k: int, experts: int):
    ids = np.stack([rng.permutation(experts)[:k] for _ in range(tokens)]).astype(np.int32)
    if tokens >= 2 and k >= 2:
        ids[1, 1] = ids[1, 0]  # the same expert twice in one row
    return ids, rng.random((tokens, k)).astype(np.float32)


def _check_forward(layout, banks, deq, tokens, k, act, seed, down=None, activations="f32"):
    """The float path against the float64 reference; ``activations`` "q8": the int8 row dots against the reference
    with the same 8-bit rounding of x and h (tolerance ``Q8_REL_ATOL``: an h value at a rounding boundary)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((tokens, layout.hidden)).astype(np.float32)
    ids, weights = _routes(rng, tokens, k, banks["gate.w"].shape[0])
    out = poison((tokens, layout.hidden), np.float32)
    forward(layout.fmt.name, x, ids, weights, banks, layout.hidden, layout.inter,
            ACT_SWIGLU if act == "swiglu" else ACT_GPT_OSS, out, activations=activations, down_fmt_name=down)
    ref = moe_forward_reference(x, ids, weights, deq, act, q8_inputs=activations == "q8")
    rel = 2e-5 if activations == "f32" else Q8_REL_ATOL
    assert_close(out, ref, atol=rel * float(np.abs(ref).max()), rtol=1e-5,
                 name=f"{layout.name} T={tokens} {activations}")


@pytest.mark.parametrize("kind", KINDS)
def test_expert_forward_on_random_gguf_bytes(kind):
    """Every token-group path of the kernels: T = 1 (two rows per call), 3 tokens over 4 experts (groups of 2 and
    1), 9 tokens on 3 experts (groups of 4); gate/up over H = 512, down over I = 256 (two and one super-blocks; q8_0
    also at H = 96, I = 160: odd block counts)."""
    shapes = [(512, 256)] + ([(96, 160)] if kind == "q8_0" else [])
    for hidden, inter in shapes:
        layout = RecordLayout(formats.get(kind), hidden, inter)
        banks, deq = gguf_record(layout, 5, seed=KINDS.index(kind))
        for tokens, k in ((1, 4), (3, 4), (9, 3)):
            for activations in ("f32", "q8"):  # float row dots, int8 row dots (1x2 rows, groups of 4, 2, 1)
                _check_forward(layout, banks, deq, tokens, k, "swiglu", seed=tokens, activations=activations)
    assert uses_q8(kind, "q8") and uses_q8(kind) == (simd_level() != "none") and not uses_q8(kind, "f32")


@pytest.mark.parametrize("gate_up,down", [("q4_k", "q6_k"), ("q5_k", "q8_0"), ("iq4_xs", "q4_k"), ("mxfp4", "q6_k"),
                                          ("q6_k", "nvfp4")])
def test_mixed_records_forward(gate_up, down):
    """Mixed records through the kernels' API, biases and gpt_oss; the e2m1 formats permute x (gate/up) or h (down)
    on their side only."""
    layout = RecordLayout(formats.get(gate_up), 512, 256, True, down_fmt=formats.get(down))
    if all(layout.format_of(m).name in KINDS for m in MATRICES):
        banks, deq = gguf_record(layout, 4, seed=7, bias=True)
    else:
        banks = random_record(layout, 4, seed=7)
        deq = layout.dequantize(banks)
    for tokens, k in ((1, 3), (6, 2)):
        for activations in ("f32", "q8"):
            _check_forward(layout, banks, deq, tokens, k, "gpt_oss", seed=tokens, down=down, activations=activations)


def test_mixed_record_q4_k_m_through_ops():
    """GGUF Q4_K_M's experts (gate/up Q4_K, down Q6_K) through ``ops.moe_experts`` on the cpu device, against the
    float64 reference on the codecs' dequantized weights."""
    layout = RecordLayout(formats.get("q4_k"), 512, 256, down_fmt=formats.get("q6_k"))
    assert layout.name == "q4_k+q6_k"
    banks = random_record(layout, 6, seed=3)
    deq = layout.dequantize(banks)
    rng = np.random.default_rng(0)
    for tokens in (1, 5):
        x = rng.standard_normal((tokens, 512)).astype(np.float32)
        ids, weights = _routes(rng, tokens, 4, 6)
        for activations in ("f32", "q8"):
            y = ops.moe_experts(x, ids, weights, banks, layout, device="cpu", activations=activations)
            ref = moe_forward_reference(x, ids, weights, deq, "swiglu", q8_inputs=activations == "q8")
            rel = 2e-5 if activations == "f32" else Q8_REL_ATOL
            assert_close(y, ref, atol=rel * float(np.abs(ref).max()), rtol=1e-5,
                         name=f"q4_k+q6_k T={tokens} {activations}")


def test_mixed_record_int8_gate_up_bf16_down():
    """A record whose gate/up format has int8 row dots and whose down format takes bf16 tokens (fp8_block): with
    activations "q8" the gate/up kernel reads x in 8-bit blocks, the down kernel h rounded to bf16 (the reference
    rounds the same way; the tolerance is the bf16-token cases' for h values at a rounding boundary)."""
    layout = RecordLayout(formats.get("q6_k"), 512, 256, down_fmt=formats.get("fp8_block"))
    banks = random_record(layout, 4, seed=5)
    deq = layout.dequantize(banks)
    rng = np.random.default_rng(2)
    x = rng.standard_normal((3, 512)).astype(np.float32)
    ids, weights = _routes(rng, 3, 2, 4)
    y = ops.moe_experts(x, ids, weights, banks, layout, device="cpu", activations="q8")
    ref = moe_forward_reference(q8_round_trip(x), ids, weights, deq, "swiglu", bf16_h=True)
    assert_close(y, ref, atol=PREFILL_REL_ATOL * float(np.abs(ref).max()), rtol=1e-5, name="q6_k+fp8_block q8")


def test_prepare_checks_each_matrix_against_its_format():
    layout = RecordLayout(formats.get("q4_k"), 256, 256, down_fmt=formats.get("q6_k"))
    banks = random_record(layout, 2, seed=1)
    p = prepare("q4_k", banks, 256, 256, "q6_k")
    assert (p.fmt, p.down_fmt) == (FORMAT_CODES["q4_k"], FORMAT_CODES["q6_k"])
    with pytest.raises(ValueError, match=r"banks\['down.w'\]: expected shape \[2, 256, 128\]"):
        prepare("q4_k", banks, 256, 256)  # down read as q4_k
    with pytest.raises(ValueError, match="unknown expert format 'q3_k'"):
        prepare("q4_k", banks, 256, 256, "q3_k")
    with pytest.raises(ValueError, match="divisible by 256"):
        prepare("q4_k", banks, 256, 96, "q6_k")
    out = np.zeros((1, 256), np.float32)
    args = (np.zeros((1, 256), np.float32), np.zeros((1, 1), np.int32), np.ones((1, 1), np.float32), banks, 256,
            256, ACT_SWIGLU, out)
    with pytest.raises(ValueError, match="prepared: made for other formats"):
        forward("q4_k", *args, prepared=p)  # down_fmt_name missing: q4_k
    forward("q4_k", *args, prepared=p, down_fmt_name="q6_k")


# ------------------------------------------------------------------------------------------------ dense products

DENSE_KINDS = ("q4_k", "q5_k", "q6_k", "iq4_xs")


@pytest.mark.parametrize("kind", DENSE_KINDS)
def test_dense_products_on_random_gguf_rows(kind):
    """``qmatmul_into`` over verbatim GGUF rows: the serial and threaded GEMV (T <= 4: groups of 4 tokens, single
    tokens two rows at a time with an odd row count) and the tiled product (T = 13), against gguf-py's weights."""
    for n, k, tokens in ((37, 512, (1, 2, 4)), (301, 1024, (1, 3)), (45, 768, (13,))):
        raw = gguf_bytes(kind, (n,), k, seed=n)
        assert raw.shape[1] == k // 256 * KQUANT_BLOCK_BYTES[kind]
        w = gguf_dequantize(kind, raw, k).astype(np.float64)
        for t in tokens:
            x = np.random.default_rng(t).standard_normal((t, k)).astype(np.float32)
            out = poison((t, n), np.float32)
            qmatmul_into(x, raw, kind, out)
            ref = x @ w.T
            assert_close(out, ref, atol=2e-5 * float(np.abs(ref).max()), rtol=1e-5, name=f"{kind} N={n} T={t}")


@pytest.mark.parametrize("kind", DENSE_KINDS)
def test_dense_dequantize_rows_bit_exact(kind):
    raw = gguf_bytes(kind, (9,), 512, seed=1)
    want = gguf_dequantize(kind, raw, 512)
    np.testing.assert_array_equal(dequantize_rows(raw, kind, 512), want)
    out = poison((4, 512), np.float32)
    dequantize_rows(raw, kind, 512, r0=3, out=out)
    np.testing.assert_array_equal(out, want[3:7])


# --------------------------------------------------------------------------------- row dots at every SIMD level

@numba.njit
def _row_dots(code, w, s, raw, x, out):
    """out[0..8, r]: kq_dot1, kq_dot2, kq_dot4, kq_dot1x2 (rows r, r + 1; r even) over the banks, kq_dot1 over the
    GGUF rows."""
    n, k = raw.shape[0], x.shape[1]
    wa, sa, ra, xa = addr(w), addr(s), addr(raw), addr(x)
    for r in range(n):
        out[0, r] = kq_dot1(code, False, wa, sa, r, k, xa, 0)
        out[1, r], out[2, r] = kq_dot2(code, False, wa, sa, r, k, xa, k, 2 * k)
        out[3, r], out[4, r], out[5, r], out[6, r] = kq_dot4(code, False, wa, sa, r, k, xa, 0, k, 2 * k, 3 * k)
        if r % 2 == 0:
            out[7, r], out[7, r + 1] = kq_dot1x2(code, False, wa, sa, r, k, xa, 3 * k)
        out[8, r] = kq_dot1(code, True, ra, ra, r, k, xa, k)


def check_row_dots():
    """Every row-dot intrinsic of every format against gguf-py (the tokens of each slot as listed in
    :func:`_row_dots`), and ``kq_decode`` bit for bit. q8_0 with 5 blocks (the odd tail of its two-block loop)."""
    for kind in KINDS:
        k = 160 if kind == "q8_0" else 512
        raw = gguf_bytes(kind, (6,), k, seed=11)
        banks = formats.get(kind).from_gguf(raw[None])
        w, s = banks["w"][0], np.ascontiguousarray(banks["s"][0])
        x = np.random.default_rng(3).standard_normal((4, k)).astype(np.float32)
        out = np.full((9, 6), np.nan, np.float32)
        _row_dots(KQUANT_CODES[kind], w, s, raw, x, out)
        ref = x.astype(np.float64) @ gguf_dequantize(kind, raw, k).astype(np.float64).T
        want = ref[[0, 1, 2, 0, 1, 2, 3, 3, 1]]
        assert np.abs(out - want).max() <= 2e-5 * np.abs(want).max(), (kind, np.abs(out - want).max())
        if kind != "q8_0":  # dense q8_0 rows have their own decode (qgemv)
            np.testing.assert_array_equal(dequantize_rows(raw, kind, k), gguf_dequantize(kind, raw, k))


@numba.njit
def _int8_row_dots(code, w, s, k, xq, out):
    """The int8 row dots (``moe_rows_q8.row_q8_dot*``, expert 0 of the banks) in the slots 0-7 of
    :func:`_row_dots` (its slot 8, GGUF rows, is the float path's alone)."""
    n = out.shape[1]
    for r in range(n):
        out[0, r] = row_q8_dot1(code, w, s, 0, 0, r, n, k, xq, 0)
        out[1, r], out[2, r] = row_q8_dot2(code, w, s, 0, 0, r, n, k, xq, 1, 2)
        out[3, r], out[4, r], out[5, r], out[6, r] = row_q8_dot4(code, w, s, 0, 0, r, n, k, xq, 0, 1, 2, 3)
        if r % 2 == 0:
            out[7, r], out[7, r + 1] = row_q8_dot1x2(code, w, s, 0, 0, r, n, k, xq, 3)


def check_int8_row_dots():
    """The int8 row dots of q8_0 (odd block count) and the k-quants against float64 on gguf-py's weights and the
    8-bit activations (``q8_round_trip``): their integer part is exact, so float32 accumulation is the only error."""
    for kind in KINDS:
        k = 160 if kind == "q8_0" else 512
        raw = gguf_bytes(kind, (6,), k, seed=12)
        banks = formats.get(kind).from_gguf(raw[None])
        w, s = np.ascontiguousarray(banks["w"]), np.ascontiguousarray(banks["s"])
        x = np.random.default_rng(4).standard_normal((4, k)).astype(np.float32)
        code = FORMAT_CODES[kind]
        qa, nc, dx, cs = q8_buffers(4, k)
        quantize_rows(x, np.int32(Q8_OFFSETS[code]), False, qa, nc, dx, cs)
        xq = (np.uint64(qa.ctypes.data), np.uint64(nc.ctypes.data), np.uint64(dx.ctypes.data), np.uint64(qa.shape[1]),
              np.uint64(cs.ctypes.data))
        out = np.full((8, 6), np.nan, np.float32)
        _int8_row_dots(code, np.uint64(w.ctypes.data), np.uint64(s.ctypes.data), k, xq, out)
        ref = q8_round_trip(x) @ gguf_dequantize(kind, raw, k).astype(np.float64).T
        want = ref[[0, 1, 2, 0, 1, 2, 3, 3]]
        err = np.abs(out - want).max()
        assert err <= 2e-5 * np.abs(want).max(), (kind, simd_level(), err)


@numba.njit
def _panel(code, w, s, k, panel, pscale, xq, toks, out):
    panel_repack(code, w, s, 0, 0, 16, 32, k, addr(panel), addr(pscale))
    panel_tile(code, addr(panel), addr(pscale), xq, addr(toks), k, addr(out))


def check_int8_panels():
    """The panel micro-kernel of q4_k, q5_k and q6_k (rows 16-31 of 32, ``TILE_TOKENS`` of 11 token rows, shuffled,
    one repeated) against float64 on gguf-py's weights and the 8-bit activations: exact integer dots, so float32
    accumulation is the only error, as for the row dots."""
    for kind in ("q4_k", "q5_k", "q6_k"):
        k = 512
        raw = gguf_bytes(kind, (32,), k, seed=13)
        banks = formats.get(kind).from_gguf(raw[None])
        w, s = np.ascontiguousarray(banks["w"]), np.ascontiguousarray(banks["s"])
        rng = np.random.default_rng(5)
        x = rng.standard_normal((11, k)).astype(np.float32)
        x[2, :32] = 0.0  # an all-zero block: scale 0
        code = FORMAT_CODES[kind]
        qa, nc, dx, cs = q8_buffers(11, k)
        quantize_rows(x, np.int32(Q8_OFFSETS[code]), False, qa, nc, dx, cs)
        panel = np.full(k // 32 * PANEL_BLOCK_BYTES, 0xFF, np.uint8)
        pscale = np.full(k // 32 * (MIN_AT + 1) * PANEL_ROWS, np.nan, np.float32)
        toks = np.append(rng.permutation(11), [4] * TILE_TOKENS)[:TILE_TOKENS].astype(np.int64)
        toks[-1] = toks[0]
        out = np.full(TILE_TOKENS * PANEL_ROWS, np.nan, np.float32)
        xq = tuple(np.uint64(v) for v in (qa.ctypes.data, nc.ctypes.data, dx.ctypes.data, qa.shape[1], cs.ctypes.data))
        _panel(code, np.uint64(w.ctypes.data), np.uint64(s.ctypes.data), k, panel, pscale, xq, toks, out)
        xq64 = q8_round_trip(x)[toks]
        deq = gguf_dequantize(kind, raw, k).astype(np.float64)[16:]
        want, size = xq64 @ deq.T, np.abs(xq64) @ np.abs(deq).T
        got = out.reshape(TILE_TOKENS, PANEL_ROWS)
        bad = np.abs(got - want) > 1e-5 * size + 1e-30
        assert not bad.any(), f"{kind} level={simd_level()} panel: {np.argwhere(bad)[:4]} {got[bad][:4]}"


def test_row_dots_this_level():
    check_row_dots()
    check_int8_row_dots()
    check_int8_panels()


@pytest.mark.slow
@pytest.mark.parametrize("level", ["avx2", "none"])
def test_row_dots_other_levels(level, tmp_path):
    """The same in a subprocess compiling for AVX2 only, and for AVX without AVX2/FMA (as tests/test_int8_dots.py
    does for the int8 dots): the <16 x float> IR is split into narrower vectors, the table lookups lowered per
    target."""
    from test_int8_dots import _features_for

    if simd_level() == level:
        pytest.skip(f"{level} is this machine's level: test_row_dots_this_level ran it")
    features = _features_for(level)
    if features is None:
        pytest.skip(f"this CPU cannot run code compiled for {level}")
    env = dict(os.environ, NUMBA_CPU_NAME="haswell" if level == "avx2" else "ivybridge",
               NUMBA_CPU_FEATURES=features, FREETOKEN_CACHE_DIR=str(tmp_path), NUMBA_CACHE_DIR=str(tmp_path))
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import test_kquant_cpu as t; "
            "from freetoken.device.simd import simd_level; "
            f"assert simd_level() == {level!r}, simd_level(); t.check_row_dots(); t.check_int8_row_dots(); "
            "t.check_int8_panels(); "
            "print('ok', simd_level())")
    r = subprocess.run([sys.executable, "-c", code, str(Path(__file__).parent)], env=env, capture_output=True,
                       text=True, timeout=900)
    assert r.returncode == 0 and r.stdout.strip() == f"ok {level}", r.stdout + r.stderr[-3000:]
