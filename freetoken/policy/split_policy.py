"""The runtime's miss policy: a host-side shadow of the device expert cache plus the q* split.

The split needs, per MoE layer and decode step, which routed experts are resident. Reading the device's map is a
device-to-host synchronisation every layer; instead :class:`MissPolicy` keeps a shadow of the cache, the same
Numba LRU state machine the simulators run (:mod:`freetoken.policy.lru`), fed the same sequence of admissions,
borrows and pins as the device, so its slot owners equal ``ExpertCache.id_of_slot`` after every call (the tests
check this against the emu device). The q* split (:mod:`freetoken.policy.qstar`) runs on the shadow with a
future-value estimator (:mod:`freetoken.policy.estimators`) fed by the same events as in the trace time model.

Per decode step, for every MoE layer, the caller does::

    mask = policy.split(layer, experts, tokens, costs)    # experts: the call's unique expert ids; True: on the GPU
    cache.admit(layer, ids_of_the_gpu_share)              # the device admission ...
    policy.admitted(layer, experts[mask])                 # ... and its mirror
    cache.admit(layer + 1, predicted, count=False)        # optional prefetch ...
    policy.admitted(layer + 1, predicted, count=False)    # ... and its mirror
    ...
    policy.end_step()

and mirrors prefill (``cache.begin_prefill(); cache.prefetch_layer(l) ...`` -> :meth:`MissPolicy.begin_prefill`, or
:meth:`MissPolicy.prefill_layer` per layer) and pins (``cache.pin(layer, experts)`` -> :meth:`MissPolicy.pin`).
A ``gpu``-mode run (every miss fetched) needs no split and no shadow.

``future_value``: ``"auto"`` (per miss: the hits its residency is expected to earn from its re-use gaps against the
cache's residency time), ``"global"`` (hits per record lifetime so far), or a fixed number of seconds per fetched
expert. :data:`DEFAULT_FUTURE_VALUE` is the one the bundled model's routing traces favour: ``bench/qstar_sweep.py``
compares them through the time model, qstar / best(fetch_all, cpu_all) over 4 slot counts x 9 PCIe/CPU ratios, and
the greedy split (0) had the highest geometric mean on every run (two recorded traces at CPU 50 GB/s: 1.0279 and
1.0270, against 1.0247 / 1.0255 for auto and 1.0224 / 1.0220 for global; CPU 20 GB/s: 1.0986 against 1.0848 and
1.0731), though the lowest worst point (0.992 against 0.998 for auto and 1.000 for global). On larger synthetic
models the greedy split can lose badly to fetch_all (see :mod:`freetoken.sim.timing`); rerun the sweep on a real
trace of the model you serve and pass ``future_value`` accordingly.
"""

from __future__ import annotations

import numba as nb
import numpy as np

from freetoken.policy.estimators import (
    FV_AUTO,
    FV_FIXED,
    FV_GLOBAL,
    MAX_HITS,
    PRIOR_HITS,
    PRIOR_WEIGHT,
    future_value_kind,
    fv_auto_values,
    fv_end_call,
    fv_evicted,
    fv_first_uses,
    fv_global_value,
    fv_new,
    fv_pool,
    fv_prefetched,
)
from freetoken.policy.lru import (
    META,
    N_PINNED,
    OWNER,
    PINNED,
    SLOT_OF,
    lru_borrow,
    lru_end,
    lru_insert,
    lru_lookup,
    lru_new,
    lru_pin,
    sort_ids,
)
from freetoken.policy.qstar import StepCosts, best_q, best_q_values, marginal_hit_value, order_misses

_NONE = np.zeros(0, np.int64)

#: The runtime's default future value (decided by ``bench/qstar_sweep.py`` on the bundled model's traces: see the
#: module docstring).
DEFAULT_FUTURE_VALUE: float | str = 0.0


# The entry points take the state's arrays one by one: Numba's dispatcher types a tuple of arrays far slower than
# the arrays themselves (microseconds per call, on every MoE layer).


@nb.njit(cache=True)
def _flat_ids(experts, n, layer, num_experts, out, unique):  # pragma: no cover - compiled
    """out[:k] = layer * E + experts (sorted and deduplicated when ``unique``); k, or -1 for an id out of range."""
    for j in range(n):
        e = experts[j]
        if e < 0 or e >= num_experts:
            return -1
        out[j] = layer * num_experts + e
    if not unique:
        return n
    sort_ids(out, n)
    k = 0
    for j in range(n):
        if k == 0 or out[j] != out[k - 1]:
            out[k] = out[j]
            k += 1
    return k


