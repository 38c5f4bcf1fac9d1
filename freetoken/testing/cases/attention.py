"""Parity cases of ``ops.attention_decode`` and ``ops.attention`` (``cuda/attention.cu``)."""

from __future__ import annotations

import numpy as np

from freetoken import ops
from freetoken.testing.cases.base import KernelCase, poisoned
from freetoken.testing.reference.attention import attention_reference


# ---- attention.cu -----------------------------------------------------------------------------------------
def _make_attention(t: int):
    def make(rng, size):
        if size == "small":  # odd head dim (96: 3 elements per lane), a 3-head group, 3 splits on emu
            heads, kv_heads, dim, start = (6, 2, 96, 300) if t == 1 else (8, 1, 64, 37) if t <= 16 else (4, 2, 40, 9)
        else:  # Qwen3-30B-A3B (32 q / 4 kv heads) and Mixtral-like (32 / 8) heads at a 4096-token context
            heads, kv_heads, dim, start = (32, 4, 128, 4096 - t) if t == 1 else (32, 8, 128, 4096 - t)
        rows = start + t + 5  # rows past start + T - 1 are NaN: a kernel that reads them fails
        q = (2.0 * rng.standard_normal((t, heads, dim))).astype(np.float32)  # peaky softmax: the max matters
        k = rng.standard_normal((rows, kv_heads, dim)).astype(np.float32)
        v = rng.standard_normal((rows, kv_heads, dim)).astype(np.float32)
        k[start + t:] = np.nan
        v[start + t:] = np.nan
        return {"q": q, "k": k, "v": v, "start": start}

    return make


def _setup_attention(dev, inp):
    t, heads, dim = inp["q"].shape
    return {"q": dev.asarray(inp["q"]), "k": dev.asarray(inp["k"]), "v": dev.asarray(inp["v"]),
            "start": inp["start"], "out_out": poisoned(dev, (t, heads * dim), np.float32)}


def _launch_attention(dev, st):
    ops.attention_decode(st["q"], st["k"], st["v"], st["start"], out=st["out_out"], device=dev)


def _attention_bytes(inp):
    t, _, dim = inp["q"].shape
    kv_bytes = 2 * (inp["start"] + t) * inp["k"].shape[1] * dim * 4
    return kv_bytes + 2 * inp["q"].nbytes


def _attention_flops(inp):
    t, heads, dim = inp["q"].shape
    return sum(4 * heads * dim * (inp["start"] + i + 1) for i in range(t))


def _launch_attention_op(dev, st):
    st["out_out"][...] = ops.attention(st["q"], st["k"], st["v"], st["start"], device=dev)


def _ref_attention(inp):
    return {"out": attention_reference(inp["q"], inp["k"], inp["v"], inp["start"])}


DECODE_CASES = [
    KernelCase(f"attention_decode_t{t}", "attention.cu", _make_attention(t), _setup_attention, _launch_attention,
               _ref_attention, rel_atol=1e-5, bytes_moved=_attention_bytes, flops=_attention_flops,
               op="attention_decode")
    for t in (1, 4)
]
OP_CASES = [  # the op the model calls: the decode kernel up to 16 queries (gpu/emu), the array code beyond and on cpu
    KernelCase(f"attention_t{t}", "attention.cu", _make_attention(t), _setup_attention, _launch_attention_op,
               _ref_attention, rel_atol=1e-5, bytes_moved=_attention_bytes, flops=_attention_flops, op="attention")
    for t in (1, 20)
]
CASES = DECODE_CASES + OP_CASES
