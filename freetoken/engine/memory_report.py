"""What a loaded model holds in memory, for the last line of ``freetoken run`` and ``chat``: weights, expert slots,
the KV pool and the process's peak host memory (``resource.getrusage``: the peak resident set size)."""

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
    return out


def memory_line(model) -> str:
    """One line: weights (dense, embedding and expert banks), expert slots, KV pool (kind, tokens used of the
    context), peak host RSS."""
    parts = memory_breakdown(model)
    slots = parts.get("expert slots", 0)
    weights = sum(v for k, v in parts.items() if k not in ("expert slots", "KV pool"))
    dec = model.decoder
    kind = dec.pool.kind if dec.pool is not None else "-"
    return (f"memory: weights {gib(weights)}, expert slots {gib(slots)}, KV pool {gib(parts['KV pool'])} ({kind}, "
            f"{dec.length}/{dec.ctx} tokens), peak host RSS {gib(peak_rss_bytes())}")


def breakdown_line(model) -> str:
    """``--verbose``: every part of :func:`memory_breakdown`."""
    return "memory breakdown: " + ", ".join(f"{k} {gib(v)}" for k, v in memory_breakdown(model).items())
