"""Per-expert format plans for FTW conversion (``freetoken convert MODEL OUT.ftw --hot ... | --max-nmse ...``).

A *plan* is one list of format names per MoE layer (in MoE-layer order), one name per expert:
``plan[i][e]`` is the format expert ``e`` of the i-th MoE layer is written in. FTW records carry their own formats
(docs/ftw.md), so a plan may mix formats inside a layer. Two policies build one:

* :func:`hot_cold_plan`: the most used experts of each layer (routing counts, e.g. :func:`counts_from_trace`) in a
  precise format, the rest in a small one: the bytes go where the tokens go.
* :func:`error_budget_plan`: each expert in the smallest candidate format whose quantization error stays under a
  budget: experts whose weights quantize badly (outliers) get more bits, the others fewer.
"""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path

import numpy as np

from freetoken import formats
from freetoken.formats import MATRICES, RecordLayout

#: ``--candidates`` default: smallest first (4.25, 4.5, 8.25 and 16 bits per weight).
DEFAULT_CANDIDATES = ("mxfp4", "q4_0", "fp8_block", "bf16")

Plan = list[list[str]]


def moe_layer_ids(cfg) -> list[int]:
    """The model's MoE layers, in order: the i-th is the one ``plan[i]`` and a trace's layer i describe."""
    return [i for i in range(cfg.num_layers) if cfg.is_moe(i)]


def format_layouts(cfg, names) -> dict[str, RecordLayout]:
    """{name: the record layout of ``cfg``'s experts with gate, up and down all in format ``name``}. A format whose
    blocks do not fit the expert shape (k-quants need K divisible by 256) is refused here, by name."""
    return {n: RecordLayout(formats.get(n), cfg.hidden, cfg.moe_inter, cfg.expert_bias, cfg.expert_act)
            for n in dict.fromkeys(names)}


def check_plan(plan: Plan, num_moe_layers: int, num_experts: int) -> None:
    """ValueError unless ``plan`` has one list of ``num_experts`` known format names per MoE layer."""
    if len(plan) != num_moe_layers:
        raise ValueError(f"expert plan: {len(plan)} layers, the model has {num_moe_layers} MoE layers")
    for i, row in enumerate(plan):
        if len(row) != num_experts:
            raise ValueError(f"expert plan: MoE layer {i} has {len(row)} entries for {num_experts} experts")
        unknown = sorted(set(row) - set(formats.NAMES))
        if unknown:
            raise ValueError(f"expert plan: MoE layer {i}: unknown formats {unknown}; known: "
                             f"{', '.join(formats.NAMES)}")


def hot_cold_plan(counts, hot: str, cold: str, hot_fraction: float) -> Plan:
    """``counts`` [moe_layers, experts] routing frequencies -> a plan: in every MoE layer the
    ``round(hot_fraction * E)`` (half up) most used experts get ``hot``, the rest ``cold``; ties go to the lower
    expert id. Chosen per layer, not over the whole model, so every layer keeps its hottest experts precise (each
    layer's experts share the tokens' routing equally: a global cut would starve the layers with flatter
    routing)."""
    counts = np.asarray(counts)
    if counts.ndim != 2 or counts.shape[1] < 1:
        raise ValueError(f"routing counts must be [moe_layers, experts], got shape {list(counts.shape)}")
    if not 0.0 <= hot_fraction <= 1.0:
        raise ValueError(f"hot fraction must be in [0, 1], got {hot_fraction}")
    for name in (hot, cold):
        formats.get(name)  # an unknown name is refused with the list of known ones
    e = counts.shape[1]
    n_hot = min(e, max(0, math.floor(hot_fraction * e + 0.5)))
    plan = []
    for row in counts:
        order = np.lexsort((np.arange(e), -row))  # most used first, then lower id
        hot_ids = set(order[:n_hot].tolist())
        plan.append([hot if x in hot_ids else cold for x in range(e)])
    return plan


def counts_from_trace(path: str | Path, num_moe_layers: int, num_experts: int) -> np.ndarray:
    """int64 [moe_layers, experts]: how often each expert was routed in the trace file ``path`` (as
    ``freetoken run --record-trace`` writes it), prefill and decode of every segment. ValueError naming the file
    when the trace is of a model with other layer or expert counts (its ids would name other experts)."""
    from freetoken.policy.pinning import counts_from_trace as trace_counts
    from freetoken.trace.format import load_trace

    trace = load_trace(path)  # validates; a TraceError (a ValueError) names the file and the field
    if (trace.num_layers, trace.num_experts) != (num_moe_layers, num_experts):
        raise ValueError(f"trace file {path}: {trace.num_layers} MoE layers x {trace.num_experts} experts, the model "
                         f"has {num_moe_layers} x {num_experts}: it was recorded from another model")
    return trace_counts(trace)


