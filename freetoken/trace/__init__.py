"""Routing traces and the expert-cache policy simulator.

* :mod:`~freetoken.trace.format`: the trace file (.npz), :class:`Trace`, :class:`TraceRecorder`.
* :mod:`~freetoken.trace.synthetic`: :func:`make_trace`, synthetic traces with tunable locality.
* :mod:`~freetoken.trace.policies`: lru (the device policy), static_frequency, prefill_placement, routing_blind,
  belady (the lower bound).
* :mod:`~freetoken.trace.simulate`: :func:`simulate` and :func:`format_table`; :mod:`~freetoken.trace.plot`.
* :mod:`~freetoken.trace.timing`: the decode-step time model (fetch_all, cpu_all, q*, q* + prefetch) and its sweep
  over PCIe/CPU bandwidth ratios (import it from there: it uses :mod:`freetoken.policy`, which imports this package).
* :mod:`~freetoken.trace.cli`: ``freetoken trace simulate | synth | info``.
"""

from freetoken.trace.format import Trace, TraceError, TraceRecorder, load_trace, save_trace
from freetoken.trace.policies import DEFAULT_POLICIES, POLICIES, PolicyResult
from freetoken.trace.simulate import format_table, simulate
from freetoken.trace.synthetic import make_trace

__all__ = ["DEFAULT_POLICIES", "POLICIES", "PolicyResult", "Trace", "TraceError", "TraceRecorder", "format_table",
           "load_trace", "make_trace", "save_trace", "simulate"]
