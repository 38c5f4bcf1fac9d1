"""The CPU executor's expert kernels (``cpu_kernels/moe_experts.py``) through their own API (``forward``): token
groups, duplicate ids, thread counts, read-only banks, validation. Every format and activation against the float64
reference through ``ops.moe_experts`` is a registry case (tests/test_kernel_parity.py: moe_decode_*).

The int8 path (``activations="q8"``: 8-bit activations, the default for the 4-bit formats where the CPU has AVX2 or
AVX-512 VNNI) is checked against the reference with the same activation rounding (``q8_inputs``), with the float
tolerance widened by ``Q8_REL_ATOL`` (freetoken.testing.cases.moe_experts, with the reason);
tests/test_int8_dots.py checks its row dots at every SIMD level. For bf16 and fp8_block the reduced path rounds x
and h to bf16 (the default where the CPU has AVX512-BF16): checked against the reference with bf16 inputs
(``bf16_inputs``) within ``PREFILL_REL_ATOL``; tests/test_ir_kernels_levels.py checks its row dots at the other
levels.

Tolerance. The kernels read the stored weights exactly (the reference is ``moe_forward_reference`` on
``RecordLayout.dequantize``), so the only difference is float32 arithmetic: two chained dot products of length
n <= 160 (gate/up over H, down over I, reassociated into 16-lane partial sums) and the activation, against float64.
The worst-case float32 dot-product error is about n * u * sum|terms| (u = 2^-24 = 6e-8), i.e. 1e-5 of the size of the
terms for n = 160; with the two chained projections and terms of the order of the largest outputs this gives
``atol = 2e-5 * max|ref|`` (plus ``rtol = 1e-5``). Observed errors are ~4e-7 * max|ref|, and one wrongly decoded
weight moves outputs by ~1e-2 * max|ref|, so the bound separates rounding from bugs by orders of magnitude. Outputs
are poisoned with NaN first and ``assert_close`` never lets a NaN pass.
"""

import numba
import numpy as np
import pytest
from freetoken.cpu_kernels.moe_experts import ACT_GPT_OSS, ACT_SWIGLU, forward

from freetoken import formats
from freetoken.formats import RecordLayout
from freetoken.testing import assert_close, poison, random_record
from freetoken.testing.cases.moe_experts import BF16_TOKEN_FORMATS, PREFILL_REL_ATOL, Q8_REL_ATOL
from freetoken.testing.reference.moe_experts import moe_forward_reference

ACTS = {"swiglu": ACT_SWIGLU, "gpt_oss": ACT_GPT_OSS}


def _record(fmt, hidden, inter, experts, bias, seed):
    layout = RecordLayout(formats.get(fmt), hidden, inter, bias)
    banks = random_record(layout, experts, seed)
    return banks, layout.dequantize(banks)


def _routes(tokens, k, experts, seed):
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, experts, (tokens, k)).astype(np.int32)
    weights = rng.random((tokens, k)).astype(np.float32)
    if k >= 2:
        ids[0, 1] = ids[0, 0]  # the same expert twice in one token's row: both contributions count
    if tokens >= 2 and k >= 2:
        ids[1, 1] = (ids[1, 0] + 1) % experts
        weights[1, :] = 0.0
        weights[1, :2] = [0.5, -0.5]  # weights summing to zero (different experts)
    if tokens >= 3 and k >= 2:
        ids[2, 1] = ids[2, 0]
        weights[2, :] = 0.0
        weights[2, :2] = [0.75, -0.75]  # the same expert twice with cancelling weights: exactly zero
    return ids, weights


def _check(fmt, banks, deq, hidden, inter, act, tokens, k, seed, activations="f32"):
    experts = banks["gate.w"].shape[0]
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((tokens, hidden)).astype(np.float32)
    ids, weights = _routes(tokens, k, experts, seed)
    out = poison((tokens, hidden), np.float32)
    forward(fmt, x, ids, weights, banks, hidden, inter, ACTS[act], out, activations=activations)
    bf16_tokens = activations == "q8" and fmt in BF16_TOKEN_FORMATS
    ref = moe_forward_reference(x, ids, weights, deq, act, q8_inputs=activations == "q8" and not bf16_tokens,
                                bf16_inputs=bf16_tokens)
    scale = float(np.abs(ref).max())
    atol = (2e-5 if activations == "f32" else PREFILL_REL_ATOL if bf16_tokens else Q8_REL_ATOL) * scale
    assert_close(out, ref, atol=atol, rtol=1e-5, name=f"{fmt} {act} T={tokens} k={k} {activations}")
    return out


