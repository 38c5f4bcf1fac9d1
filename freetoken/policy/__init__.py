"""The q* policy: what to do with expert-cache misses, measured rather than assumed.

* :mod:`~freetoken.policy.qstar`: the per-call cost model (:class:`StepCosts`), :func:`choose_fetch` (how many
  misses to fetch over PCIe; the rest run on the CPU), :func:`which_to_fetch` (which ones), the future-value term.
* :mod:`~freetoken.policy.oracle`: rolling PCIe / CPU-executor bandwidth estimates with change detection.
* :mod:`~freetoken.policy.profile`: ``freetoken bench bw`` profiles per (GPU, CPU, format) and ``auto``'s choice.
* :mod:`~freetoken.policy.hybrid`: the per-call miss split (which misses go to the CPU); the expert runner
  (:mod:`freetoken.engine.experts`) executes it.
* :mod:`~freetoken.policy.pinning`: hot-expert pinning (``--pin-hot``).
* :mod:`~freetoken.policy.predict`: next-layer expert predictors on traces and their precision / recall.

The trace time model that runs the split over a routing trace is :mod:`freetoken.trace.timing`.
"""

from freetoken.policy.qstar import (
    SplitTime,
    StepCosts,
    auto_future_value,
    choose_fetch,
    expected_hits,
    fetch_order,
    marginal_hit_value,
    objective,
    split,
    split_time,
    which_to_fetch,
)

__all__ = ["SplitTime", "StepCosts", "auto_future_value", "choose_fetch", "expected_hits", "fetch_order",
           "marginal_hit_value", "objective", "split", "split_time", "which_to_fetch"]
