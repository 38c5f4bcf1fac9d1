"""What a loaded model holds in memory, for the last lines of ``freetoken run`` and ``chat``: weights, expert slots,
the KV pool and the process's peak host memory (``resource.getrusage``: the peak resident set size), and the weights
by the type they are held in (a GGUF Q4_K_M file: q4_k and q6_k experts, q4_k / q5_k / q6_k / q8_0 projections)."""

from __future__ import annotations

import resource
import sys

from freetoken.loaders.memory import gib


def peak_rss_bytes() -> int:
    """The process's peak resident set size (Linux reports kilobytes, macOS bytes)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak) if sys.platform == "darwin" else int(peak) * 1024


def memory_breakdown(model) -> dict[str, int]:
    """Bytes by what they hold: the decoder's weights, the expert runner's banks and slots, the KV pool."""
    dec = model.decoder
    out = dict(dec.weight_bytes())
    out.update(model.experts.memory())
    out["KV pool"] = int(dec.pool.nbytes) if dec.pool is not None else 0
    if getattr(dec, "recurrent", False):  # the linear-attention states: the sequences' slots, the current sequence's
        # snapshots, the earlier sequences' kept in the state cache
        out["linear-attention states"] = (dec.state_slots.nbytes + dec.state_bytes() * dec.kept_snapshots
                                          + model.state_cache.nbytes)
    return out


def memory_line(model) -> str:
    """One line: weights (dense, embedding and expert banks: with a host tier, its rows), expert slots, KV pool
    (kind, tokens used of the context), peak host RSS."""
    parts = memory_breakdown(model)
    slots = parts.get("expert slots", 0)
    states = parts.get("linear-attention states")
    weights = sum(v for k, v in parts.items() if k not in ("expert slots", "KV pool", "linear-attention states"))
    dec = model.decoder
    kind = dec.pool.kind if dec.pool is not None else "-"
    extra = "" if states is None else f", linear-attention states {gib(states)}"
    return (f"memory: weights {gib(weights)}, expert slots {gib(slots)}, KV pool {gib(parts['KV pool'])} ({kind}, "
            f"{dec.length}/{dec.ctx} tokens){extra}, peak host RSS {gib(peak_rss_bytes())}")


def breakdown_line(model) -> str:
    """``--verbose``: every part of :func:`memory_breakdown`."""
    return "memory breakdown: " + ", ".join(f"{k} {gib(v)}" for k, v in memory_breakdown(model).items())


def _linears(obj, seen: set[int]):
    """Every :class:`freetoken.models.linear.Linear` reachable from ``obj`` through the model's own objects (the
    expert runner and the weight source are not walked: they are not the decoder's dense weights)."""
    from freetoken.models.linear import Linear

    if id(obj) in seen:
        return
    seen.add(id(obj))
    if isinstance(obj, Linear):
        yield from (p for p in obj.parts if p is obj or id(p) not in seen)
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            yield from _linears(o, seen)
    elif type(obj).__module__.startswith("freetoken.models.") and hasattr(obj, "__dict__"):
        for name, v in vars(obj).items():
            if name not in ("experts", "weights", "dev", "xp"):
                yield from _linears(v, seen)


def bytes_by_type(model) -> dict[str, dict[str, int]]:
    """{"experts (host)": {format: bytes}, "dense (device)": {storage: bytes}, "embedding (host)": {type: bytes}}:
    the routed experts' banks per matrix format (biases as f32), the non-expert matrices (and their biases) by the
    storage the kernels read, the embedding table as held."""
    dec, experts = model.decoder, model.experts
    out: dict[str, dict[str, int]] = {"experts (host)": {}, "dense (device)": {}, "embedding (host)": {}}

    def add(group: str, kind: str, n: int) -> None:
        if n:
            out[group][kind] = out[group].get(kind, 0) + int(n)

    for parts in experts.parts:
        for layout, ids in zip(parts.layouts, parts.experts, strict=True):
            for spec in layout.bank_specs():
                matrix, bank = spec.name.split(".")
                add("experts (host)", "f32" if bank == "b" else layout.format_of(matrix).name, ids.size * spec.nbytes)
    emb = dec.embed
    for lin in _linears(dec, set()):
        if not (lin is dec.lm_head and dec.head_is_embedding):  # counted once, as the embedding
            add("dense (device)", lin.storage, lin.matrix_nbytes)
        if lin.bias is not None:
            add("dense (device)", "f32", int(lin.bias.nbytes))
    add("embedding (host)", emb.matrix.kind if hasattr(emb, "matrix") else str(emb.dtype), emb.nbytes)
    return {k: v for k, v in out.items() if v}


def types_line(model) -> str:
    """One line of :func:`bytes_by_type`: "weights by type: experts (host) q4_k 1.2 GiB, q6_k 310 MiB; ..."."""
    groups = bytes_by_type(model)
    return "weights by type: " + "; ".join(
        f"{group} " + ", ".join(f"{k} {gib(v)}" for k, v in sorted(kinds.items(), key=lambda kv: -kv[1]))
        for group, kinds in groups.items())