@pytest.mark.parametrize("activations", ["f32", "q8"])
@pytest.mark.parametrize("fmt", ["mxfp4", "q4_0", "nvfp4", "bf16", "fp8_block"])
def test_many_tokens_and_odd_k(fmt, activations):
    banks, deq = _record(fmt, 96, 160, 7, bias=False, seed=3)
    for tokens, k in ((64, 8), (5, 3), (9, 5), (2, 7)):
        _check(fmt, banks, deq, 96, 160, "swiglu", tokens, k, seed=tokens + k, activations=activations)


def test_q8_is_the_default_where_the_cpu_has_int8_dots():
    from freetoken.cpu_kernels.moe_experts import uses_q8

    from freetoken.device.simd import bf16_dots, simd_level

    assert uses_q8("q4_0") == (simd_level() != "none") and uses_q8("nvfp4", "q8") and not uses_q8("q4_0", "f32")
    # bf16 tokens: for bf16 at the levels with vector code, for fp8_block only where vdpbf16ps runs them
    assert uses_q8("bf16") == (bf16_dots() or simd_level() != "none") and uses_q8("fp8_block") == bf16_dots()
    assert uses_q8("bf16", "q8") and uses_q8("fp8_block", "q8") and not uses_q8("fp8_block", "f32")
    with pytest.raises(ValueError, match="activations must be"):
        uses_q8("q4_0", "int4")


@pytest.mark.parametrize("activations", ["f32", "q8"])
@pytest.mark.parametrize("tokens", [1, 2, 4])
def test_fp8_block_rows_tail_blocks_and_nan_codes(tokens, activations):
    """fp8_block rows with a K that ends in a partial 128-block (H = 160: one whole block and 2 chunks of 16; I = 96),
    against the float64 reference; then the e4m3fn NaN codes (0x7F, 0xFF) in one gate row make that expert's
    outputs NaN, as the reference's decode does, and leave the other tokens' experts finite (a code in a whole block,
    which the kernel checks 64 bytes at a time, and one in the partial block)."""
    hidden, inter = 160, 96
    banks, deq = _record("fp8_block", hidden, inter, 3, bias=False, seed=8)
    _check("fp8_block", banks, deq, hidden, inter, "swiglu", tokens, 2, seed=8, activations=activations)
    for code, at in ((0x7F, 150), (0xFF, 150), (0x7F, 20), (0xFF, 127)):
        bad = {name: a.copy() for name, a in banks.items()}
        bad["gate.w"][1, 5, at] = code  # expert 1, gate row 5
        x = np.random.default_rng(1).standard_normal((2, hidden)).astype(np.float32)
        out = poison((2, hidden), np.float32)
        forward("fp8_block", x, np.array([[1], [2]], np.int32), np.ones((2, 1), np.float32), bad, hidden, inter,
                ACT_SWIGLU, out, activations=activations)
        assert np.isnan(out[0]).all() and np.isfinite(out[1]).all()


def test_duplicate_ids_and_zero_weights_exact():
    banks, deq = _record("mxfp4", 64, 32, 3, bias=True, seed=5)
    x = np.random.default_rng(0).standard_normal((2, 64)).astype(np.float32)
    ids = np.array([[1, 1], [2, 2]], np.int32)
    weights = np.array([[0.25, 0.5], [0.75, -0.75]], np.float32)
    out = poison((2, 64), np.float32)
    forward("mxfp4", x, ids, weights, banks, 64, 32, ACT_GPT_OSS, out)
    single = poison((2, 64), np.float32)
    forward("mxfp4", x, ids[:, :1], np.array([[0.75], [0.0]], np.float32), banks, 64, 32, ACT_GPT_OSS, single)
    np.testing.assert_allclose(out[0], single[0], rtol=1e-6, atol=1e-6)  # 0.25 e1 + 0.5 e1 == 0.75 e1
    assert np.array_equal(out[1], np.zeros(64, np.float32))  # +w and -w on one expert cancel exactly


