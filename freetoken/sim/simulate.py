"""Replay a trace through several cache policies and slot counts (:func:`simulate`), the table
(:func:`format_table`), and a trace summary (:func:`summarize`, :func:`format_summary`)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

from freetoken.sim.policies import BORROWING, DEFAULT_POLICIES, POLICIES
from freetoken.sim.table import text_table
from freetoken.trace.derived import WINDOWS, prepare
from freetoken.trace.format import Trace

COLUMNS = ("policy", "slots", "window", "accesses", "misses", "miss_rate", "loads", "bytes_moved")


def simulate(trace: Trace, slots_list: Iterable[int], window: str = "second_half",
             policies: Sequence[str] | None = None, prefill_borrow: bool = True) -> list[dict]:
    """Run every policy at every slot count; one row (a dict with :data:`COLUMNS` and ``note``) per pair, grouped
    by slot count. ``window`` is what the policies score (static_frequency always scores the second half; each
    row states its window). ``prefill_borrow`` applies to the demand policies (:data:`BORROWING`: lru, lfu_decay,
    next_use and their variants)."""
    if window not in WINDOWS:
        raise ValueError(f"unknown window {window!r} (expected one of {', '.join(WINDOWS)})")
    names = list(DEFAULT_POLICIES if policies is None else policies)
    unknown = [n for n in names if n not in POLICIES]
    if unknown:
        raise ValueError(f"unknown polic{'ies' if len(unknown) > 1 else 'y'} {', '.join(unknown)} "
                         f"(known: {', '.join(POLICIES)})")
    rows = []
    for slots in slots_list:
        for name in names:
            kwargs = {"prefill_borrow": prefill_borrow} if name in BORROWING else {}
            rows.append(POLICIES[name](trace, slots, window=window, **kwargs).as_row())
    return rows


def format_table(rows: Sequence[dict]) -> str:
    """A plain-text table: miss rate in %, bytes moved in GB (1e9 bytes)."""
    header = ("policy", "slots", "window", "accesses", "misses", "miss rate", "loads", "GB moved", "note")
    body = [(r["policy"], str(r["slots"]), r["window"], f"{r['accesses']:,}", f"{r['misses']:,}",
             f"{100.0 * r['miss_rate']:.2f}%", f"{r['loads']:,}", f"{r['bytes_moved'] / 1e9:.3f}", r.get("note", ""))
            for r in rows]
    return "\n".join(text_table(header, body, left={0, 2, 8}, groups=[r["slots"] for r in rows]))


# ------------------------------------------------------------------------------------------- trace summary

WORKING_SET_WINDOWS = (1, 16, 256, 4096)


def summarize(trace: Trace) -> dict:
    """Facts about a trace: shape, segments, per-layer usage entropy of the decode accesses, working sets."""
    p = prepare(trace)
    L, E = trace.num_layers, trace.num_experts
    seg_steps = np.bincount(trace.step_segment, minlength=trace.num_segments) if trace.num_segments else np.zeros(0)
    use = np.bincount(p.seq, minlength=trace.num_flat).reshape(L, E).astype(np.float64)
    tot = use.sum(1, keepdims=True)
    prob = np.divide(use, tot, out=np.zeros_like(use), where=tot > 0)
    with np.errstate(divide="ignore", invalid="ignore"):
        entropy = -np.where(prob > 0, prob * np.log2(prob), 0.0).sum(1)
    flat_use = use.reshape(-1)
    n = int(p.seq.size)
    hot = {}
    if n:
        csum = np.cumsum(np.sort(flat_use)[::-1])
        for q in (0.5, 0.9, 0.99):
            hot[q] = int(np.searchsorted(csum, q * n - 1e-9) + 1)
    ws = {}
    if n:
        order = np.argsort(p.seq, kind="stable")
        prev = np.full(n, -1, np.int64)
        same = p.seq[order[1:]] == p.seq[order[:-1]]
        prev[order[1:][same]] = order[:-1][same]
        step_of = np.repeat(np.arange(trace.steps), np.diff(p.step_offsets))
        for w in WORKING_SET_WINDOWS:
            if w > trace.steps and ws:
                break
            start = p.step_offsets[(step_of // w) * w]
            distinct = np.bincount(step_of // w, weights=(prev < start)).astype(np.int64)
            full = trace.steps // w
            ws[w] = float(distinct[:full].mean()) if full else float(distinct.mean())
    seg_ws = []
    for s in range(trace.num_segments):
        t = np.nonzero(trace.step_segment == s)[0]
        if t.size:
            seg_ws.append(int(np.unique(p.seq[p.step_offsets[t[0]]: p.step_offsets[t[-1] + 1]]).size))
    prefill_tokens = float(trace.prefill_counts.sum()) / (L * trace.top_k * max(1, trace.num_segments))
    return {
        "model": trace.model, "version": trace.version, "steps": trace.steps, "layers": L, "experts": E,
        "tokens": trace.tokens, "top_k": trace.top_k, "record_bytes": trace.record_bytes,
        "segments": trace.num_segments, "segments_without_decode": int((seg_steps == 0).sum()),
        "steps_per_segment": (int(seg_steps.min()), float(seg_steps.mean()), int(seg_steps.max()))
        if seg_steps.size else (0, 0.0, 0),
        "prefill_tokens_per_segment": prefill_tokens,
        "accesses": n, "max_active": p.max_active,
        "entropy_bits": entropy.tolist(), "entropy_max_bits": float(np.log2(E)),
        "distinct_ids": int(np.count_nonzero(flat_use)), "hot_set": hot, "working_set": ws,
        "segment_working_set": (min(seg_ws), float(np.mean(seg_ws)), max(seg_ws)) if seg_ws else None,
    }


def format_summary(s: dict, source: str = "") -> str:
    """A readable report of :func:`summarize`."""
    gb = s["record_bytes"] * s["layers"] * s["experts"] / 1e9
    nflat = s["layers"] * s["experts"]
    lines = []
    if source:
        lines.append(f"trace      {source}")
    lines += [
        f"model      {s['model'] or '-'} (trace version {s['version']})",
        f"decode     {s['steps']:,} steps x {s['layers']} MoE layers x {s['tokens']} token(s) x top-{s['top_k']}; "
        f"{s['experts']} experts per layer, {nflat:,} flat ids",
        f"records    {s['record_bytes']:,} bytes per expert; all experts {gb:.2f} GB",
    ]
    lo, mean, hi = s["steps_per_segment"]
    lines.append(f"segments   {s['segments']} (decode steps per segment min {lo} / mean {mean:.1f} / max {hi}; "
                 f"{s['segments_without_decode']} without decode), prefill ~{s['prefill_tokens_per_segment']:.0f} "
                 f"tokens per segment")
    lines.append(f"accesses   {s['accesses']:,} (unique ids per admit call); largest active set {s['max_active']} "
                 f"(the fewest slots lru accepts)")
    ent = s["entropy_bits"]
    if s["accesses"]:
        lines.append(f"entropy    of each layer's decode expert usage, bits (uniform = {s['entropy_max_bits']:.2f}): "
                     f"min {min(ent):.2f} / mean {sum(ent) / len(ent):.2f} / max {max(ent):.2f}")
        for i in range(0, len(ent), 16):
            vals = " ".join(f"{e:.2f}" for e in ent[i:i + 16])
            lines.append(f"  layers {i:>3}-{min(i + 16, len(ent)) - 1:<3} {vals}")
        hot = s["hot_set"]
        lines.append(f"working    {s['distinct_ids']:,} of {nflat:,} flat ids used "
                     f"({100.0 * s['distinct_ids'] / nflat:.1f}%); the hottest "
                     + ", ".join(f"{v:,} cover {int(100 * q)}%" for q, v in hot.items()) + " of accesses")
        lines.append("  distinct ids per window of N steps (mean): "
                     + ", ".join(f"N={w}: {v:,.1f}" for w, v in s["working_set"].items()))
        if s["segment_working_set"]:
            lo, mean, hi = s["segment_working_set"]
            lines.append(f"  distinct ids per segment: min {lo:,} / mean {mean:,.1f} / max {hi:,}")
    return "\n".join(lines)
