"""Future-value estimators for the q* split, in Numba: what a fetched expert is worth beyond its call.

A fetched record may hit later; a CPU-computed one never does. q* subtracts a **future value** per fetched expert
(:func:`freetoken.policy.qstar.choose_fetch`): the hits a residency is expected to earn times what a hit saves
(:func:`freetoken.policy.qstar.marginal_hit_value`, ``s_hit``). Two online estimates, from things the cache can
count (the simulator :mod:`freetoken.sim.timing` and the runtime :class:`~freetoken.policy.split_policy.MissPolicy`
feed the same state through the same functions):

* ``"auto"``, one value per miss (:func:`fv_auto_values`): the cache's residency time ``tc`` is the mean idle age
  (steps since last routed) of the records admissions evict; ``p`` = the fraction of the expert's re-uses that came
  within ``tc`` of its previous use, shrunk toward the fraction pooled over all experts (:func:`fv_pool`; 1 until
  the cache first evicts) with :data:`PRIOR_WEIGHT` pseudo re-uses; a residency then earns ``p / (1 - p)`` hits
  (capped at :data:`MAX_HITS`, :func:`~freetoken.policy.qstar.expected_hits`). Misses are fetched most valuable
  first.
* ``"global"``, one value per call (:func:`fv_global_value`): ``(reuse hits + PRIOR_HITS) / (ended lifetimes +
  1)``, hits per record lifetime so far (a lifetime ends when a record holding a slot is evicted). The first use of
  a prefetched record and the eviction of a never-used prefetch do not count.

The state (:func:`fv_new`) is a tuple of arrays over flat ids::

    last_used int64 [num_ids]   the step each id was last routed (-1: never)
    pf_mark   bool  [num_ids]   prefetched and not used yet
    n_reacc   f64   [num_ids]   re-uses of the id
    n_within  f64   [num_ids]   ... that came within the residency time
    acc       f64   [6]         pooled re-uses, pooled within, evicted ages, evictions aged, reuse hits, lifetimes

Events, in the order a call has them: :func:`fv_first_uses` over its hits (which were a prefetch's first use?),
:func:`fv_evicted` over its evictions, :func:`fv_end_call` with the call's routed ids; :func:`fv_prefetched` over
the records a prefetch admitted. Steps count decode steps.
"""

from __future__ import annotations

import numba as nb
import numpy as np

PRIOR_WEIGHT = 8.0  # auto: re-accesses of the whole cache that one expert's own history is worth
PRIOR_HITS = 8.0  # global: hits per record lifetime believed before any evidence
MAX_HITS = 64.0  # auto: cap on the expected hits of one residency
FUTURE_VALUES = ("auto", "global")  # the online estimates; a number is a fixed value in seconds
FV_FIXED, FV_AUTO, FV_GLOBAL = 0, 1, 2
FV_CODE = {"fixed": FV_FIXED, "auto": FV_AUTO, "global": FV_GLOBAL}

LAST_USED, PF_MARK, N_REACC, N_WITHIN, ACC = range(5)
G_REACC, G_WITHIN, AGE_SUM, N_AGE, TOT_HITS, TOT_LIFE = range(6)


@nb.njit(cache=True)
def fv_new(num_ids):  # pragma: no cover - compiled
    """A fresh estimator state over flat ids ``0 .. num_ids - 1``."""
    return (np.full(num_ids, -1, np.int64), np.zeros(num_ids, np.bool_), np.zeros(num_ids), np.zeros(num_ids),
            np.zeros(6))


@nb.njit(cache=True)
def fv_first_uses(est, ids, slots, n):  # pragma: no cover - compiled
    """The call's ids ``ids[:n]`` with their slots (-1: a miss): how many hits were the first use of a prefetched
    record (not reuse hits); their marks are cleared."""
    mark = est[PF_MARK]
    k = 0
    for j in range(n):
        if slots[j] >= 0 and mark[ids[j]]:
            mark[ids[j]] = False
            k += 1
    return k


@nb.njit(cache=True)
def fv_prefetched(est, ids, n):  # pragma: no cover - compiled
    """A prefetch admitted ``ids[:n]``."""
    mark = est[PF_MARK]
    for i in range(n):
        mark[ids[i]] = True