def _float_experts(weights, layer: int, layout: RecordLayout) -> list[np.ndarray]:
    """float32 [E, N, K] of gate, up and down of ``layer``: the values a re-quantization starts from (what
    ``weights.expert_banks`` quantizes for a format the source does not store), so errors are measured against
    the source, not against another lossy format."""
    from freetoken.models.weights import GGUFWeights, HFWeights

    if isinstance(weights, HFWeights):  # stored floats; block-FP8 / MXFP4 checkpoints decoded
        return [weights.expert_stack(layer, m) for m in MATRICES]
    if isinstance(weights, GGUFWeights):  # any stored type, decoded (f16 experts included)
        names = weights.gguf.expert_names(layer)
        return [weights.gguf.get_f32(names[m]) for m in MATRICES]
    native = weights.native_expert_formats(layer)  # an FTW file: the decode of its records
    if native is None:
        raise ValueError(f"layer {layer}: the source's expert values cannot be read as floats for an error budget")
    stored = RecordLayout(formats.get(native[0]), layout.hidden, layout.inter, layout.bias, layout.act,
                          down_fmt=formats.get(native[1]))
    f = stored.dequantize(weights.expert_banks(layer, stored))
    return [f[m] for m in MATRICES]


def nmse(approx: np.ndarray, ref: np.ndarray) -> np.ndarray:
    """Per expert (leading axis): sum((approx - ref)^2) / sum(ref^2), in float64. An all-zero expert scores 0 when
    reproduced exactly, else inf."""
    a, r = np.asarray(approx, np.float64), np.asarray(ref, np.float64)
    axes = tuple(range(1, r.ndim))
    err, power = ((a - r) ** 2).sum(axis=axes), (r ** 2).sum(axis=axes)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(power > 0, err / np.where(power > 0, power, 1), np.where(err > 0, np.inf, 0.0))


def error_budget_plan(weights, layouts_by_format: dict[str, RecordLayout], moe_layer_ids: list[int],
                      max_nmse: float, candidates: list[str]) -> Plan:
    """A plan giving each expert the first of ``candidates`` (order them smallest first) whose quantization NMSE is
    at most ``max_nmse``, or the last candidate when none is. An expert's NMSE in a format is the worst of its
    gate, up and down (:func:`nmse` of the format's decode against the source's float values), measured on the banks
    ``weights.expert_banks`` gives, i.e. on exactly what the file would hold (a format the source stores is moved
    bit for bit and scores 0)."""
    if not (math.isfinite(max_nmse) and max_nmse >= 0):
        raise ValueError(f"the NMSE budget must be a finite number >= 0, got {max_nmse}")
    if not candidates:
        raise ValueError("error budget: no candidate formats")
    missing = [c for c in candidates if c not in layouts_by_format]
    if missing:
        raise ValueError(f"error budget: no record layout for candidates {missing}")
    num_experts = int(weights.cfg.num_experts)
    plan = []
    for layer in moe_layer_ids:
        choice = [candidates[-1]] * num_experts  # the fallback: the last candidate is never measured
        undecided, ref = list(range(num_experts)), None
        for fmt in candidates[:-1]:
            if not undecided:
                break
            lay = layouts_by_format[fmt]
            if ref is None:
                ref = _float_experts(weights, layer, lay)
            deq = lay.dequantize(weights.expert_banks(layer, lay))
            worst = np.max([nmse(deq[m], r) for m, r in zip(MATRICES, ref, strict=True)], axis=0)
            for e in undecided:
                if worst[e] <= max_nmse:  # NaN (a NaN weight) never is: such an expert falls through
                    choice[e] = fmt
            undecided = [e for e in undecided if not worst[e] <= max_nmse]
        plan.append(choice)
    return plan


def plan_summary(plan: Plan, layouts: dict[str, RecordLayout]) -> str:
    """One line: experts per format, and the average bits per expert weight: a record's payload bytes
    (``record_bytes``: banks and biases, each padded to 16 bytes; not the 64-byte header or the file's 4096-byte
    alignment) * 8 over its gate + up + down weights, averaged over every expert of the plan."""
    count = Counter(f for row in plan for f in row)
    total = sum(count.values())
    if not total:
        return "expert plan: no MoE layers"
    any_layout = layouts[next(iter(count))]
    per_record = sum(n * k for n, k in (any_layout.matrix_shape(m) for m in MATRICES))
    bits = sum(c * layouts[f].record_bytes * 8 / per_record for f, c in count.items()) / total
    order = sorted(count, key=lambda f: formats.NAMES.index(f))
    parts = ", ".join(f"{count[f]} {f}" for f in order)
    return (f"expert plan: {parts} ({total} experts in {len(plan)} MoE layers); "
            f"{bits:.2f} bits per expert weight on average")
