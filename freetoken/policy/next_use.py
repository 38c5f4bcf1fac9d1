"""next_use: evict the resident expert expected back last, from online per-id reuse statistics, in Numba, on the
scored slot table of :mod:`freetoken.policy.scored`.

The model. An expert's accesses come in runs (a token keeps routing to it from step to step) separated by idle
gaps. Just after an access (age 0) the id continues its run at its layer's next call with probability ``P``;
otherwise, and at any age >= 1, it is idle and comes back at its **return rate** ``r`` per step. Both are learned
online per id: ``r`` from a decayed count of its returns (accesses after a gap of 2 or more steps of its layer;
continuations count ``rho``), ``P`` from its decayed fraction of continuations shrunk towards the global fraction
(``kappa`` pseudo-observations). The expected number of calls until the next use is ``d + (1 - P) * L * W`` at
age 0 and ``d + L * (W - 1)`` at age >= 1, where ``d`` (1..L) counts the calls until the id's layer comes round
(the layers run in order once per step: an id of the next layer is needed sooner than one of the layer just run)
and ``W = 1 / (r + 1 / tau)`` is the idle wait in steps, truncated at the cache's horizon ``tau`` (the expected
residency, slots / loads per step by Little's law, learned online): a long wait matters only as long as an id
would stay. An id used at its layer's latest call (age 0) is **protected**: it is a victim only when no older id is
eligible (its run may go on; evicting it is what makes a cache of about one step's accesses worse than LRU). The
victim is the unprotected resident with the largest expected wait, else the protected one with the largest.

**Long memory** (optional, on in :data:`RECOMMENDED`): a second return count ``c4``, kept exactly as ``c1`` but
with a long half-life ``Hl2``, and the rate is the mix ``r = (1 - beta) * r_short + beta * r_long``. A short
half-life tracks the drift of real routing within a prompt (recency: the return probability of the bundled model's
experts falls from 0.30 at 2 steps idle to 0.03 at 32); a long one estimates the small rates of the rarely used
experts, which decide what a large cache keeps (synthetic traces, stationary within a segment, want half-lives of
64-128 steps). The mix keeps the short count's ranking among recently used ids and the long count's among the idle
ones; the prefill prior seeds ``c4`` too, with its own keep (``long_prior_keep``: 0 forgets the previous segment's
long rates when a new prompt's prefill arrives).

**Transition predictor** (optional, off in :data:`RECOMMENDED`, on in :data:`RECOMMENDED_TRANS`, the simulator's
``default+trans`` row): the rate and the continuation probability are per-id averages; which ids a layer's next call
uses depends on which it uses now (a token's routing moves between related experts from step to step). Per layer,
decayed counts ``tn[i, e]`` of "expert i active at a call of the layer, expert e active at its next call" and
``tr[i]`` of "i active at a call followed by one" give, at each call, a noisy-or prediction ``pt[e]`` that the
layer's next call uses e, from the rows of the call's active ids. The keys mix it into the probability that an id is
used at its layer's next call: the continuation probability at age 0 and the rate's implied ``1 / w`` at age >= 1
(weight ``lambda``). Everything is learned online (the counts of a call's transitions are made at that call); the
work is O(E) per id active at the layer's previous or current call, the tables L x E x E + 2 L x E doubles.

The rules (for the device port; the call order, stamps, empty slots and borrow are those of
:mod:`~freetoken.policy.scored`; all arithmetic in doubles, in the order written, no fused multiply-add):

* state: per flat id ``last`` int64 (layer clock of its last access, 0: never), ``c1`` (decayed return count at
  that access), ``c2`` (decayed continuation count), ``c3`` (decayed re-access count), ``c4`` (the long memory's
  return count at that access); per layer ``lclock``; per
  slot ``owner``, ``stamp``, ``pinned``; globals ``gc``, ``gr`` (decayed continuations and re-accesses of all ids,
  start 0.5 and 1) and ``ld`` (average loads per call, starts at ``S / (8 L)``); the decay table ``dp`` of
  half-life ``Hl`` (:func:`~freetoken.policy.scored.decay_table`, uploaded as data; an index is clamped to its last
  entry, 0.0) and ``dp2`` of half-life ``Hl2`` (the long memory's, clamped the same way); constants ``q = 1 -
  dp[1]`` and ``q2 = 1 - dp2[1]`` (count -> rate), ``beta`` (long weight, 0: off), ``rho``, ``kappa``,
  ``gamma`` (per-id decay per re-access), ``gamma_g`` (global decay per re-access), ``omega`` (loads average weight
  per call).
* a call of layer ``c`` (L layers, S slots): ``lclock[c] += 1``, ``now = lclock[c]``; each active id ``f``, in
  increasing order, ``g = now - last[f]``: if ``last[f] > 0`` (a re-access), ``cont = (g == 1)``, ``gc = gamma_g *
  gc + cont``, ``gr = gamma_g * gr + 1``, ``c2[f] = gamma * c2[f] + cont``, ``c3[f] = gamma * c3[f] + 1`` (else
  ``cont`` = 0); then ``c1[f] = (cont ? rho : 1.0) + c1[f] * dp[min(g, K)]``, ``c4[f] = (cont ? rho : 1.0) +
  c4[f] * dp2[min(g, K2)]``; ``last[f] = now``; hits are stamped.
* values fixed for the call's victims: ``pbar = gc / gr``; ``tau = clamp(ld > 0 ? S / (L * ld) : 1e6, 1, 1e6)``;
  ``itau = 1.0 / tau``.
* the keep key of a resident ``o``, layer ``lo = o / E``, age ``a = lclock[lo] - last[o]``::

      r = q * (c1[o] * dp[min(a, K)])
      beta != 0:  r = ((1.0 - beta) * r) + (beta * (q2 * (c4[o] * dp2[min(a, K2)])))
      w = 1.0 / (r + itau)
      d = cycle ? (lo - c - 1 + L) % L + 1 : L
      a >= 1:  key = -((L * (w - 1.0)) + d)
      a == 0:  p = (c2[o] + kappa * pbar) / (c3[o] + kappa);  key = 2^40 - ((((1.0 - p) * L) * w) + d)

  (``2^40`` = :data:`~freetoken.policy.scored.PROTECT`, above every wait: ``w <= tau <= 1e6``.) Each miss, in
  increasing id order, takes the eligible slot (not stamped in this call, not pinned) with the smallest (key, slot)
  -- the largest expected wait among the unprotected ids, else among the protected ones; ties to the lowest slot;
  empty slots have key -inf. As one 64-bit argmin key: the double ``key`` (or its bits mapped to an ordered
  int64).
* ``bypass``: the miss's own key, computed the same way (age 0, so protected, and layer ``c``, so ``d = L``),
  must be strictly greater than the victim's for it to be admitted (expected back sooner); otherwise it stays a
  miss, served without loading, and evicts nothing (the victim stays the victim for the next miss). An empty
  victim always admits; so does an unprotected one: bypass acts when every eligible id is protected (a cache
  smaller than about one step's accesses).
* after the call: ``ld = (1 - omega) * ld + omega * (misses admitted by the call)``.
* ``transitions`` (optional, ``lambda != 0``; constants ``lambda`` (weight), ``g`` (decay per row update), ``a``
  (prior count); state per flat id ``tr`` and ``pt``, per flat id a row ``tn[f, 0..E-1]``, all starting at 0; with
  ``lambda = 0`` none of this exists and the keys above are exact). A call of layer ``c`` with ids ``A``, just after
  ``lclock[c] += 1`` and before the statistics update: every id ``i`` of layer ``c`` in increasing order with
  ``last[i] > 0`` and ``last[i] == now - 1`` (active at the layer's previous call, or touched by a prefill prior
  since): ``tr[i] = g * tr[i] + 1.0`` and for ``e = 0..E-1``: ``tn[i, e] = g * tn[i, e] + (c * E + e in A ? 1.0 :
  0.0)``. After the statistics update, when ``A`` is not empty, for every expert ``e`` of layer ``c``::

      y = 1.0;  for each f in A, increasing:  y = y * (1.0 - (tn[f, e] / (tr[f] + a)))
      pt[c * E + e] = 1.0 - y

  (computed before the call's victims, also in a call without misses). The keep key of a resident (and the
  bypassing miss's own key) uses ``pt[o]``::

      a >= 1:  p = ((1.0 - lambda) * (1.0 / w)) + (lambda * pt[o]);  key = -((((1.0 - p) * L) * w) + d)
      a == 0:  p = (c2[o] + kappa * pbar) / (c3[o] + kappa);  p = ((1.0 - lambda) * p) + (lambda * pt[o]);
               key = 2^40 - ((((1.0 - p) * L) * w) + d)
* ``prior`` (optional, at a segment start, after the borrow): each layer's prefill routing counts seed the return
  counts (:func:`~freetoken.policy.scored.scored_prefill`: ``c1 = keep * (c1 * dp[age]) + (weight * p) * (1.0 /
  q)`` with ``p`` the expert's share of the prefill routing times tokens x top-k, capped at 1, and ``c4 = keep2 *
  (c4 * dp2[age]) + (weight * p) * (1.0 / q2)``; ``last = now``). It learns only from the past: the prefill runs
  before the segment's decode steps.

Per access O(1) on per-id arrays and three global doubles; per call with misses one O(slots) scan (or one argmin
per miss).

Functions (those of :mod:`~freetoken.policy.scored` under this policy's names): :func:`next_use_new`,
:func:`next_use_admit` (one whole call), :func:`next_use_borrow`, :func:`next_use_prefill`, :func:`next_use_pin`,
:func:`next_use_replay_calls` (a trace's calls, for the simulator). :data:`DEFAULT_PARAMS` are the hyperparameters
tuned by ``bench/policy_eval.py`` on its tuning traces; :data:`RECOMMENDED` is the configuration recommended as the
runtime's default policy (the simulator's ``default`` row; :data:`PRIOR_ONLY`, the previous one, is its
``next_use+bypass+prior`` row; :data:`RECOMMENDED_TRANS`, with the transition predictor, its ``default+trans``
row).
"""