@pytest.mark.skipif(numba.config.NUMBA_NUM_THREADS < 2, reason="needs 2 threads")
def test_thread_count_does_not_change_the_result():
    banks, _ = _record("nvfp4", 96, 160, 5, bias=True, seed=7)
    rng = np.random.default_rng(1)
    x = rng.standard_normal((3, 96)).astype(np.float32)
    ids, weights = _routes(3, 4, 5, seed=2)
    outs = []
    before = numba.get_num_threads()
    try:
        for n in (1, 2):
            numba.set_num_threads(n)
            out = poison((3, 96), np.float32)
            forward("nvfp4", x, ids, weights, banks, 96, 160, ACT_GPT_OSS, out)
            outs.append(out)
    finally:
        numba.set_num_threads(before)
    assert np.array_equal(outs[0], outs[1])  # each row is computed the same way whatever the split


def test_read_only_banks_and_inputs_share_the_compiled_kernels():
    from freetoken.cpu_kernels import moe_experts

    banks, deq = _record("q4_0", 96, 160, 5, bias=True, seed=11)
    _check("q4_0", banks, deq, 96, 160, "gpt_oss", 3, 2, seed=1)
    kernels = (moe_experts._gate_up_kernel, moe_experts._down_kernel, moe_experts._gate_up_serial,
               moe_experts._down_serial)  # this call is small: the serial copies run it
    compiled = [len(k.signatures) for k in kernels]
    assert sum(compiled[2:]) >= 2
    frozen = {}
    for name, a in banks.items():  # as from a read-only memory map
        a = a.copy()
        a.flags.writeable = False
        frozen[name] = a
    rng = np.random.default_rng(4)
    x = rng.standard_normal((3, 96)).astype(np.float32)
    x.flags.writeable = False
    ids, weights = _routes(3, 2, 5, seed=4)
    out = poison((3, 96), np.float32)
    forward("q4_0", x, ids, weights, frozen, 96, 160, np.int64(ACT_GPT_OSS), out, activations="f32")
    ref = moe_forward_reference(x, ids, weights, deq, "gpt_oss")
    assert_close(out, ref, atol=2e-5 * float(np.abs(ref).max()), rtol=1e-5)
    assert [len(k.signatures) for k in kernels] == compiled


@pytest.mark.parametrize("fmt", ["q4_0", "bf16", "fp8_block"])
def test_serial_copies_match_the_parallel_kernels(fmt, monkeypatch):
    """A small call (a decode step of a small model) runs the kernels' serial copies, a large one the parallel
    kernels: the same loops, so the same bits."""
    from freetoken.cpu_kernels import moe_experts

    banks, _ = _record(fmt, 96, 160, 6, bias=True, seed=3)
    rng = np.random.default_rng(8)
    x = rng.standard_normal((2, 96)).astype(np.float32)
    ids, weights = _routes(2, 3, 6, seed=5)
    outs = []
    for serial_macs in (1 << 40, 0):  # everything serial, then nothing
        monkeypatch.setattr(moe_experts, "SERIAL_MACS", serial_macs)
        out = poison((2, 96), np.float32)
        forward(fmt, x, ids, weights, banks, 96, 160, ACT_SWIGLU, out)
        outs.append(out)
    np.testing.assert_array_equal(outs[0], outs[1])


