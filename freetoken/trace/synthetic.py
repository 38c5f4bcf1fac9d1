"""Synthetic routing traces with tunable locality, for testing and for exploring cache policies.

The model (``locality`` = ``x`` in [0, 1]):

1. **Skewed popularity per layer.** Layer ``l`` has a base popularity ``w_l[e] = (rank_l[e] + 1) ** -a`` with
   ``a = ZIPF_SCALE * x`` (Zipf-like; ``x = 0`` is uniform) and ``rank_l`` a random permutation, so every layer
   has different hot experts.
2. **Segment drift.** Each segment (prompt / turn) ``s`` perturbs the popularity: ``q_{s,l} ~ w_l * exp(drift * z)``
   with ``z ~ N(0, 1)`` drawn per (segment, layer, expert). The segment's prefill and its decode steps both route
   by ``q_{s,l}``, so the prefill counts predict the segment's decode routing.
3. **Prefill counts.** ``prefill_tokens`` tokens per segment and layer each route to k distinct experts drawn
   without replacement with probabilities ``q_{s,l}`` (Efraimidis-Spirakis keys ``Exp(1) / q``); the counts are
   their histogram.
4. **Temporal correlation in decode.** Every token of the decode batch is its own sequence. At each decode step,
   each of a token's k positions independently keeps the expert it had at the previous step of the same segment
   with probability ``x``; the remaining positions are filled, in order, by a fresh draw without replacement
   from ``q_{s,l}`` that skips the kept experts (so the k ids of a row stay distinct). The first decode step of a
   segment is all fresh.

The decode steps are split over the segments as evenly as possible, in order (earlier segments get the extra
step; with more segments than steps, the last ones have no decode steps).
"""

from __future__ import annotations

import numpy as np

from freetoken.trace.format import Trace

ZIPF_SCALE = 1.5
_CHUNK_ROWS = 1 << 21  # random keys generated per chunk (rows x experts), bounds memory


def _ranked_draws(rng: np.random.Generator, logq: np.ndarray, m: int) -> np.ndarray:
    """For each row of ``logq`` [N, E], m distinct experts drawn without replacement with probs exp(logq), in
    draw order (Efraimidis-Spirakis: the m smallest ``Exp(1) / q``, ascending)."""
    n, e = logq.shape
    expo = np.maximum(rng.standard_exponential((n, e), dtype=np.float32), np.finfo(np.float32).tiny)
    keys = np.log(expo) - logq.astype(np.float32)
    if m < e:
        part = np.argpartition(keys, m - 1, axis=1)[:, :m]
    else:
        part = np.broadcast_to(np.arange(e), (n, e)).copy()
    order = np.argsort(np.take_along_axis(keys, part, 1), axis=1, kind="stable")
    return np.take_along_axis(part, order, 1)


def _segment_log_popularity(rng, L: int, E: int, segments: int, locality: float, drift: float) -> np.ndarray:
    """log q [segments, L, E]: the Zipf-like base popularity of random rank per layer, drifted per segment (the
    generator's first two draws from ``rng``)."""
    ranks = np.argsort(rng.random((L, E)), axis=1)
    logw = -ZIPF_SCALE * locality * np.log1p(ranks.astype(np.float64))  # [L, E]
    logq = logw[None] + drift * rng.standard_normal((segments, L, E))  # [S, L, E]
    return logq - np.log(np.exp(logq).sum(-1, keepdims=True))


def segment_popularity(num_layers: int, num_experts: int, segments: int, locality: float, seed: int,
                       drift: float = 1.0) -> np.ndarray:
    """q [segments, L, E]: the per-segment expert probabilities :func:`make_trace` draws its routing from with the
    same arguments (for a policy told the process, as ``bench/policy_bound.py``'s)."""
    rng = np.random.default_rng(seed)
    return np.exp(_segment_log_popularity(rng, num_layers, num_experts, segments, locality, drift))


def make_trace(num_layers: int = 8, num_experts: int = 64, top_k: int = 4, steps: int = 1000, segments: int = 4,
               locality: float = 0.5, seed: int = 0, record_bytes: int = 1 << 20, tokens: int = 1,
               prefill_tokens: int = 256, drift: float = 1.0, model: str = "synthetic") -> Trace:
    """A synthetic :class:`~freetoken.trace.format.Trace`; see the module docstring for the model."""
    if not 0.0 <= locality <= 1.0:
        raise ValueError(f"locality must be in [0, 1], got {locality}")
    if min(num_layers, num_experts, top_k, tokens, record_bytes) < 1:
        raise ValueError("num_layers, num_experts, top_k, tokens and record_bytes must be >= 1")
    if top_k > num_experts:
        raise ValueError(f"top_k {top_k} exceeds num_experts {num_experts}")
    if steps < 0 or segments < 1 or prefill_tokens < 0 or drift < 0:
        raise ValueError("steps and prefill_tokens must be >= 0, segments >= 1, drift >= 0")
    rng = np.random.default_rng(seed)
    L, E, k, T = num_layers, num_experts, top_k, tokens
    logq = _segment_log_popularity(rng, L, E, segments, locality, drift)  # [S, L, E]

    prefill = np.zeros((segments, L, E), np.int32)
    if prefill_tokens:
        for s in range(segments):
            rows = np.repeat(logq[s], prefill_tokens, axis=0)  # [L * P, E]
            drawn = _ranked_draws(rng, rows, k).reshape(L, prefill_tokens * k)
            for layer in range(L):
                prefill[s, layer] = np.bincount(drawn[layer], minlength=E)

    per = np.full(segments, steps // segments)
    per[: steps % segments] += 1
    step_segment = np.repeat(np.arange(segments, dtype=np.int32), per)
    first = np.ones(steps, bool)
    first[1:] = step_segment[1:] != step_segment[:-1]

    R = L * T
    m = min(2 * k, E)
    dtype = np.int16 if E <= np.iinfo(np.int16).max + 1 else np.int32
    out = np.empty((steps, R, k), dtype)
    chunk = max(1, _CHUNK_ROWS // (R * E))
    prev = np.zeros((R, k), np.int64)
    for c0 in range(0, steps, chunk):
        c1 = min(steps, c0 + chunk)
        seg = step_segment[c0:c1]
        rows = np.repeat(logq[seg], T, axis=1).reshape(-1, E)  # [(c1-c0) * L * T, E], layer-major per step
        cands = _ranked_draws(rng, rows, m).reshape(c1 - c0, R, m)
        keep_all = rng.random((c1 - c0, R, k)) < locality
        for i in range(c1 - c0):
            cand = cands[i]
            if first[c0 + i]:
                new = cand[:, :k]
            else:
                keep = keep_all[i]
                kept = np.where(keep, prev, -1)
                dup = (cand[:, :, None] == kept[:, None, :]).any(-1)
                fill = np.take_along_axis(cand, np.argsort(dup, axis=1, kind="stable"), 1)
                free_rank = np.maximum(np.cumsum(~keep, axis=1) - 1, 0)
                new = np.where(keep, prev, np.take_along_axis(fill, free_rank, 1))
            out[c0 + i] = new
            prev = new
    return Trace(decode_ids=out.reshape(steps, L, T, k), step_segment=step_segment, prefill_counts=prefill,
                 num_experts=E, num_layers=L, top_k=k, record_bytes=record_bytes, model=model).validate()
