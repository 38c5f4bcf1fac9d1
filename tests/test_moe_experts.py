"""The routed-expert forward on every device and format against the NumPy reference.

Decode (and the cpu device) read weights exactly: compared with the float64 reference at fp32 accuracy.
Prefill feeds tensor cores bf16 inputs: compared with a reference that rounds the same values (activations,
weights before their per-matrix global, the intermediate h) to bf16, at fp32-accumulation accuracy.
"""

import ml_dtypes
import numpy as np
import pytest

from freetoken import formats
from freetoken.formats import RecordLayout
from freetoken.ops.moe_experts import moe_experts
from freetoken.ops.moe_reference import moe_forward_reference, moe_prefill_reference
from freetoken.testing import assert_close, poison, random_record

H, I, SLOTS = 96, 160, 6  # noqa: E741 (H, I as in the MoE literature): not powers of two; partial fp8 blocks


def _record(fmt_name: str, bias: bool, seed: int = 0):
    layout = RecordLayout(formats.get(fmt_name), H, I, bias)
    return layout, random_record(layout, SLOTS, seed)


def _inputs(tokens, k, seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((tokens, H)).astype(np.float32)
    ids = rng.integers(0, SLOTS, (tokens, k)).astype(np.int32)
    weights = rng.random((tokens, k)).astype(np.float32)
    if k >= 2:
        ids[0, 1] = ids[0, 0]  # the same expert twice in one token's row
    if tokens >= 2 and k >= 2:
        ids[1, 1] = ids[1, 0]
        weights[1, :2] = [0.75, -0.75]  # weights that cancel
        weights[1, 2:] = 0.0
    return x, ids, weights


def _run(device, layout, banks, x, ids, weights, act, mode):
    dev_banks = {name: device.asarray(a) for name, a in banks.items()}
    out = device.asarray(poison((x.shape[0], H), np.float32))
    y = moe_experts(device.asarray(x), device.asarray(ids), device.asarray(weights), dev_banks, layout, act=act,
                    mode=mode, out=out, device=device)
    return device.to_host(y)


CASES = [(1, 1), (1, 8), (3, 2), (17, 2)]


@pytest.mark.parametrize("fmt_name", formats.NAMES)
@pytest.mark.parametrize("act,bias", [("swiglu", False), ("gpt_oss", True)], ids=["swiglu", "gpt_oss"])
def test_decode_matches_reference(device, fmt_name, act, bias):
    layout, banks = _record(fmt_name, bias)
    deq = layout.dequantize(banks)
    for n, (tokens, k) in enumerate(CASES):
        x, ids, weights = _inputs(tokens, k, seed=n)
        want = moe_forward_reference(x, ids, weights, deq, act)
        got = _run(device, layout, banks, x, ids, weights, act, "decode")
        scale = float(np.abs(want).max())
        assert_close(got, want, atol=2e-6 * scale, rtol=1e-5, name=f"{fmt_name} T={tokens} k={k}")
        if tokens >= 2 and k >= 2:
            assert np.all(got[1] == 0.0) or np.allclose(got[1], want[1], atol=2e-6 * scale)


@pytest.mark.parametrize("fmt_name", formats.NAMES)
@pytest.mark.parametrize("act,bias", [("swiglu", False), ("gpt_oss", True)], ids=["swiglu", "gpt_oss"])
def test_prefill_matches_bf16_reference(cuda_device, fmt_name, act, bias):
    layout, banks = _record(fmt_name, bias, seed=1)
    for n, (tokens, k) in enumerate([(3, 2), (70, 2), (33, 8)]):
        x, ids, weights = _inputs(tokens, k, seed=10 + n)
        want = moe_prefill_reference(x, ids, weights, layout, banks, act)
        got = _run(cuda_device, layout, banks, x, ids, weights, act, "prefill")
        scale = float(np.abs(want).max())
        assert_close(got, want, atol=1e-4 * scale, rtol=1e-4, name=f"{fmt_name} T={tokens} k={k}")


def test_bf16_activations(device):
    layout, banks = _record("q4_0", False)
    x, ids, weights = _inputs(3, 2, seed=5)
    xb = x.astype(ml_dtypes.bfloat16)
    want = moe_forward_reference(xb, ids, weights, layout.dequantize(banks))
    got = _run(device, layout, banks, xb if device.kind != "gpu" else xb.view(np.uint16), ids, weights, "swiglu",
               "decode")
    assert_close(got, want, atol=2e-6 * float(np.abs(want).max()), rtol=1e-5)


def test_bad_ids_are_reported(device):
    layout, banks = _record("bf16", False)
    x, ids, weights = _inputs(2, 2, seed=3)
    ids[1, 0] = SLOTS
    with pytest.raises(ValueError, match=rf"ids\[1, 0\] = {SLOTS}"):
        _run(device, layout, banks, x, ids, weights, "swiglu", "decode")


def test_shape_errors(device):
    layout, banks = _record("mxfp4", False)
    x, ids, weights = _inputs(2, 2, seed=3)
    with pytest.raises(ValueError, match="x has 48 features"):
        moe_experts(x[:, :48], ids, weights, banks, layout, device=device)
    with pytest.raises(ValueError, match="gate.s"):
        moe_experts(x, ids, weights, {**banks, "gate.s": banks["gate.s"][:, :, :1]}, layout, device=device)
    with pytest.raises(ValueError, match="unknown activation"):
        moe_experts(x, ids, weights, banks, layout, act="relu", device=device)


@pytest.mark.parametrize("fmt_name", ["q4_0", "bf16"])
def test_workspace_reuse_equals_fresh_buffers(cuda_device, fmt_name):
    """One MoeWorkspace serves call after call (counters reset, plan rebuilt) with exactly the results of fresh
    buffers, in decode and prefill modes; a call larger than it was made for falls back to fresh buffers."""
    from freetoken.ops.moe_experts import MoeWorkspace

    layout, banks = _record(fmt_name, False)
    dev_banks = {name: cuda_device.asarray(a) for name, a in banks.items()}
    ws = MoeWorkspace(cuda_device, layout, dev_banks, max_pairs=40)
    for n, (tokens, k, mode) in enumerate([(1, 8, "decode"), (3, 2, "decode"), (17, 2, "prefill"), (1, 1, "decode"),
                                           (30, 2, "prefill")]):  # the last one has 60 pairs > 40
        x, ids, weights = _inputs(tokens, k, seed=10 + n)
        args = (cuda_device.asarray(x), cuda_device.asarray(ids), cuda_device.asarray(weights), dev_banks, layout)
        want = cuda_device.to_host(moe_experts(*args, mode=mode, device=cuda_device))
        got = cuda_device.to_host(moe_experts(*args, mode=mode, device=cuda_device, workspace=ws))
        np.testing.assert_array_equal(got, want)
