"""The q* policy: what to do with expert-cache misses, measured rather than assumed.

The policy core, shared by the runtime and the simulators (:mod:`freetoken.sim`), each written once in Numba:

* :mod:`~freetoken.policy.lru`: the device cache's LRU state machine (admission, prefill borrow, pinning).
* :mod:`~freetoken.policy.lfu_decay`, :mod:`~freetoken.policy.next_use`: online candidates to replace it (LFU with
  exponential decay; expected time to next use, with bypass), on the scored slot table of
  :mod:`~freetoken.policy.scored` (one keep key per slot, the victim its argmin); simulator-only so far.
* :mod:`~freetoken.policy.qstar`: the per-call cost model (:class:`StepCosts`), :func:`choose_fetch` (how many
  misses to fetch over PCIe; the rest run on the CPU), :func:`fetch_order` / :func:`which_to_fetch` (which ones).
* :mod:`~freetoken.policy.estimators`: the future-value estimators (``auto``, ``global``).
* :mod:`~freetoken.policy.split_policy`: :class:`MissPolicy`, the runtime's host-side shadow of the device cache
  with the q* split (no device read per layer).

Around it: :mod:`~freetoken.policy.oracle` (rolling PCIe / CPU-executor bandwidth estimates with change detection),
:mod:`~freetoken.policy.profile` (``freetoken bench bw`` profiles per (GPU, CPU, format) and ``auto``'s choice),
:mod:`~freetoken.policy.measure`, :mod:`~freetoken.policy.pinning` (hot-expert pinning, ``--pin-hot``),
:mod:`~freetoken.policy.hybrid` (the per-call miss split; the expert runner of :mod:`freetoken.engine.experts`
executes it), :mod:`~freetoken.policy.runtime` (``--moe-mode auto`` and the oracle's priors).

Layering: this package imports :mod:`freetoken.trace` (the trace format), never :mod:`freetoken.sim`.
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
from freetoken.policy.split_policy import DEFAULT_FUTURE_VALUE, MissPolicy

__all__ = ["DEFAULT_FUTURE_VALUE", "MissPolicy", "SplitTime", "StepCosts", "auto_future_value", "choose_fetch",
           "expected_hits", "fetch_order", "marginal_hit_value", "objective", "split", "split_time", "which_to_fetch"]
