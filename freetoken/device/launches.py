"""Kernel launches counted by name, on the gpu and emu devices alike (one dictionary increment a launch): what a
decode step costs in launches is the first figure of the host's share of a GPU step (bench/launch_overhead.py
``--step``)."""

from __future__ import annotations

from collections import Counter

#: Launches since the process started (or :func:`reset`), by kernel name.
COUNTS: Counter[str] = Counter()


def record(kernel: str) -> None:
    COUNTS[kernel] += 1


def snapshot() -> Counter[str]:
    """A copy of the counts now (subtract two snapshots for the launches in between)."""
    return Counter(COUNTS)


def reset() -> None:
    COUNTS.clear()
