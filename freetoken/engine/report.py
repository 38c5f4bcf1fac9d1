"""What a run reports about its routed experts, as numbers (``expert_counters``)."""

from __future__ import annotations


def expert_counters(model) -> dict[str, int]:
    """Counters of the routed experts since load: cache hits and misses (gpu/emu), the miss split (fetched / on
    the CPU) and next-layer prefetch (predicted, correct, actual). Absent where they do not apply."""
    return model.experts.counters()
