"""TEMPORARY (drop at merge): ``kv_store`` and ``paged_attention`` on the NumPy reference of their contract
(``freetoken/testing/reference/paged_attention.py``), so that the model can be built against the two ops' public
signatures while their CUDA and Numba kernels are written elsewhere. Device arrays go to the host and back.

The reference is imported through importlib because the package never imports ``freetoken.testing`` (the real ops
replace this module, and with it this exception)."""

from __future__ import annotations

import importlib

import numpy as np

from freetoken.ops._common import resolve


def _reference():
    return importlib.import_module("freetoken.testing.reference.paged_attention")


def kv_store(k, v, k_pool, v_pool, k_scale, v_scale, block_table, start, *, device=None, checked=False):
    """Append ``k``, ``v`` ``[T, Hkv, D]`` float32 at positions ``start ..`` of the pools (in place)."""
    dev = resolve(device)
    ref = _reference()
    table = np.asarray(dev.to_host(block_table), np.int64)
    t = k.shape[0]
    if t == 0:
        return None
    kind = ref.kv_kind(k_pool)
    bs = k_pool.shape[1]
    pos = int(start) + np.arange(t)
    blocks, rows = table[pos // bs], pos % bs
    for pool, scales, x in ((k_pool, k_scale, k), (v_pool, v_scale, v)):
        enc, sc = ref.kv_encode_reference(np.asarray(dev.to_host(x), np.float32), kind)
        pool[blocks, rows] = dev.asarray(np.ascontiguousarray(enc))
        if sc is not None:
            scales[blocks, rows] = dev.asarray(sc)
    return None


def paged_attention(q, k_pool, v_pool, k_scale, v_scale, block_table, start, *, window=0, sinks=None, scale=None,
                    out=None, device=None, checked=False):
    """Causal GQA of ``q [T, H, D]`` at positions ``start ..`` over the pools -> float32 ``[T, H * D]``."""
    dev = resolve(device)

    def host(a):
        return None if a is None else np.asarray(dev.to_host(a))

    y = _reference().paged_attention_reference(host(q), host(k_pool), host(v_pool), host(k_scale), host(v_scale),
                                               host(block_table), int(start), window=window, sinks=host(sinks),
                                               scale=scale).astype(np.float32)
    if out is None:
        return dev.asarray(y)
    out[...] = dev.asarray(y)
    return out
