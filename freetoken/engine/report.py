"""What a run reports about its routed experts, as numbers (``expert_counters``)."""

from __future__ import annotations


def expert_counters(model) -> dict[str, int]:
    """Counters of the routed experts since load: cache hits and misses (gpu/emu), the miss split (fetched / on
    the CPU) and next-layer prefetch (predicted, correct, actual). Absent where they do not apply."""
    dec = model.decoder
    out: dict[str, int] = {}
    if dec.cache is not None:
        cs = dec.cache.stats()
        out.update(cache_hits=cs["hits"], cache_misses=cs["misses"])
    if getattr(dec, "executor", None) is not None:
        st = dec.executor.stats
        out.update(split_hits=st["hits"], split_fetched=st["fetched"], split_cpu=st["cpu"])
    if getattr(dec, "prefetch", False):
        out.update({f"prefetch_{k}": v for k, v in dec.prefetch_stats.items()})
    return out