@nb.njit(cache=True)
def _split(slot_of, owner, nxt, prv, rec, pinned, touched, meta, last_used, pf_mark, n_reacc, n_within, acc,
           experts, tok, n, layer, num_experts, x, c, g, hand, ctok, kind, fixed, s_hit, prior_hits, prior_weight,
           max_hits, on_gpu):  # pragma: no cover - compiled
    """on_gpu[:n]: hits, and the q* misses in fetch order; the rest go to the CPU. Returns q, or -1 for an expert
    id out of range."""
    est = (last_used, pf_mark, n_reacc, n_within, acc)
    flat = np.empty(n, np.int64)
    if _flat_ids(experts, n, layer, num_experts, flat, False) < 0:
        return -1
    miss = np.empty(n, np.int64)
    miss_id = np.empty(n, np.int64)
    miss_tok = np.empty(n, np.int64)
    miss_ru = np.empty(n, np.int64)
    h = 0
    m = 0
    for j in range(n):
        f = flat[j]
        if slot_of[f] >= 0:
            on_gpu[j] = True
            h += 1
        else:
            on_gpu[j] = False
            miss[m] = j
            miss_id[m] = f
            miss_tok[m] = tok[j] if tok.shape[0] > 0 else 1
            miss_ru[m] = last_used[f]
            m += 1
    if m == 0:
        return 0
    vals = np.zeros(m)
    if kind == FV_AUTO:
        fv_auto_values(est, miss_id, m, vals, fv_pool(est), prior_weight, max_hits, s_hit)
    perm = np.empty(m, np.int64)
    order_misses(vals, miss_tok, miss_ru, miss_id, m, perm, np.empty(m, np.int64))
    tok_ord = np.empty(m, np.int64)
    fv_ord = np.empty(m)
    for i in range(m):
        tok_ord[i] = miss_tok[perm[i]]
        fv_ord[i] = vals[perm[i]]
    if kind == FV_AUTO:
        q = best_q_values(x, c, g, hand, ctok, m, h, tok_ord, fv_ord)
    else:
        fv = fixed if kind == FV_FIXED else fv_global_value(est, prior_hits, s_hit)
        q = best_q(x, c, g, hand, ctok, m, h, tok_ord, fv)
    for i in range(q):
        on_gpu[miss[perm[i]]] = True
    return q


@nb.njit(cache=True)
def _admit(slot_of, owner, nxt, prv, rec, pinned, touched, meta, last_used, pf_mark, n_reacc, n_within, acc,
           experts, n, layer, num_experts, step, count, routed, nr, end_call):  # pragma: no cover - compiled
    """Mirror one device admission of ``experts[:n]`` of ``layer``; feed the estimator (``routed[:nr]``: the
    experts routed in the call; ``end_call`` False: a call admitted in parts, more to come, so only the hits are
    counted now). Returns how many misses were admitted; -1 for an id out of range; -2 when the slots cannot hold
    the misses (the device's error 2: the ones before are admitted, as there)."""
    st = (slot_of, owner, nxt, prv, rec, pinned, touched, meta)
    est = (last_used, pf_mark, n_reacc, n_within, acc)
    flat = np.empty(max(n, 1), np.int64)
    k = _flat_ids(experts, n, layer, num_experts, flat, True)
    if k < 0:
        return -1
    n = k
    routed_flat = flat
    nrf = n
    if count and nr > 0:
        routed_flat = np.empty(nr, np.int64)
        nrf = _flat_ids(routed, nr, layer, num_experts, routed_flat, True)
        if nrf < 0:
            return -1
    slot = np.empty(max(n, 1), np.int32)
    h = lru_lookup(st, flat, n, slot)
    hpf = fv_first_uses(est, flat, slot, n) if count else 0
    misses = np.empty(max(n, 1), np.int64)
    m = 0
    for j in range(n):
        if slot[j] < 0:
            misses[m] = flat[j]
            m += 1
    evicted = np.empty(max(m, 1), np.int32)
    k = lru_insert(st, misses, m, False, evicted)
    fv_evicted(est, evicted, k, step, True)
    if count:
        fv_end_call(est, routed_flat, nrf if end_call else 0, step, h - hpf)
    else:
        fv_prefetched(est, misses, k)
    lru_end(st)
    return k if k == m else -2