from __future__ import annotations

import math

from freetoken.policy.scored import (
    KIND_NEXT_USE,
    device_policy,
    scored_admit,
    scored_borrow,
    scored_new,
    scored_pin,
    scored_prefill,
    scored_replay_calls,
)

#: the hyperparameters (half-lives in steps of an id's layer); tuned by bench/policy_eval.py (coordinate search on
#: its tuning traces: real prompts, multi-turn chats, synthetic traces), see its report
DEFAULT_PARAMS = {"half_life": 16.0, "rho": 0.6, "kappa": 2.0, "id_decay": 0.9, "global_half_life": 2048.0,
                  "load_half_life": 32.0, "cycle": True}
#: the prefill prior's defaults (weight 0 and keep 1 disable it; tuned after DEFAULT_PARAMS, with bypass)
DEFAULT_PRIOR = {"prior_weight": 1.0, "prior_keep": 0.5}
#: the long memory (off by default in :func:`next_use_new`; tuned by bench/policy_eval.py on its tuning traces with
#: bypass and the prior): with it the short half-life drops to 8 steps
DEFAULT_LONG = {"half_life": 8.0, "long_weight": 0.35, "long_half_life": 64.0, "long_prior_keep": 0.0}
#: the configuration recommended as the runtime default (the simulator's ``default`` policy): bypass, the prefill
#: prior and the long memory
RECOMMENDED = {**DEFAULT_PARAMS, **DEFAULT_PRIOR, **DEFAULT_LONG, "bypass": True}
#: the previous recommendation (the simulator's ``next_use+bypass+prior`` row): no long memory
PRIOR_ONLY = {**DEFAULT_PARAMS, **DEFAULT_PRIOR, "bypass": True}
#: the transition predictor (off by default in :func:`next_use_new`; tuned with RECOMMENDED's other values fixed by a
#: small grid on bench/policy_eval.py's tuning traces: weight 0.3-1.0, decay 0.75-0.99, prior 0.5-2, noisy-or
#: against mean and max of the rows; a flat optimum)
DEFAULT_TRANS = {"trans_weight": 0.6, "trans_decay": 0.9, "trans_prior": 1.0}
#: :data:`RECOMMENDED` plus the transition predictor (the simulator's ``default+trans`` row, also timed by
#: :mod:`freetoken.sim.timing`); the device admission does not run it (an L x E x E table of counts per cache)
RECOMMENDED_TRANS = {**RECOMMENDED, **DEFAULT_TRANS}