@nb.njit(cache=True)
def fv_evicted(est, ids, n, step, aged):  # pragma: no cover - compiled
    """``ids[:n]`` lost their slots at ``step`` (entries < 0: empty slots, skipped); ``aged``: evicted by an
    admission (their idle ages are residency samples), not by a prefill borrow."""
    last_used, mark, acc = est[LAST_USED], est[PF_MARK], est[ACC]
    for i in range(n):
        f = ids[i]
        if f < 0:
            continue
        if aged:
            acc[AGE_SUM] += step - last_used[f]
            acc[N_AGE] += 1.0
        if mark[f]:  # a prefetch never used: no lifetime of a fetched record ended
            mark[f] = False
        else:
            acc[TOT_LIFE] += 1.0


@nb.njit(cache=True)
def fv_end_call(est, ids, n, step, reuse_hits):  # pragma: no cover - compiled
    """The call at ``step`` routed ``ids[:n]`` and had ``reuse_hits`` hits (prefetches' first uses excluded)."""
    last_used, n_reacc, n_within, acc = est[LAST_USED], est[N_REACC], est[N_WITHIN], est[ACC]
    acc[TOT_HITS] += reuse_hits
    tc = acc[AGE_SUM] / acc[N_AGE] if acc[N_AGE] > 0.0 else np.inf
    for j in range(n):
        f = ids[j]
        if last_used[f] >= 0:
            n_reacc[f] += 1.0
            acc[G_REACC] += 1.0
            if step - last_used[f] <= tc:
                n_within[f] += 1.0
                acc[G_WITHIN] += 1.0
        last_used[f] = step


@nb.njit(cache=True)
def fv_pool(est):  # pragma: no cover - compiled
    """auto: the pooled probability of a re-use within the residency time (1 before the first eviction)."""
    acc = est[ACC]
    return 1.0 if acc[N_AGE] == 0.0 else (acc[G_WITHIN] + 1.0) / (acc[G_REACC] + 1.0)


@nb.njit(cache=True)
def fv_auto_values(est, ids, n, out, p_pool, weight, max_hits, s_hit):  # pragma: no cover - compiled
    """auto future values of ``ids[:n]`` into ``out[:n]``: p = P(re-use within the cache's residency time), the
    id's history shrunk to the pooled rate ``p_pool``; a residency earns p / (1 - p) hits (each re-use in time is a
    hit and renews it), capped at ``max_hits``, each worth ``s_hit`` seconds."""
    n_within, n_reacc = est[N_WITHIN], est[N_REACC]
    for i in range(n):
        f = ids[i]
        p = (n_within[f] + weight * p_pool) / (n_reacc[f] + weight)
        hits = max_hits if p >= 1.0 else min(max_hits, p / (1.0 - p))
        out[i] = hits * s_hit


@nb.njit(cache=True)
def fv_global_value(est, prior_hits, s_hit):  # pragma: no cover - compiled
    """global future value: reuse hits per record lifetime so far (``prior_hits`` before evidence) x ``s_hit``."""
    acc = est[ACC]
    return (acc[TOT_HITS] + prior_hits) / (acc[TOT_LIFE] + 1.0) * s_hit


def future_value_kind(future_value) -> tuple[int, float, str]:
    """(kind code ``FV_*``, fixed value, label) of a ``future_value`` argument: ``"auto"``, ``"global"`` or
    seconds >= 0 (None means ``"auto"``)."""
    if future_value is None:
        future_value = "auto"
    if isinstance(future_value, str):
        if future_value not in FUTURE_VALUES:
            raise ValueError(f"future_value must be a number of seconds or one of {', '.join(FUTURE_VALUES)}, "
                             f"got {future_value!r}")
        return FV_CODE[future_value], 0.0, future_value
    v = float(future_value)
    if not (v >= 0.0 and v != float("inf")):
        raise ValueError(f"future_value must be a finite number >= 0 (seconds) or 'auto' / 'global', got {v}")
    return FV_FIXED, v, f"{v:g} s"