def test_ops_checked_path_matches_the_checked_call():
    """ops.moe_experts(checked=True) (what the cpu runner calls each layer) goes straight to the kernels: the same
    result as the call that checks its arguments, with its output buffer reused."""
    from freetoken import get_device, ops

    cpu = get_device("cpu")
    layout = RecordLayout(formats.get("q4_0"), 64, 96, False)
    banks = random_record(layout, 5, 2)
    rng = np.random.default_rng(6)
    x = rng.standard_normal((3, 64)).astype(np.float32)
    ids, weights = _routes(3, 2, 5, seed=7)
    want = ops.moe_experts(x, ids, weights, banks, layout, device=cpu)
    out = poison((3, 64), np.float32)
    got = ops.moe_experts(x, ids, weights, banks, layout, device=cpu, validate=False, checked=True, out=out)
    assert got is out
    np.testing.assert_array_equal(got, want)
    with pytest.raises(ValueError, match="out of range"):  # even unchecked, the kernels never read past the banks
        ops.moe_experts(x, np.full((3, 2), 5, np.int32), weights, banks, layout, device=cpu, checked=True)


def test_ids_out_of_range():
    banks, _ = _record("q4_0", 64, 32, 3, bias=False, seed=0)
    x = np.zeros((2, 64), np.float32)
    out = np.zeros((2, 64), np.float32)
    weights = np.ones((2, 2), np.float32)
    with pytest.raises(ValueError, match=r"ids\[1, 0\] = 3 is out of range"):
        forward("q4_0", x, np.array([[0, 1], [3, 0]], np.int32), weights, banks, 64, 32, ACT_SWIGLU, out)
    with pytest.raises(ValueError, match=r"ids\[0, 1\] = -2 is out of range"):
        forward("q4_0", x, np.array([[0, -2], [1, 2]], np.int32), weights, banks, 64, 32, ACT_SWIGLU, out)
    # -1 is NO_ROUTE: the pair is skipped (a mixed-format layer's pair of another part), not refused
    x = np.random.default_rng(0).standard_normal((2, 64)).astype(np.float32)
    skipped = np.zeros((2, 64), np.float32)
    forward("q4_0", x, np.array([[0, -1], [-1, -1]], np.int32), weights, banks, 64, 32, ACT_SWIGLU, skipped)
    alone = np.zeros((2, 64), np.float32)
    forward("q4_0", x, np.array([[0], [0]], np.int32), weights[:, :1], banks, 64, 32, ACT_SWIGLU, alone)
    np.testing.assert_array_equal(skipped[0], alone[0])
    assert not skipped[1].any()


def test_input_validation():
    banks, _ = _record("nvfp4", 64, 32, 2, bias=False, seed=0)
    x = np.zeros((1, 64), np.float32)
    ids = np.zeros((1, 1), np.int32)
    w = np.ones((1, 1), np.float32)
    out = np.zeros((1, 64), np.float32)

    def call(**kw):
        args = dict(fmt_name="nvfp4", x=x, ids=ids, weights=w, banks=banks, hidden=64, inter=32, act_code=0, out=out)
        args.update(kw)
        forward(**args)

    call()
    with pytest.raises(ValueError, match="x: expected dtype float32"):
        call(x=x.astype(np.float64))
    with pytest.raises(ValueError, match="ids: expected dtype int32"):
        call(ids=ids.astype(np.int64))
    with pytest.raises(ValueError, match="weights: expected shape"):
        call(weights=np.ones((1, 2), np.float32))
    with pytest.raises(ValueError, match="out: expected shape"):
        call(out=np.zeros((2, 64), np.float32))
    with pytest.raises(ValueError, match="C-contiguous"):
        call(x=np.zeros((1, 128), np.float32)[:, ::2])
    with pytest.raises(ValueError, match="x: expected shape"):
        call(x=np.zeros((1, 96), np.float32))
    with pytest.raises(ValueError, match="unknown expert format"):
        call(fmt_name="q3_k")
    with pytest.raises(ValueError, match="act_code"):
        call(act_code=5)
    with pytest.raises(ValueError, match="multiples of 32"):
        call(inter=48)
    with pytest.raises(ValueError, match="missing 'down.s'"):
        call(banks={k: v for k, v in banks.items() if k != "down.s"})
    with pytest.raises(ValueError, match=r"banks\['up.w'\]: expected dtype uint8"):
        call(banks={**banks, "up.w": banks["up.w"].view(np.int8)})
    with pytest.raises(ValueError, match=r"banks\['gate.s'\]: expected shape \[2, 32, 4\]"):
        call(banks={**banks, "gate.s": np.zeros((2, 32, 2), np.uint8)})
