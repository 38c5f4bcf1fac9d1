"""Hot-expert pinning (``--pin-hot N``): the N most frequently routed experts stay in slots never evicted.

Frequencies come from a recorded routing trace (``--pin-trace FILE``: every decode step and prefill count of the
trace) or from a warm-up (the routing of a prompt run through the model once). Pins are placed at the end of the
slot pool by :meth:`freetoken.cache.ExpertCache.pin`, which refuses pins that would leave admission and prefill
too few slots; :func:`pin_hot` caps N at what the cache allows and says so.
"""

from __future__ import annotations

import numpy as np


def counts_from_trace(trace) -> np.ndarray:
    """int64 [layers, experts]: how often each expert was routed in the trace (decode pairs + prefill counts)."""
    counts = np.zeros((trace.num_layers, trace.num_experts), np.int64)
    ids = np.asarray(trace.decode_ids)  # [steps, layers, tokens, k]
    for layer in range(trace.num_layers):
        v = ids[:, layer].reshape(-1)
        v = v[v >= 0]
        counts[layer] += np.bincount(v, minlength=trace.num_experts)[: trace.num_experts]
    pf = getattr(trace, "prefill_counts", None)
    if pf is not None and np.asarray(pf).size:
        counts += np.asarray(pf, np.int64).reshape(-1, trace.num_layers, trace.num_experts).sum(axis=0)
    return counts


def counts_from_routing(routing: list, num_experts: int) -> np.ndarray:
    """int64 [layers, experts] from per-MoE-layer routed ids ([T, k] arrays, as ``decoder.last_routing``)."""
    counts = np.zeros((len(routing), num_experts), np.int64)
    for layer, ids in enumerate(routing):
        counts[layer] = np.bincount(np.asarray(ids).reshape(-1), minlength=num_experts)[:num_experts]
    return counts


def hottest(counts: np.ndarray, n: int) -> list[tuple[int, int]]:
    """The ``n`` (layer, expert) pairs with the highest counts (ties: lower layer, then lower expert); never-routed
    experts are not pinned."""
    flat = counts.reshape(-1)
    order = np.lexsort((np.arange(flat.size), -flat))
    order = [int(i) for i in order[:n] if flat[i] > 0]
    return [divmod(i, counts.shape[1]) for i in order]


def pin_order(hot: list[tuple[int, int]]) -> list[tuple[int, list[int]]]:
    """The (layer, experts) pin calls for the pairs ``hot``, in the order :func:`pin_hot` makes them (a mirror of
    the cache, such as the split's shadow, takes the same pins in the same slots by making the same calls)."""
    by_layer: dict[int, list[int]] = {}
    for layer, e in hot:
        by_layer.setdefault(layer, []).append(e)
    return sorted(by_layer.items())


def max_pins(cache) -> int:
    """How many experts ``cache`` can pin (it keeps room for one admission and the prefill buffers)."""
    floor = 2 * cache.num_experts if cache.prefill_overlap else 0
    return max(0, cache.slots - max(floor, cache.max_distinct))


def pin_hot(cache, counts: np.ndarray, n: int) -> list[tuple[int, int]]:
    """Pin the ``n`` hottest experts of ``counts`` (capped at :func:`max_pins`); returns what was pinned."""
    if n < 0:
        raise ValueError(f"--pin-hot must be >= 0, got {n}")
    if counts.shape != (cache.num_layers, cache.num_experts):
        raise ValueError(f"expert counts of shape {list(counts.shape)} do not match the cache's "
                         f"{cache.num_layers} MoE layers x {cache.num_experts} experts")
    hot = hottest(counts, min(n, max_pins(cache)))
    for layer, experts in pin_order(hot):
        cache.pin(layer, experts)
    return hot
