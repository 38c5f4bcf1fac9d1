"""Parity cases of ``ops.rope`` (``cuda/rope.cu``)."""

from __future__ import annotations

import numpy as np

from freetoken import ops
from freetoken.testing.cases.base import KernelCase, poisoned
from freetoken.testing.reference.rope import rope_qkv_cache_reference, rope_reference


def _make(rng, size):
    t, heads, d, start = (7, 3, 10, 100) if size == "small" else (512, 40, 128, 4096)  # D/2 odd on small
    x = rng.standard_normal((t, heads, d)).astype(np.float32)
    inv = 1.0 / 10000.0 ** (np.arange(0, d, 2) / d)
    ang = (start + np.arange(t))[:, None] * inv[None, :]
    ang = np.concatenate([ang, ang], axis=-1)
    return {"x": x, "cos": np.cos(ang).astype(np.float32), "sin": np.sin(ang).astype(np.float32)}


def _setup(dev, inp):
    return {"x": dev.asarray(inp["x"]), "cos": dev.asarray(inp["cos"]), "sin": dev.asarray(inp["sin"]),
            "out_y": poisoned(dev, inp["x"].shape, np.float32)}


def _launch(dev, st):
    ops.rope(st["x"], st["cos"], st["sin"], out=st["out_y"], device=dev)


CASES = [
    KernelCase("rope_f32", "rope.cu", _make, _setup, _launch,
               lambda inp: {"y": rope_reference(inp["x"], inp["cos"], inp["sin"])}, atol=1e-6, rtol=1e-6,
               bytes_moved=lambda inp: 2 * inp["x"].nbytes, op="rope"),
]


def _make_qkv(use_norm: bool):
    def make(rng, size):
        # small: D/2 odd, 3 q heads per kv head, T=3 rows written mid-cache; large: a Qwen3-like decode batch
        t, heads, kv_heads, d, start, rows = (3, 6, 2, 10, 5, 11) if size == "small" else (8, 32, 4, 128, 4000, 4096)
        qkv = (3.0 * rng.standard_normal((t, (heads + 2 * kv_heads) * d))).astype(np.float32)
        qkv[0, :d] *= 1e-3  # a small head: eps matters
        inv = 1.0 / 10000.0 ** (np.arange(0, d, 2) / d)
        ang = (start + np.arange(t))[:, None] * inv[None, :]
        ang = np.concatenate([ang, ang], axis=-1)
        norm = None
        if use_norm:
            qn, kn = (1.0 + 0.1 * rng.standard_normal((2, d))).astype(np.float32)
            norm = np.concatenate([np.tile(qn, (heads, 1)), np.tile(kn, (kv_heads, 1))])
        caches = rng.standard_normal((2, rows, kv_heads, d)).astype(np.float32)  # other rows must stay untouched
        return {"qkv": qkv, "norm": norm, "eps": 1e-6, "cos": np.cos(ang).astype(np.float32),
                "sin": np.sin(ang).astype(np.float32), "k_cache": caches[0], "v_cache": caches[1], "start": start,
                "heads": heads}

    def setup(dev, inp):
        st = {k: dev.asarray(inp[k]) for k in ("qkv", "cos", "sin")}
        st.update(norm=None if inp["norm"] is None else dev.asarray(inp["norm"]), eps=inp["eps"], start=inp["start"],
                  out_k_cache=dev.asarray(inp["k_cache"].copy()), out_v_cache=dev.asarray(inp["v_cache"].copy()),
                  out_q=poisoned(dev, (inp["qkv"].shape[0], inp["heads"], inp["k_cache"].shape[2]), np.float32))
        return st

    def launch(dev, st):
        ops.rope_qkv_cache(st["qkv"], st["norm"], st["eps"], st["cos"], st["sin"], st["out_k_cache"],
                           st["out_v_cache"], st["start"], out=st["out_q"], device=dev)

    def reference(inp):
        q, k, v = rope_qkv_cache_reference(inp["qkv"], inp["norm"], inp["eps"], inp["cos"], inp["sin"],
                                           inp["k_cache"], inp["v_cache"], inp["start"])
        return {"q": q, "k_cache": k, "v_cache": v}

    return KernelCase(f"rope_qkv_cache_{'norm' if use_norm else 'plain'}", "rope.cu", make, setup, launch, reference,
                      atol=2e-6, rtol=2e-6, bytes_moved=lambda inp: 2 * inp["qkv"].nbytes, op="rope_qkv_cache")


CASES += [_make_qkv(True), _make_qkv(False)]
