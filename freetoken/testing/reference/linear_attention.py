"""Reference of ``ops.short_conv`` and ``ops.gated_delta_rule``: float64, the plain per-token recurrence."""

import numpy as np

L2NORM_EPS = 1e-6


def short_conv_reference(x, weight, state):
    """(out [T, C], new state [K-1, C]) in float64."""
    x, w, st = (np.asarray(a, np.float64) for a in (x, weight, state))
    t, k = x.shape[0], w.shape[1]
    u = np.concatenate([st, x], axis=0)
    acc = sum(u[j:j + t] * w[:, j] for j in range(k))
    return acc / (1.0 + np.exp(-acc)), u[t:].copy()


def gated_delta_rule_reference(qkv, g, beta, state, k_heads: int):
    """(out [T, Hv, Dv], new state [Hv, Dk, Dv]) in float64, one token at a time."""
    s = np.array(state, np.float64)
    hv, dk, dv = s.shape
    qkv, g, beta = (np.asarray(a, np.float64) for a in (qkv, g, beta))
    t, rep = qkv.shape[0], hv // k_heads
    q = qkv[:, :k_heads * dk].reshape(t, k_heads, dk)
    k = qkv[:, k_heads * dk:2 * k_heads * dk].reshape(t, k_heads, dk)
    v = qkv[:, 2 * k_heads * dk:].reshape(t, hv, dv)
    q = q / np.sqrt((q * q).sum(-1, keepdims=True) + L2NORM_EPS) / np.sqrt(dk)
    k = k / np.sqrt((k * k).sum(-1, keepdims=True) + L2NORM_EPS)
    out = np.zeros((t, hv, dv))
    for i in range(t):
        for h in range(hv):
            kh = h // rep
            s[h] *= np.exp(g[i, h])
            s[h] += np.outer(k[i, kh], beta[i, h] * (v[i, h] - k[i, kh] @ s[h]))
            out[i, h] = q[i, kh] @ s[h]
    return out, s


def short_conv_batch_reference(x, weight, states, slots, counts):
    """(out [T, C], new states [N, K-1, C]) in float64: each sequence's rows through :func:`short_conv_reference`
    on its state ``states[slots[s]]``, rows in sequence order (``counts[s]`` each); the other states unchanged."""
    st = np.array(states, np.float64)
    outs, lo = [], 0
    for slot, n in zip(slots, counts, strict=True):
        y, st[slot] = short_conv_reference(np.asarray(x)[lo:lo + n], weight, st[slot])
        outs.append(y)
        lo += n
    return np.concatenate(outs), st


def gated_delta_rule_batch_reference(qkv, g, beta, states, k_heads: int, slots, counts):
    """(out [T, Hv, Dv], new states [N, Hv, Dk, Dv]) in float64: :func:`gated_delta_rule_reference` per sequence
    on its state ``states[slots[s]]``, rows in sequence order; the other states unchanged."""
    st = np.array(states, np.float64)
    outs, lo = [], 0
    for slot, n in zip(slots, counts, strict=True):
        o, st[slot] = gated_delta_rule_reference(np.asarray(qkv)[lo:lo + n], np.asarray(g)[lo:lo + n],
                                                 np.asarray(beta)[lo:lo + n], st[slot], k_heads)
        outs.append(o)
        lo += n
    return np.concatenate(outs), st