next_use_admit = scored_admit
next_use_borrow = scored_borrow
next_use_prefill = scored_prefill
next_use_pin = scored_pin
next_use_replay_calls = scored_replay_calls


def next_use_device(num_layers: int, num_experts: int, slots: int, **params) -> dict:
    """The device admission's policy state (:func:`~freetoken.policy.scored.device_policy`) of
    :func:`next_use_new` with ``params`` (default: :data:`RECOMMENDED`, the simulator's ``default``): what
    ``ExpertCache(..., policy="default", policy_state=...)`` takes."""
    return device_policy(next_use_new(num_layers, num_experts, slots, **(params or RECOMMENDED)))


def next_use_new(num_layers: int, num_experts: int, slots: int, half_life: float = DEFAULT_PARAMS["half_life"],
                 rho: float = DEFAULT_PARAMS["rho"], kappa: float = DEFAULT_PARAMS["kappa"],
                 id_decay: float = DEFAULT_PARAMS["id_decay"],
                 global_half_life: float = DEFAULT_PARAMS["global_half_life"],
                 load_half_life: float = DEFAULT_PARAMS["load_half_life"], bypass: bool = False,
                 cycle: bool = DEFAULT_PARAMS["cycle"], prior_weight: float = 0.0, prior_keep: float = 1.0,
                 long_weight: float = 0.0, long_half_life: float = DEFAULT_LONG["long_half_life"],
                 long_prior_keep: float = 1.0, trans_weight: float = 0.0,
                 trans_decay: float = DEFAULT_TRANS["trans_decay"],
                 trans_prior: float = DEFAULT_TRANS["trans_prior"]) -> tuple:
    """A fresh next_use state: ``slots`` empty slots for ``num_layers x num_experts`` flat ids.

    ``half_life``: of the return count (steps of an id's layer); ``rho``: what a continuation adds to it (a return
    adds 1); ``kappa``: pseudo-observations of the global continuation probability in an id's estimate;
    ``id_decay``: per re-access decay of an id's continuation statistics; ``global_half_life``: of the global
    continuation fraction, in re-accesses; ``load_half_life``: of the loads average behind the horizon, in steps;
    ``bypass``: admit a miss only when it is expected back before its victim; ``cycle``: count the calls until the
    id's layer comes round (off: every id waits L calls); ``prior_weight``, ``prior_keep``: the prefill prior
    (:func:`next_use_prefill`; weight 0 and keep 1: none); ``long_weight`` (0: off), ``long_half_life``,
    ``long_prior_keep``: the long memory (its share of the rate, its half-life, what the prefill prior keeps of it);
    ``trans_weight`` (0: off), ``trans_decay``, ``trans_prior``: the transition predictor (its weight in the use
    probability of an id's next call, the decay of a count row per update, the prior count of a row)."""
    if rho < 0 or not kappa > 0 or not 0.0 <= id_decay <= 1.0:
        raise ValueError("rho must be >= 0, kappa > 0, id_decay in [0, 1]")
    if not (global_half_life > 0 and load_half_life > 0):
        raise ValueError("global_half_life and load_half_life must be > 0")
    if prior_weight < 0 or not 0.0 <= prior_keep <= 1.0:
        raise ValueError("prior_weight must be >= 0 and prior_keep in [0, 1]")
    return scored_new(KIND_NEXT_USE, num_layers, num_experts, slots, half_life, bypass=bypass, cycle=cycle, rho=rho,
                      kappa=kappa, id_decay=id_decay, global_decay=math.exp2(-1.0 / global_half_life),
                      load_weight=1.0 - math.exp2(-1.0 / (load_half_life * num_layers)),
                      prior_weight=prior_weight, prior_keep=prior_keep, long_weight=long_weight,
                      long_half_life=long_half_life, long_prior_keep=long_prior_keep, trans_weight=trans_weight,
                      trans_decay=trans_decay, trans_prior=trans_prior)
