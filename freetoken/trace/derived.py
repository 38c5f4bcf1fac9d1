"""Arrays derived from a routing trace, shared by the policies and the simulators (computed once, cached on it).

Terms: an **admit call** is one (decode step, MoE layer); its **active set** is the unique flat ids
(``layer * E + expert``) of all the step's tokens' top-k in that layer; an **access** is one (admit call, active
id). A **window** is the decode steps a simulator scores: ``"all"`` or ``"second_half"`` (steps ``steps // 2``
onward).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from freetoken.trace.format import Trace

WINDOWS = ("all", "second_half")


@dataclass
class Prepared:
    """Per-trace arrays shared by the policies (computed once, cached on the trace)."""

    active: np.ndarray  # int32 [steps, L, A]: each call's unique flat ids ascending, padded with -1
    counts: np.ndarray  # int32 [steps, L]: active-set sizes
    seq: np.ndarray  # int32 [n]: every access in order (steps, layers, ascending id)
    step_offsets: np.ndarray  # int64 [steps + 1]: accesses of step t are seq[step_offsets[t]:step_offsets[t + 1]]
    seg_start: np.ndarray  # bool [steps]: step t is the first decode step of its segment
    max_active: int


def prepare(trace: Trace) -> Prepared:
    """The derived arrays of ``trace`` (cached on it: treat traces as immutable)."""
    return trace.cached("prepared", lambda: _prepare(trace))


def _prepare(trace: Trace) -> Prepared:
    steps, L, T, k = trace.decode_ids.shape
    A = T * k
    offs = (np.arange(L, dtype=np.int32) * trace.num_experts)[None, :, None]
    active = trace.decode_ids.reshape(steps, L, A).astype(np.int32) + offs
    active.sort(axis=-1)
    if A > 1 and T > 1:
        dup = np.zeros(active.shape, bool)
        dup[..., 1:] = active[..., 1:] == active[..., :-1]
        if dup.any():
            big = np.iinfo(np.int32).max
            active[dup] = big
            active.sort(axis=-1)
            active[active == big] = -1
        counts = (A - dup.sum(-1)).astype(np.int32)
    else:
        counts = np.full((steps, L), A, np.int32)
    if (counts == A).all():
        seq = active.reshape(-1)
    else:
        seq = active[active >= 0]
    offsets = np.zeros(steps + 1, np.int64)
    np.cumsum(counts.sum(-1, dtype=np.int64), out=offsets[1:])
    seg = trace.step_segment
    seg_start = np.ones(steps, bool)
    seg_start[1:] = seg[1:] != seg[:-1]
    return Prepared(active=active, counts=counts, seq=seq, step_offsets=offsets, seg_start=seg_start,
                    max_active=int(counts.max()) if counts.size else 0)


def active_sets(trace: Trace) -> tuple[np.ndarray, np.ndarray]:
    """(indicator bool [steps, L, E] of each call's active experts, tokens int16 [steps, L, E] per expert)."""
    return trace.cached("active_sets", lambda: _active_sets(trace))


def _active_sets(trace: Trace) -> tuple[np.ndarray, np.ndarray]:
    steps, L, T, k = trace.decode_ids.shape
    E = trace.num_experts
    tok = np.zeros((steps, L, E), np.int16 if T * k < np.iinfo(np.int16).max else np.int32)
    ids = trace.decode_ids.reshape(steps, L, T * k).astype(np.int64)
    base = (np.arange(steps)[:, None, None] * L + np.arange(L)[None, :, None]) * E
    np.add.at(tok.reshape(-1), (base + ids).reshape(-1), 1)
    return tok > 0, tok


def token_counts(trace: Trace) -> np.ndarray:
    """int32 [steps, L, A]: tokens routed to each id of ``prepare(trace).active`` (0 on the padding)."""
    return trace.cached("active_tokens", lambda: _token_counts(trace))


def _token_counts(trace: Trace) -> np.ndarray:
    p = prepare(trace)
    if trace.tokens == 1:
        return (p.active >= 0).astype(np.int32)
    _, per_expert = active_sets(trace)
    offs = (np.arange(trace.num_layers, dtype=np.int64) * trace.num_experts)[None, :, None]
    e = np.where(p.active >= 0, p.active - offs, 0)
    return np.where(p.active >= 0, np.take_along_axis(per_expert, e, -1), 0).astype(np.int32)


def window_steps(trace: Trace, window: str) -> tuple[int, int]:
    """The decode-step range [t0, t1) that ``window`` scores."""
    if window == "all":
        return 0, trace.steps
    if window == "second_half":
        return trace.steps // 2, trace.steps
    raise ValueError(f"unknown window {window!r} (expected one of {', '.join(WINDOWS)})")


def check_slots(slots) -> int:
    """``slots`` as an int; ValueError unless it is a non-negative integer."""
    s = int(slots)
    if s != slots or s < 0:
        raise ValueError(f"slots must be a non-negative integer, got {slots!r}")
    return s
