"""NumPy reference of the routed-expert forward (the MoE FFN), the oracle of every expert kernel.

``y[t] = sum_j weights[t, j] * (down[e] @ act(gate[e] @ x[t] + gb[e], up[e] @ x[t] + ub[e]) + db[e])`` with
``e = ids[t, j]``, computed in float64 from the dequantized record; a pair whose id is ``NO_ROUTE`` adds nothing.
"""

from __future__ import annotations

import numpy as np

from freetoken.device.constants import ACT_SWIGLU, GPT_OSS_ALPHA, GPT_OSS_LIMIT, NO_ROUTE, activation_code


def apply_activation(gate: np.ndarray, up: np.ndarray, act: str) -> np.ndarray:
    code = activation_code(act)
    if code == ACT_SWIGLU:
        return gate / (1.0 + np.exp(-gate)) * up
    gate = np.minimum(gate, GPT_OSS_LIMIT)
    up = np.clip(up, -GPT_OSS_LIMIT, GPT_OSS_LIMIT)
    return (up + 1.0) * gate / (1.0 + np.exp(-GPT_OSS_ALPHA * gate))


def _bf16(a: np.ndarray) -> np.ndarray:
    import ml_dtypes

    return np.asarray(a, np.float32).astype(ml_dtypes.bfloat16).astype(np.float64)


def round_weights_bf16(deq: dict[str, np.ndarray], globals_: dict[str, np.ndarray] | None = None) -> dict:
    """Dequantized matrices as the prefill kernel feeds them to tensor cores: the value before the per-matrix
    global scale (``globals_[m]``, one per expert, nvfp4) rounded to bf16, then scaled back."""
    out = dict(deq)
    for m in ("gate", "up", "down"):
        g = None if globals_ is None else globals_.get(m)
        if g is None:
            out[m] = _bf16(deq[m])
        else:
            g = np.asarray(g, np.float64)[:, None, None]
            out[m] = _bf16(deq[m] / g) * g
    return out


def quantize_q8_reference(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """8-bit blocks of the rows of ``x`` [T, K] as the cpu int8 path makes them (:mod:`freetoken.cpu_kernels.q8_act`):
    (q int8 [T, K], d float32 [T, K / 32]) with ``d = max|x| / 127`` per 32 values and ``q = rint(x / d)``, in
    float32 arithmetic; a block holding NaN or an infinity gets ``d = NaN`` and ``q = 0``."""
    x = np.ascontiguousarray(x, np.float32)
    t, k = x.shape
    blocks = x.reshape(t, k // 32, 32)
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        finite = np.isfinite(blocks).all(axis=-1)
        amax = np.where(finite, np.abs(np.where(np.isfinite(blocks), blocks, 0)).max(axis=-1), 0).astype(np.float32)
        d = amax / np.float32(127.0)
        inv = np.where(d > 0, np.float32(1.0) / np.where(d > 0, d, np.float32(1.0)), np.float32(0.0))
        q = np.clip(np.rint(blocks * inv[..., None].astype(np.float32)), -127, 127)
    q = np.where(finite[..., None], q, 0).astype(np.int8)
    return q.reshape(t, k), np.where(finite, d, np.float32(np.nan)).astype(np.float32)


def q8_round_trip(x: np.ndarray) -> np.ndarray:
    """``x`` as the int8 path sees it: :func:`quantize_q8_reference` dequantized (float64)."""
    q, d = quantize_q8_reference(x)
    t, k = q.shape
    return (q.reshape(t, k // 32, 32).astype(np.float64) * d[..., None].astype(np.float64)).reshape(t, k)


def moe_forward_reference(x: np.ndarray, ids: np.ndarray, weights: np.ndarray, deq: dict[str, np.ndarray],
                          act: str = "swiglu", bf16_inputs: bool = False, q8_inputs: bool = False,
                          bf16_h: bool = False) -> np.ndarray:
    """float64 [T, H] output.

    Parameters
    ----------
    x : [T, H] activations (any float dtype; bf16 via ml_dtypes is widened exactly)
    ids : [T, k] expert (slot) indices into the leading dimension of ``deq``'s matrices
    weights : [T, k] routing weights
    deq : ``RecordLayout.dequantize(banks)``: "gate" [E, I, H], "up" [E, I, H], "down" [E, H, I], and
        "gate.b"/"up.b"/"down.b" when the record has biases
    bf16_inputs : round x and the intermediate h to bf16, as the prefill (tensor-core) kernel does; pass
        weights through :func:`round_weights_bf16` for the same reason
    q8_inputs : quantize x and the intermediate h (rounded to float32 first, as the kernel holds it) to 8-bit blocks,
        as the cpu int8 path does (:func:`q8_round_trip`; the e2m1 formats' block-split order permutes values
        within each block of 32 only, so the blocks are the same)
    bf16_h : round the intermediate h alone to bf16 (a mixed record's down matrix taking bf16 tokens on the cpu)
    """
    x = np.asarray(x).astype(np.float64)
    if bf16_inputs:
        x = _bf16(x)
    if q8_inputs:
        x = q8_round_trip(x)
    ids = np.asarray(ids)
    weights = np.asarray(weights, np.float64)
    y = np.zeros(x.shape, np.float64)
    for e in np.unique(ids[ids != NO_ROUTE]):  # every pair routed to expert e at once (NO_ROUTE: to none)
        t, j = np.nonzero(ids == e)
        xs = x[t]
        g = xs @ deq["gate"][e].astype(np.float64).T
        u = xs @ deq["up"][e].astype(np.float64).T
        if "gate.b" in deq:
            g = g + deq["gate.b"][e]
            u = u + deq["up.b"][e]
        h = apply_activation(g, u, act)
        if q8_inputs:
            h = q8_round_trip(h)
        o = (_bf16(h) if bf16_inputs or bf16_h else h) @ deq["down"][e].astype(np.float64).T
        if "down.b" in deq:
            o = o + deq["down.b"][e]
        np.add.at(y, t, weights[t, j][:, None] * o)
    return y


def moe_prefill_reference(x: np.ndarray, ids: np.ndarray, weights: np.ndarray, layout, banks: dict[str, np.ndarray],
                          act: str = "swiglu") -> np.ndarray:
    """The reference as the prefill (tensor-core) kernel computes it: x, each matrix before its per-matrix global
    scale, and the intermediate h rounded to bf16; ``layout`` is the record's ``RecordLayout``."""
    globals_ = {m: banks[f"{m}.g"] for m in ("gate", "up", "down") if f"{m}.g" in banks}
    deq = round_weights_bf16(layout.dequantize(banks), globals_)
    return moe_forward_reference(x, ids, weights, deq, act, bf16_inputs=True)