class MissPolicy:
    """A host-side shadow of the device expert cache (the Numba LRU of :mod:`freetoken.policy.lru`, fed the same
    calls) plus the q* split with a future-value estimator. Residency comes from the shadow: no device read.

    Parameters
    ----------
    num_layers, num_experts, slots : the cache's MoE layers, experts per layer and device slots
    prefill_borrow : the cache lends slots ``[0, 2E)`` to prefill (``ExpertCache(prefill_overlap=True)``)
    max_active : the cache's ``max_active`` (routed pairs per admission), for :meth:`pin`'s capacity rule
    future_value : ``"auto"``, ``"global"`` or seconds per fetched expert (default :data:`DEFAULT_FUTURE_VALUE`)
    prior_weight, prior_hits, max_hits : the estimators' priors (:mod:`freetoken.policy.estimators`)
    """

    def __init__(self, num_layers: int, num_experts: int, slots: int, *, prefill_borrow: bool = True,
                 max_active: int | None = None, future_value: float | str | None = None,
                 prior_weight: float = PRIOR_WEIGHT, prior_hits: float = PRIOR_HITS, max_hits: float = MAX_HITS):
        if num_layers < 1 or num_experts < 1 or slots < 1:
            raise ValueError(f"need layers, experts and slots >= 1, got {num_layers}, {num_experts}, {slots}")
        self.num_layers, self.num_experts, self.slots = int(num_layers), int(num_experts), int(slots)
        self.prefill_borrow = bool(prefill_borrow)
        self.max_distinct = min(int(max_active), self.num_experts) if max_active is not None else 1
        fv = DEFAULT_FUTURE_VALUE if future_value is None else future_value
        self._kind, self._fixed, self.future_value = future_value_kind(fv)
        self.priors = (float(prior_hits), float(prior_weight), float(max_hits))
        self.reset()

    @classmethod
    def for_cache(cls, cache, **kwargs) -> MissPolicy:
        """A shadow of ``cache`` (a :class:`freetoken.cache.ExpertCache`): its shape, prefill overlap and
        ``max_active``. Build it before the first admission (or after ``cache.reset()``)."""
        return cls(cache.num_layers, cache.num_experts, cache.slots, prefill_borrow=cache.prefill_overlap,
                   max_active=cache.max_active, **kwargs)

    def reset(self) -> None:
        """Mirror ``ExpertCache.reset()``: empty slots, no pins; the estimator forgets too."""
        n = self.num_layers * self.num_experts
        self._st = lru_new(n, self.slots)
        self._est = fv_new(n)
        self.step = 0
        self._pending: tuple[int, np.ndarray] | None = None  # (layer, expert ids) of the last split
        self._evicted = np.empty(max(2 * self.num_experts, 1), np.int32)

    # ---- mirrors of the device cache ---------------------------------------------------------------------
    def begin_prefill(self) -> None:
        """A prefill pass streams every layer through the cache's two buffers: mirror the borrow of the slots it
        lends (``[0, 2E)``; ``[0, E)`` for a one-layer model). The same as :meth:`prefill_layer` for every layer
        when no decode admission comes between."""
        for layer in range(min(self.num_layers, 2)):
            self.prefill_layer(layer)

    def prefill_layer(self, layer: int) -> None:
        """Mirror ``ExpertCache.prefetch_layer(layer)``: buffer ``layer % 2`` (slots ``[b E, (b + 1) E)``) is lent
        to prefill; its owners lose their slots, which become the next victims."""
        if not self.prefill_borrow:
            raise RuntimeError("this policy mirrors a cache without prefill overlap")
        self._check_layer(layer)
        e = self.num_experts
        k = lru_borrow(self._st, (layer % 2) * e, e, self._evicted)
        fv_evicted(self._est, self._evicted, k, self.step, False)
        self._pending = None

    def pin(self, layer: int, experts) -> None:
        """Mirror ``ExpertCache.pin(layer, experts)``: each expert takes the next slot from the end of the pool and
        is never evicted (same capacity rule as the cache)."""
        self._check_layer(layer)
        floor = 2 * self.num_experts if self.prefill_borrow else 0
        for e in (int(v) for v in np.atleast_1d(experts)):
            if not 0 <= e < self.num_experts:
                raise ValueError(f"expert {e} out of range ({self.num_experts} experts)")
            f = layer * self.num_experts + e
            s = int(self._st[SLOT_OF][f])
            if s >= 0 and self._st[PINNED][s]:
                continue
            pinned = int(self._st[META][N_PINNED])
            slot = self.slots - 1 - pinned
            if slot < floor or self.slots - pinned - 1 < self.max_distinct:
                raise ValueError(f"cannot pin more than {pinned} experts: {self.slots} slots must keep "
                                 f"{max(floor, self.max_distinct)} free for admission and prefill")
            old = int(lru_pin(self._st, f))
            if old >= 0:
                self._evicted[0] = old
                fv_evicted(self._est, self._evicted, 1, self.step, False)

    def admitted(self, layer: int, experts, count: bool = True, end_call: bool = True) -> None:
        """Mirror a device admission of ``experts`` of ``layer`` (``cache.admit``; duplicates are fine): a demand
        admission (``count=True``: the GPU share of a call, the hits and the fetched misses) or a prefetch
        (``count=False``). A demand admission ends the call for the estimator, whose re-use statistics count every
        expert routed in it: those passed to the :meth:`split` just before for this layer (the CPU share
        included), else ``experts``. A layer whose experts are in several formats is admitted once per part, as on
        the device: every part's admission but the last passes ``end_call=False``. Call it after every split, also
        when no expert stays on the GPU (the device admission may be skipped then: an empty call changes no recency
        order). Raises ValueError when the slots cannot hold the admission (the device would report "no slot left
        to evict")."""
        self._check_layer(layer)
        e = np.asarray(experts, np.int64).reshape(-1)
        routed = _NONE
        if count and end_call:
            if self._pending is not None and self._pending[0] == layer:
                routed = self._pending[1]
            self._pending = None
        elif not count:
            self._pending = None
        k = _admit(*self._st, *self._est, e, e.shape[0], layer, self.num_experts, self.step, count, routed,
                   routed.shape[0], end_call)
        if k == -1:
            raise ValueError(f"expert ids must be in [0, {self.num_experts})")
        if k == -2:
            raise ValueError(f"no slot left to evict: {self.slots} slots cannot admit {np.unique(e).size} experts "
                             f"of layer {layer}")

    def end_step(self) -> None:
        """A decode step finished: the estimator's clock (idle ages, re-use gaps) counts steps."""
        self.step += 1

    # ---- queries -------------------------------------------------------------------------------------------
    def resident(self, layer: int, experts) -> np.ndarray:
        """bool per expert id of ``layer``: whether the device cache holds it now."""
        self._check_layer(layer)
        e = np.asarray(experts, np.int64)
        return self._st[SLOT_OF][layer * self.num_experts + e] >= 0

    def split(self, layer: int, experts, tokens, costs: StepCosts) -> np.ndarray:
        """Which of the call's unique ``experts`` run on the GPU: bool per expert, True for every hit and for the q*
        misses to fetch (the highest future value first, then the most ``tokens``, then the most recently routed,
        then the lowest id); False: computed on the CPU. ``tokens``: tokens routed to each expert (None: one each).
        Remembers the call's experts for the :meth:`admitted` that follows."""
        self._check_layer(layer)
        e = np.asarray(experts, np.int64).reshape(-1)
        n = e.shape[0]
        tok = _NONE if tokens is None else np.asarray(tokens, np.int64).reshape(-1)
        if tokens is not None and tok.shape[0] != n:
            raise ValueError(f"tokens must have one count per expert ({n}), got {tok.shape[0]}")
        out = np.empty(n, np.bool_)
        prior_hits, prior_weight, max_hits = self.priors
        c = costs
        if _split(*self._st, *self._est, e, tok, n, layer, self.num_experts, c.transfer_s, c.cpu_s, c.gpu_s,
                  c.cpu_handoff_s, c.cpu_token_s, self._kind, self._fixed, marginal_hit_value(c), prior_hits,
                  prior_weight, max_hits, out) < 0:
            raise ValueError(f"expert ids must be in [0, {self.num_experts})")
        self._pending = (layer, e.copy())
        return out

    def future_value_now(self, costs: StepCosts) -> float:
        """The scalar future value a call would use now (``global`` or fixed; for ``auto``, the pooled estimate of
        an expert without history). For reports."""
        if self._kind == FV_FIXED:
            return self._fixed
        if self._kind == FV_GLOBAL:
            return float(fv_global_value(self._est, self.priors[0], marginal_hit_value(costs)))
        p = float(fv_pool(self._est))
        hits = self.priors[2] if p >= 1.0 else min(self.priors[2], p / (1.0 - p))
        return hits * marginal_hit_value(costs)

    @property
    def id_of_slot(self) -> np.ndarray:
        """The shadow's slot owners (flat ids, -1 empty): equal to the device's ``cache.id_of_slot``."""
        return self._st[OWNER].copy()

    def _check_layer(self, layer: int) -> None:
        if not 0 <= int(layer) < self.num_layers:
            raise IndexError(f"layer {layer} out of range ({self.num_layers} MoE layers)")
