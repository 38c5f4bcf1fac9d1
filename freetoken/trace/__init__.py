"""Routing traces: the bottom layer under the miss policy and the simulators.

* :mod:`~freetoken.trace.format`: the trace file (.npz), :class:`Trace`, :class:`TraceRecorder`.
* :mod:`~freetoken.trace.synthetic`: :func:`make_trace`, synthetic traces with tunable locality.
* :mod:`~freetoken.trace.derived`: the arrays every policy and simulator derives from a trace (:func:`prepare`:
  each call's active set, the access sequence; token counts; windows), cached on the trace.

The cache-policy replay, the decode-step time model, the trace predictors and the ``freetoken trace`` command are
in :mod:`freetoken.sim` (above :mod:`freetoken.policy`, which is above this package).
"""

from freetoken.trace.derived import WINDOWS, Prepared, active_sets, prepare, token_counts, window_steps
from freetoken.trace.format import Trace, TraceError, TraceRecorder, load_trace, save_trace
from freetoken.trace.synthetic import make_trace

__all__ = ["WINDOWS", "Prepared", "Trace", "TraceError", "TraceRecorder", "active_sets", "load_trace", "make_trace",
           "prepare", "save_trace", "token_counts", "window_steps"]
