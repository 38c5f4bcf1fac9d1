"""INTERIM (replaced by the checked ops of the ops-contract work): rms_norm, rope, softmax routing and causal
attention with today's per-device implementations, so the model can call ops instead of branching on devices."""

from __future__ import annotations

import numpy as np

from freetoken.ops._common import resolve

ATTENTION_DECODE_MAX_TOKENS = 16


def rms_norm(x, weight, eps, *, out=None, device=None):
    dev = resolve(device)
    xp = dev.xp
    if (xp is np and isinstance(x, np.ndarray) and x.dtype == np.float32 and weight.dtype == np.float32
            and 1 <= weight.ndim <= x.ndim and x.shape[x.ndim - weight.ndim:] == weight.shape and x.size):
        from freetoken.cpu_kernels.gemv import rms_norm_rows

        d = x.shape[-1]
        x2 = np.ascontiguousarray(x).reshape(-1, d)
        y = np.empty(x2.shape, np.float32)
        rms_norm_rows(x2, np.ascontiguousarray(weight).reshape(-1, d), np.float32(eps), y)
        return y.reshape(x.shape)
    var = xp.mean(x * x, axis=-1, keepdims=True)
    return x / xp.sqrt(var + np.float32(eps)) * weight


def rope(x, cos, sin, *, out=None, device=None):
    dev = resolve(device)
    xp = dev.xp
    if (xp is np and isinstance(x, np.ndarray) and x.ndim == 3 and x.shape[-1] % 2 == 0 and x.dtype == np.float32
            and cos.dtype == sin.dtype == np.float32 and cos.shape == sin.shape == (x.shape[0], x.shape[2])):
        from freetoken.cpu_kernels.gemv import rope_rows

        y = np.empty(x.shape, np.float32)
        rope_rows(x, cos, sin, y)
        return y
    half = x.shape[-1] // 2
    rotated = xp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def route_softmax_topk(logits, k, renormalize, *, out_ids=None, out_weights=None, device=None):
    from freetoken.ops.topk import topk

    dev = resolve(device)
    xp = dev.xp
    if dev.kind == "cpu" and 1 <= k <= logits.shape[-1]:
        from freetoken.cpu_kernels.gemv import softmax_topk_rows

        logits = np.ascontiguousarray(logits, dtype=np.float32)
        ids = np.empty((logits.shape[0], k), np.int32)
        w = np.empty((logits.shape[0], k), np.float32)
        softmax_topk_rows(logits, k, renormalize, ids, w)
        return ids, w
    z = logits - logits.max(axis=-1, keepdims=True)
    probs = xp.exp(z)
    probs /= probs.sum(axis=-1, keepdims=True)
    ids, w = topk(xp.ascontiguousarray(probs, dtype=np.float32), k, device=dev)
    if renormalize:
        w = w / w.sum(axis=-1, keepdims=True)
    return ids, xp.ascontiguousarray(w, dtype=np.float32)


def attention(q, k_cache, v_cache, start, *, device=None):
    from freetoken.ops.attention import attention_decode

    dev = resolve(device)
    xp = dev.xp
    if dev.kind == "cpu" or q.shape[0] > ATTENTION_DECODE_MAX_TOKENS:
        return _attention_arrays(xp, q, k_cache, v_cache, start)
    return attention_decode(xp.ascontiguousarray(q), k_cache, v_cache, start, device=dev)


def _attention_arrays(xp, q, k_cache, v_cache, start: int):
    t, heads, dim = q.shape
    kv_heads = k_cache.shape[1]
    total = start + t
    k = k_cache[:total]
    v = v_cache[:total]
    group = heads // kv_heads
    qg = q.reshape(t, kv_heads, group, dim).transpose(1, 2, 0, 3)  # [Hkv, G, T, D]
    scores = xp.matmul(qg, k.transpose(1, 2, 0)[:, None]) * np.float32(1.0 / np.sqrt(dim))  # [Hkv, G, T, total]
    mask = np.arange(total)[None, :] > (start + np.arange(t))[:, None]
    scores = xp.where(xp.asarray(mask), np.float32(-np.inf), scores)
    scores = scores - scores.max(axis=-1, keepdims=True)
    p = xp.exp(scores)
    p /= p.sum(axis=-1, keepdims=True)
    out = xp.matmul(p, v.transpose(1, 0, 2)[:, None])  # [Hkv, G, T, D]
    return out.transpose(2, 0, 1, 3).reshape(t, heads * dim)
