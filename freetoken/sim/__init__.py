"""Simulators over routing traces, built on :mod:`freetoken.policy` (which is built on :mod:`freetoken.trace`).

* :mod:`~freetoken.sim.policies`: cache policies replayed on a trace: lru (the device policy,
  :mod:`freetoken.policy.lru`), static_frequency, prefill_placement, routing_blind, belady (the lower bound).
* :mod:`~freetoken.sim.simulate`: :func:`simulate` and :func:`format_table`; trace summaries.
* :mod:`~freetoken.sim.timing`: the decode-step time model (fetch_all, cpu_all, q*, q* + prefetch) and its sweep
  over PCIe/CPU bandwidth ratios; its kernel :mod:`~freetoken.sim.timing_kernel`, its tables
  :mod:`~freetoken.sim.report`.
* :mod:`~freetoken.sim.predict`: next-layer expert predictors on traces and their precision / recall.
* :mod:`~freetoken.sim.plot`, :mod:`~freetoken.sim.table`: figures and plain-text tables.
* the ``freetoken trace simulate | synth | info`` command is :mod:`freetoken.cli.trace`.
"""

from freetoken.sim.policies import DEFAULT_POLICIES, POLICIES, PolicyResult
from freetoken.sim.simulate import format_table, simulate

__all__ = ["DEFAULT_POLICIES", "POLICIES", "PolicyResult", "format_table", "simulate"]
