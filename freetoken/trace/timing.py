"""Decode-step time model: replay a routing trace through the expert cache and the q* split, per mode.

Modes (:data:`MODES`):

* ``fetch_all``: every miss is copied over PCIe into a slot (and cached); the device LRU decides the victims.
* ``cpu_all``: every miss is computed on the CPU from the host copy and nothing is ever admitted, so the cache
  stays empty: every routed expert runs on the CPU (the "experts on the CPU" baseline).
* ``qstar``: per call, :func:`freetoken.policy.qstar.choose_fetch` picks how many misses to fetch and
  :func:`~freetoken.policy.qstar.fetch_order` which (the highest future value first, then the most tokens, then the
  most recently routed, then the lowest id); fetched experts are admitted (LRU), CPU-computed ones are not.
* ``qstar_prefetch``: ``qstar`` plus prefetching: while layer l computes, the experts predicted for the next call
  (:mod:`freetoken.policy.predict`) are copied on the otherwise idle transfer stream and admitted.
* ``fetch_all_prefetch`` (not in the default set): ``fetch_all`` plus the same prefetching.

Per call (decode step t, MoE layer l) with h hits and m misses, q of them fetched (costs from
:class:`~freetoken.policy.qstar.StepCosts`: x per copy, g per GPU expert, c per CPU expert, H handoff)::

    call time   = layer_s + critical(q),  critical = max(q x + (h + q) g,  [q < m] (H + (m - q) c + ...))
    gpu         = layer_s + (h + q) g       (busy GPU: non-expert work + the routed-expert kernel)
    stall       = critical - (h + q) g       (the GPU waiting for copies or for the CPU's partials)
    transfer    = q x;  cpu = the CPU path
    step time   = sum over layers of the call times + step_s = gpu + stall

``layer_s`` is the non-expert GPU time per layer (attention, router, shared expert, norms) and ``step_s`` the per
step rest (embedding, LM head, sampling); both default to 0, which isolates the expert phase.

Prefetch: the transfer stream is idle from the end of call l's demand copies (``q x`` after its routing) until the
next call's routing (``critical + layer_s`` after it), so ``floor((critical + layer_s - q x) / x)`` prefetched
copies fit without delaying any demand copy. For the next call's predicted set (``h'`` of them resident, ``m'``
not), the prefetch copies what the split would fetch if the prediction were right: the first ``choose_fetch(m',
h')`` of the non-resident ones in the demand fetch order (the highest future value, then the most recently
routed, then prediction rank; in ``fetch_all_prefetch`` all of them, in prediction rank), as many as fit.
It is an admit call on the predicted set: the resident predicted ones are refreshed, the copies go, in increasing
id order, into LRU victims the current call is not using. A correct prediction turns a miss into a hit; a wrong one
spends idle bandwidth and evicts a slot. No prefetch crosses a segment start (prefill runs there, borrowing slots).
With ``layer_s = 0`` and a balanced split there is little idle PCIe time, so little is prefetched.

The cache is the device LRU of :func:`freetoken.trace.policies.lru` (same recency, tie and prefill-borrow rules):
``fetch_all`` reproduces its misses exactly. Cache states differ between modes: fetch_all admits every miss,
qstar only what it fetches, cpu_all nothing.

The future value, and why q* is (and is not by construction) at or below both extremes:

* Per call, on the same cache state and with ``future_value = 0``, ``critical(q*) <= min(critical(0),
  critical(m))``: the scan includes both extremes. :func:`split_vs_extremes_same_state` returns these per call;
  this is the by-construction check in the tests.
* Over a trace the cache states diverge, and the greedy split (``future_value = 0``) can lose badly to fetch_all:
  fetch_all caches every miss, so with locality it earns later hits, while the greedy split sends the marginal
  misses to the CPU call after call (an expert routed every step and computed on the CPU every step never becomes
  a hit; on synthetic traces that costs up to 10x). The ``future_value`` term prices this: a fetched expert is worth
  the hits it earns before eviction times what a hit saves (:func:`~freetoken.policy.qstar.marginal_hit_value`,
  ``x c / (x + g + c)``). Two online estimates, both things the device could count:

  - ``"auto"`` (the default), per miss: the cache's residency time ``tc`` is the mean idle age (steps since last
    routed) of the records admissions evict; ``p`` = the fraction of the expert's re-uses that came within ``tc``
    of its previous use, shrunk toward the fraction pooled over all experts (taken as 1 until the cache first
    evicts) with :data:`PRIOR_WEIGHT` (8) pseudo re-uses; a residency then earns ``p / (1 - p)`` hits (capped
    at :data:`MAX_HITS`, :func:`~freetoken.policy.qstar.expected_hits`). Misses are fetched most valuable first.
  - ``"global"``, one value per call: ``(reuse hits + PRIOR_HITS) / (ended lifetimes + 1)``, hits per record
    lifetime so far (a lifetime ends when a record holding a slot is evicted; :data:`PRIOR_HITS` = 8 before
    evidence). The first use of a prefetched record and the eviction of a never-used prefetch do not count.

* Measured on synthetic traces (localities 0 to 1, top-2 to top-8, 16 to 128 experts, batches of 1 to 4,
  records of 256 KiB to 32 MiB, 8 slots to the whole model, layer_s 0 and 100 us, cpu_token_s 0 and 20 us, PCIe/CPU
  0.25x to 4x; ~10,000 points), qstar / min(fetch_all, cpu_all) averaged 0.89 with ``"auto"`` and 0.90 with
  ``"global"``; it went above 1 at 40 points with ``"auto"`` (at most +1.3%, mostly 8-slot caches) and at 2 with
  ``"global"`` (+0.8%, an 8-slot cache). ``"global"`` is a mean over lifetimes that hot experts dominate, so it
  overvalues the colder experts that miss and can degenerate to fetch_all where splitting pays: 13.7 tok/s
  (= fetch_all) against 20.1 for ``"auto"`` and 22.8 for the best fixed value on a 94-layer, 128-expert, top-8
  trace with 2,000 slots at PCIe 25 / CPU 50 GB/s. Hence ``"auto"`` is the default. The small losses are the
  principled limit: the value of a fetch depends on future routing, which an online policy can only estimate, and
  LRU contents are not monotone in what is admitted. So the guarantee the tests hold to +1e-12 is the per-call one
  on identical cache state; over traces they check ``"global"`` exactly and ``"auto"`` within 0.5% on a few
  synthetic traces, and the CLI prints qstar / best per ratio so that real traces can be checked.
* Prefetch with a perfect (oracle) predictor, one token per step, is never worse than no prefetch in
  ``fetch_all_prefetch`` by construction when slots >= 2 x the largest active set: the oracle ranks a call's misses
  by id, so the prefetch takes the same victims in the same slots as the demand admission would, the LRU state
  stays that of ``fetch_all``, and prefetched misses are hits. In ``qstar_prefetch`` the call re-decides the split
  over the misses left, so it holds per call but is measured over the trace (the tests check it).

:func:`time_modes` runs the modes at one bandwidth point, :func:`sweep` over PCIe/CPU ratios (PCIe varies, the
CPU bandwidth stays), :func:`format_timing` / :func:`format_sweep` print them.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numba as nb
import numpy as np

from freetoken.policy.predict import PREDICTORS, PredictorScore, _active_sets, precision_recall, predictions
from freetoken.policy.qstar import (
    DEFAULT_COPY_LATENCY_S,
    DEFAULT_CPU_HANDOFF_S,
    DEFAULT_GPU_GBPS,
    StepCosts,
    _best_q,
    _best_q_values,
    _critical,
    marginal_hit_value,
)
from freetoken.trace.format import Trace
from freetoken.trace.lru_list import append_sorted, push_least_recent, sort_ids, unlink
from freetoken.trace.policies import WINDOWS, _check_slots, prepare, window_steps
from freetoken.trace.table import text_table

MODES = ("fetch_all", "cpu_all", "qstar", "qstar_prefetch")
ALL_MODES = (*MODES, "fetch_all_prefetch")
_MODE_CODE = {"fetch_all": 0, "cpu_all": 1, "qstar": 2, "qstar_prefetch": 2, "fetch_all_prefetch": 0}
FUTURE_VALUES = ("auto", "global")  # the online estimates; a number is a fixed value in seconds
_FV_CODE = {"fixed": 0, "auto": 1, "global": 2}
PRIOR_WEIGHT = 8.0  # auto: re-accesses of the whole cache that one expert's own history is worth
PRIOR_HITS = 8.0  # global: hits per record lifetime believed before any evidence
MAX_HITS = 64.0  # auto: cap on the expected hits of one residency
SWEEP_RATIOS = tuple(float(2.0 ** (e / 2)) for e in range(-4, 5))  # 0.25x .. 4x, geometric, 9 points

# per-step accumulators of the kernel, in this order
_FIELDS = ("time", "transfer", "prefetch", "cpu", "gpu", "stall", "hits", "misses", "fetched", "prefetched",
           "prefetch_used")


# ---------------------------------------------------------------------------------------------------- kernel


@nb.njit(cache=True)
def _sort_desc(key, ids, a, b, n):  # pragma: no cover - compiled
    """Stable insertion sort of ``key[:n]`` descending, permuting ``ids``, ``a`` and ``b`` alike."""
    for i in range(1, n):
        k, f, va, vb = key[i], ids[i], a[i], b[i]
        j = i - 1
        while j >= 0 and key[j] < k:
            key[j + 1] = key[j]
            ids[j + 1] = ids[j]
            a[j + 1] = a[j]
            b[j + 1] = b[j]
            j -= 1
        key[j + 1] = k
        ids[j + 1] = f
        a[j + 1] = va
        b[j + 1] = vb


@nb.njit(cache=True)
def _reuse_values(ids, n, out, n_within, n_reacc, p_pool, weight, max_hits, s_hit):  # pragma: no cover
    """auto future values: p = P(re-access within the cache's residency time), expert history shrunk to the
    pooled rate; a residency earns p / (1 - p) hits (each re-access in time is a hit and renews it)."""
    for i in range(n):
        f = ids[i]
        p = (n_within[f] + weight * p_pool) / (n_reacc[f] + weight)
        hits = max_hits if p >= 1.0 else min(max_hits, p / (1.0 - p))
        out[i] = hits * s_hit


@nb.njit(cache=True)
def _timing_kernel(active, counts, tokcnt, seg_start, slots, num_flat, num_experts, borrow_n, mode, x, c, g, hand,
                   ctok, layer_s, step_s, fv_kind, fv_fixed, s_hit, prior_hits, prior_weight, max_hits, pred,
                   use_pf, qdiag):  # pragma: no cover - compiled
    steps, layers, width = active.shape
    out = np.zeros((11, steps))
    slot_of = np.full(num_flat, -1, np.int32)
    owner = np.full(max(slots, 1), -1, np.int32)
    last_used = np.full(num_flat, -1, np.int64)  # the step each id was last routed
    pf_mark = np.zeros(num_flat, np.bool_)  # prefetched and not used yet
    busy = np.zeros(slots + 1, np.bool_)
    head = slots
    nxt = np.empty(slots + 1, np.int32)
    prv = np.empty(slots + 1, np.int32)
    for s in range(slots + 1):
        nxt[s] = s + 1 if s < slots else 0
        prv[s] = s - 1 if s > 0 else slots
    npred = pred.shape[2]
    cap = max(width, npred, 1)
    touched = np.empty(cap, np.int32)
    ptouched = np.empty(cap, np.int32)
    miss_id = np.empty(cap, np.int32)
    miss_tok = np.empty(cap, np.int64)
    miss_ru = np.empty(cap, np.int64)
    tok_ord = np.empty(cap, np.int64)
    fvals = np.empty(cap, np.float64)
    fetch = np.empty(cap, np.int32)
    # auto: re-accesses per id and pooled, and how many came within the residency time tc
    n_reacc = np.zeros(num_flat)
    n_within = np.zeros(num_flat)
    g_reacc = 0.0
    g_within = 0.0
    age_sum = 0.0  # idle age (steps) of records evicted by admissions: tc is its mean
    n_age = 0.0
    # global: reuse hits and ended lifetimes of admitted records
    tot_hits = 0.0
    tot_life = 0.0
    for t in range(steps):
        if seg_start[t]:
            for s in range(borrow_n):  # prefill borrows slots [0, 2E): owners evicted, least recent
                o = owner[s]
                if o >= 0:
                    slot_of[o] = -1
                    owner[s] = -1
                    if pf_mark[o]:
                        pf_mark[o] = False
                    else:
                        tot_life += 1.0
                unlink(nxt, prv, s)
            for s in range(borrow_n - 1, -1, -1):
                push_least_recent(nxt, prv, head, s)
        step_time = step_s
        step_gpu = step_s
        for layer in range(layers):
            cnt = counts[t, layer]
            nt = 0
            h = 0
            hpf = 0
            m = 0
            for j in range(cnt):  # hits first: they leave the victim list
                f = active[t, layer, j]
                s = slot_of[f]
                if s >= 0:
                    unlink(nxt, prv, s)
                    touched[nt] = s
                    nt += 1
                    h += 1
                    if pf_mark[f]:  # the first use of a prefetched record: what the prefetch bought, not reuse
                        pf_mark[f] = False
                        out[10, t] += 1
                        hpf += 1
                else:
                    miss_id[m] = f
                    miss_tok[m] = tokcnt[t, layer, j]
                    miss_ru[m] = last_used[f]
                    m += 1
            # fetch order: most tokens, then most recently routed, then lowest id (misses arrive in id order)
            for i in range(1, m):
                fi, ti, ri = miss_id[i], miss_tok[i], miss_ru[i]
                b = i - 1
                while b >= 0 and (miss_tok[b] < ti or (miss_tok[b] == ti and miss_ru[b] < ri)):
                    miss_id[b + 1] = miss_id[b]
                    miss_tok[b + 1] = miss_tok[b]
                    miss_ru[b + 1] = miss_ru[b]
                    b -= 1
                miss_id[b + 1] = fi
                miss_tok[b + 1] = ti
                miss_ru[b + 1] = ri
            p_pool = 1.0 if n_age == 0.0 else (g_within + 1.0) / (g_reacc + 1.0)
            if mode == 0:
                q = m
            elif mode == 1:
                q = 0
            elif fv_kind == 1:  # per-miss values; the most valuable first (stable: ties keep the order above)
                _reuse_values(miss_id, m, fvals, n_within, n_reacc, p_pool, prior_weight, max_hits, s_hit)
                _sort_desc(fvals, miss_id, miss_tok, miss_ru, m)
                for i in range(m):
                    tok_ord[i] = miss_tok[i]
                q = _best_q_values(x, c, g, hand, ctok, m, h, tok_ord, fvals)
            else:
                fv = fv_fixed if fv_kind == 0 else (tot_hits + prior_hits) / (tot_life + 1.0) * s_hit
                for i in range(m):
                    tok_ord[i] = miss_tok[i]
                q = _best_q(x, c, g, hand, ctok, m, h, tok_ord, fv)
            rest = 0
            for i in range(q, m):
                rest += miss_tok[i]
            if qdiag.shape[0] > 0:  # per-call diagnostics: critical of q*, 0, m on this same cache state
                qdiag[t, layer, 0] = _critical(x, c, g, hand, ctok, m, h, q, rest)
                r0 = 0
                for i in range(m):
                    r0 += miss_tok[i]
                qdiag[t, layer, 1] = _critical(x, c, g, hand, ctok, m, h, 0, r0)
                qdiag[t, layer, 2] = _critical(x, c, g, hand, ctok, m, h, m, 0)
            for i in range(q):
                fetch[i] = miss_id[i]
            sort_ids(fetch, q)
            for i in range(q):  # admit the fetched misses in increasing id order into LRU victims
                f = fetch[i]
                s = nxt[head]
                unlink(nxt, prv, s)
                o = owner[s]
                if o >= 0:
                    slot_of[o] = -1
                    age_sum += t - last_used[o]
                    n_age += 1.0
                    if pf_mark[o]:  # a prefetch never used: no lifetime of a fetched record ended
                        pf_mark[o] = False
                    else:
                        tot_life += 1.0
                owner[s] = f
                slot_of[f] = s
                touched[nt] = s
                nt += 1
            crit = _critical(x, c, g, hand, ctok, m, h, q, rest)
            gcomp = (h + q) * g
            cpu = 0.0
            if q < m:
                cpu = hand + (m - q) * c + ctok * rest
            step_time += layer_s + crit
            step_gpu += layer_s + gcomp
            out[1, t] += q * x
            out[3, t] += cpu
            out[5, t] += crit - gcomp
            out[6, t] += h
            out[7, t] += m
            out[8, t] += q
            tot_hits += h - hpf
            tc = age_sum / n_age if n_age > 0.0 else np.inf
            for j in range(cnt):
                f = active[t, layer, j]
                if last_used[f] >= 0:
                    n_reacc[f] += 1.0
                    g_reacc += 1.0
                    if t - last_used[f] <= tc:
                        n_within[f] += 1.0
                        g_within += 1.0
                last_used[f] = t
            append_sorted(nxt, prv, head, touched, nt)
            if not use_pf:
                continue
            # prefetch the next call's predicted experts on the idle transfer stream
            tn, ln = t, layer + 1
            window = crit + layer_s - q * x
            if ln == layers:
                tn, ln = t + 1, 0
                window += step_s
                if tn >= steps or seg_start[tn]:
                    continue
            budget = int(np.floor(window / x + 1e-9)) if x > 0.0 else npred
            if budget <= 0:
                continue
            # the predicted set: resident ones (hits if the prediction is right) and the candidates to copy
            hp = 0
            nc = 0
            for r in range(npred):
                e = pred[tn, ln, r]
                if e < 0:
                    continue
                f = ln * num_experts + e
                s = slot_of[f]
                if s >= 0:
                    already = False
                    for a in range(hp):
                        if ptouched[a] == s:
                            already = True
                    if not already:
                        ptouched[hp] = s
                        hp += 1
                else:
                    dup = False
                    for a in range(nc):
                        if fetch[a] == f:
                            dup = True
                    if not dup:  # qstar: most recently routed first (as the demand order), then prediction rank
                        ru = last_used[f] if mode != 0 else 0
                        b = nc - 1
                        while b >= 0 and miss_ru[b] < ru:
                            fetch[b + 1] = fetch[b]
                            miss_ru[b + 1] = miss_ru[b]
                            b -= 1
                        fetch[b + 1] = f
                        miss_ru[b + 1] = ru
                        nc += 1
            # copy what the split would fetch for the predicted call, as far as the window allows
            if mode == 0:
                qp = nc
            else:
                for i in range(nc):
                    tok_ord[i] = 1
                if fv_kind == 1:
                    _reuse_values(fetch, nc, fvals, n_within, n_reacc, p_pool, prior_weight, max_hits, s_hit)
                    _sort_desc(fvals, fetch, miss_ru, tok_ord, nc)
                    qp = _best_q_values(x, c, g, hand, ctok, nc, hp, tok_ord, fvals)
                else:
                    fv = fv_fixed if fv_kind == 0 else (tot_hits + prior_hits) / (tot_life + 1.0) * s_hit
                    qp = _best_q(x, c, g, hand, ctok, nc, hp, tok_ord, fv)
            nc = min(qp, budget)
            if nc <= 0:
                continue
            for a in range(hp):  # an admit call on the predicted set: resident ones are refreshed
                unlink(nxt, prv, ptouched[a])
            npt = hp
            for a in range(nt):
                busy[touched[a]] = True
            sort_ids(fetch, nc)
            nadm = 0
            for i in range(nc):
                f = fetch[i]
                s = nxt[head]
                while s != head and busy[s]:  # never the slots the current call is computing from
                    s = nxt[s]
                if s == head:
                    break
                unlink(nxt, prv, s)
                o = owner[s]
                if o >= 0:
                    slot_of[o] = -1
                    age_sum += t - last_used[o]
                    n_age += 1.0
                    if pf_mark[o]:
                        pf_mark[o] = False
                    else:
                        tot_life += 1.0
                owner[s] = f
                slot_of[f] = s
                pf_mark[f] = True
                ptouched[npt] = s
                npt += 1
                nadm += 1
            append_sorted(nxt, prv, head, ptouched, npt)
            for a in range(nt):
                busy[touched[a]] = False
            out[2, t] += nadm * x
            out[9, t] += nadm
        out[0, t] = step_time
        out[4, t] = step_gpu
    return out


# ------------------------------------------------------------------------------------------------ public API


@dataclass
class ModeTiming:
    """One mode's time model over a window of decode steps; seconds are means per decode step."""

    mode: str
    slots: int
    window: str
    steps: int  # decode steps scored
    tokens_per_step: int  # the decode batch
    pcie_gbps: float
    cpu_gbps: float
    gpu_gbps: float
    step_s: float
    transfer_s: float  # demand copies (the transfer stream's busy time on the critical path's side)
    prefetch_s: float  # prefetch copies (in idle transfer-stream time)
    cpu_s: float  # the CPU path, handoff included
    gpu_s: float  # GPU busy: non-expert time + routed-expert kernels
    stall_s: float  # the GPU waiting for copies or for CPU partials; step_s = gpu_s + stall_s
    accesses: int
    hits: int
    misses: int
    fetched: int
    prefetched: int
    prefetch_used: int  # prefetched experts that were hit before being evicted
    future_value: str  # "auto", "global" or the fixed value ("1e-04 s"); "" for modes without a split
    predictor: str = ""
    prediction: PredictorScore | None = None
    per_step: np.ndarray = field(default_factory=lambda: np.zeros(0), repr=False)  # seconds, every trace step

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_step / self.step_s if self.step_s > 0 else float("inf")

    @property
    def hit_rate(self) -> float:
        return self.hits / self.accesses if self.accesses else 0.0

    @property
    def cpu_experts(self) -> int:
        return self.misses - self.fetched

    def as_row(self) -> dict:
        row = {k: getattr(self, k) for k in ("mode", "slots", "window", "steps", "tokens_per_step", "pcie_gbps",
                                             "cpu_gbps", "gpu_gbps", "tokens_per_s", "step_s", "transfer_s",
                                             "prefetch_s", "cpu_s", "gpu_s", "stall_s", "accesses", "hits",
                                             "misses", "fetched", "cpu_experts", "prefetched", "prefetch_used",
                                             "hit_rate", "future_value", "predictor")}
        if self.prediction is not None:
            row["precision"] = self.prediction.precision
            row["recall"] = self.prediction.recall
        return row


def _token_counts(trace: Trace) -> np.ndarray:
    """int32 [steps, L, A]: tokens routed to each id of ``prepare(trace).active`` (0 on the padding)."""
    cached = trace._derived.get("active_tokens")
    if cached is not None:
        return cached
    p = prepare(trace)
    if trace.tokens == 1:
        tok = (p.active >= 0).astype(np.int32)
    else:
        _, per_expert = _active_sets(trace)
        offs = (np.arange(trace.num_layers, dtype=np.int64) * trace.num_experts)[None, :, None]
        e = np.where(p.active >= 0, p.active - offs, 0)
        tok = np.where(p.active >= 0, np.take_along_axis(per_expert, e, -1), 0).astype(np.int32)
    trace._derived["active_tokens"] = tok
    return tok


def _check_mode(mode: str) -> None:
    if mode not in _MODE_CODE:
        raise ValueError(f"unknown mode {mode!r} (known: {', '.join(ALL_MODES)})")


def _prefetch_n(trace: Trace, prefetch_n: int | None) -> int:
    return int(prefetch_n) if prefetch_n is not None else min(trace.num_experts, trace.top_k * trace.tokens)


def _future_value_kind(future_value) -> tuple[int, float, str]:
    """(kernel code, fixed value, label) of a ``future_value`` argument."""
    if future_value is None:
        future_value = "auto"
    if isinstance(future_value, str):
        if future_value not in FUTURE_VALUES:
            raise ValueError(f"future_value must be a number of seconds or one of {', '.join(FUTURE_VALUES)}, "
                             f"got {future_value!r}")
        return _FV_CODE[future_value], 0.0, future_value
    v = float(future_value)
    if not (v >= 0.0 and v != float("inf")):
        raise ValueError(f"future_value must be a finite number >= 0 (seconds) or 'auto' / 'global', got {v}")
    return 0, v, f"{v:g} s"


def _run(trace: Trace, mode: str, slots: int, costs: StepCosts, *, future_value, layer_s, step_s, pred,
         prefill_borrow, prior_hits=PRIOR_HITS, prior_weight=PRIOR_WEIGHT, qdiag=None) -> np.ndarray:
    _check_mode(mode)
    slots = _check_slots(slots)
    p = prepare(trace)
    if slots < max(p.max_active, 1) and mode != "cpu_all":
        raise ValueError(f"lru needs at least as many slots as the largest active set ({p.max_active} = unique "
                         f"experts of one layer's decode batch), got {slots}")
    if mode == "cpu_all":
        slots = 0
    kind, fv, _ = _future_value_kind(future_value)
    if layer_s < 0 or step_s < 0 or prior_hits < 0 or prior_weight < 0:
        raise ValueError("layer_s, step_s, prior_hits and prior_weight must be >= 0")
    use_pf = mode.endswith("_prefetch")
    if pred is None or not use_pf:
        pred = np.full((trace.steps, trace.num_layers, 1), -1, np.int32)
    borrow_n = min(2 * trace.num_experts, slots) if prefill_borrow else 0
    diag = np.zeros((0, 0, 3)) if qdiag is None else qdiag
    return _timing_kernel(p.active, p.counts, _token_counts(trace), p.seg_start, slots, trace.num_flat,
                          trace.num_experts, borrow_n, _MODE_CODE[mode], float(costs.transfer_s),
                          float(costs.cpu_s), float(costs.gpu_s), float(costs.cpu_handoff_s),
                          float(costs.cpu_token_s), float(layer_s), float(step_s), kind, fv,
                          marginal_hit_value(costs), float(prior_hits), float(prior_weight), MAX_HITS,
                          np.ascontiguousarray(pred, np.int32), use_pf, diag)


def _resolve_predictions(trace: Trace, predictor: str | np.ndarray, prefetch_n: int | None):
    if isinstance(predictor, str):
        key = ("predictions", predictor, _prefetch_n(trace, prefetch_n))
        if key not in trace._derived:
            trace._derived[key] = predictions(trace, predictor, key[2])
        return predictor, trace._derived[key]
    pred = np.asarray(predictor)
    if pred.ndim != 3 or pred.shape[:2] != (trace.steps, trace.num_layers):
        raise ValueError(f"predictions must have shape [steps={trace.steps}, layers={trace.num_layers}, n], "
                         f"got {pred.shape}")
    return "given", pred


def time_modes(trace: Trace, slots: int, pcie_gbps: float, cpu_gbps: float, gpu_gbps: float = DEFAULT_GPU_GBPS,
               modes: Sequence[str] = MODES, *, window: str = "second_half", future_value: float | str = "auto",
               layer_s: float = 0.0, step_s: float = 0.0, predictor: str | np.ndarray = "coact",
               prefetch_n: int | None = None, prefill_borrow: bool = True,
               copy_latency_s: float = DEFAULT_COPY_LATENCY_S, cpu_handoff_s: float = DEFAULT_CPU_HANDOFF_S,
               cpu_token_s: float = 0.0, prior_hits: float = PRIOR_HITS, prior_weight: float = PRIOR_WEIGHT,
               _pred=None) -> list[ModeTiming]:
    """Model each decode step's time for every mode at one bandwidth point; see the module docstring.

    ``slots``: GPU expert slots. Bandwidths in GB/s (1e9 bytes/s). ``window``: the steps scored (the cache runs
    over the whole trace). ``future_value``: ``"auto"`` (per-expert online estimate), ``"global"`` (hits per record
    lifetime) or a fixed number of seconds per fetched expert; ``prior_weight`` / ``prior_hits`` are their priors.
    ``predictor``: a :data:`freetoken.policy.predict.PREDICTORS` name (``coact`` learns on the first half of the
    trace) or a predictions array ``[steps, L, n]``; ``prefetch_n`` experts are predicted per call (default
    top_k x tokens). Raises ValueError on bad arguments.
    """
    if window not in WINDOWS:
        raise ValueError(f"unknown window {window!r} (expected one of {', '.join(WINDOWS)})")
    for mode in modes:
        _check_mode(mode)
    costs = StepCosts.from_bandwidths(trace.record_bytes, pcie_gbps, cpu_gbps, gpu_gbps, copy_latency_s,
                                      cpu_handoff_s, cpu_token_s)
    t0, t1 = window_steps(trace, window)
    p = prepare(trace)
    accesses = int(p.step_offsets[t1] - p.step_offsets[t0])
    pname, pred, score = "", None, None
    if any(m.endswith("_prefetch") for m in modes):
        pname, pred = _resolve_predictions(trace, predictor, prefetch_n) if _pred is None else _pred
        score = precision_recall(trace, pred, (t0, t1))
    fv_name = _future_value_kind(future_value)[2]
    out = []
    n = max(t1 - t0, 0)
    for mode in modes:
        acc = _run(trace, mode, slots, costs, future_value=future_value, layer_s=layer_s, step_s=step_s, pred=pred,
                   prefill_borrow=prefill_borrow, prior_hits=prior_hits, prior_weight=prior_weight)
        w = acc[:, t0:t1]
        mean = w.mean(axis=1) if n else np.zeros(len(_FIELDS))
        tot = w.sum(axis=1)
        pf = mode.endswith("_prefetch")
        out.append(ModeTiming(
            mode=mode, slots=int(slots), window=window, steps=n, tokens_per_step=trace.tokens,
            pcie_gbps=float(pcie_gbps), cpu_gbps=float(cpu_gbps), gpu_gbps=float(gpu_gbps),
            step_s=float(mean[0]), transfer_s=float(mean[1]), prefetch_s=float(mean[2]), cpu_s=float(mean[3]),
            gpu_s=float(mean[4]), stall_s=float(mean[5]), accesses=accesses, hits=int(tot[6]), misses=int(tot[7]),
            fetched=int(tot[8]), prefetched=int(tot[9]), prefetch_used=int(tot[10]),
            future_value=fv_name if mode.startswith("qstar") else "", predictor=pname if pf else "",
            prediction=score if pf else None, per_step=acc[0].copy()))
    return out


def split_vs_extremes_same_state(trace: Trace, slots: int, pcie_gbps: float, cpu_gbps: float,
                                 gpu_gbps: float = DEFAULT_GPU_GBPS, *, future_value: float | str = 0.0,
                                 prefill_borrow: bool = True, copy_latency_s: float = DEFAULT_COPY_LATENCY_S,
                                 cpu_handoff_s: float = DEFAULT_CPU_HANDOFF_S,
                                 cpu_token_s: float = 0.0, prior_hits: float = PRIOR_HITS) -> np.ndarray:
    """Replay ``qstar`` and return, per call, the expert-phase critical path of q* and of q = 0 and q = m on the
    same (qstar's) cache state: float64 ``[steps, L, 3]``. With ``future_value=0`` the first column is <= the
    other two everywhere, by construction."""
    costs = StepCosts.from_bandwidths(trace.record_bytes, pcie_gbps, cpu_gbps, gpu_gbps, copy_latency_s,
                                      cpu_handoff_s, cpu_token_s)
    diag = np.zeros((trace.steps, trace.num_layers, 3))
    _run(trace, "qstar", slots, costs, future_value=future_value, layer_s=0.0, step_s=0.0, pred=None,
         prefill_borrow=prefill_borrow, prior_hits=prior_hits, qdiag=diag)
    return diag


def sweep(trace: Trace, slots: int, cpu_gbps: float, ratios: Iterable[float] = SWEEP_RATIOS,
          modes: Sequence[str] = MODES, **kwargs) -> list[dict]:
    """:func:`time_modes` at PCIe = ratio x ``cpu_gbps`` for each ratio (the CPU bandwidth stays); one row
    (:meth:`ModeTiming.as_row` plus ``ratio``) per (ratio, mode). ``kwargs`` go to :func:`time_modes`."""
    ratios = [float(r) for r in ratios]
    if not ratios or min(ratios) <= 0:
        raise ValueError("ratios must be positive")
    pre = None
    if any(m.endswith("_prefetch") for m in modes):
        pre = _resolve_predictions(trace, kwargs.pop("predictor", "coact"), kwargs.pop("prefetch_n", None))
    rows = []
    for r in ratios:
        for res in time_modes(trace, slots, r * float(cpu_gbps), cpu_gbps, modes=modes, _pred=pre, **kwargs):
            rows.append({"ratio": r, **res.as_row()})
    return rows


def sweep_ratios(lo: float = 0.25, hi: float = 4.0, n: int = 9) -> tuple[float, ...]:
    """``n`` geometric steps from ``lo`` to ``hi``."""
    if not 0 < lo <= hi or n < 1:
        raise ValueError("need 0 < lo <= hi and n >= 1")
    return tuple(float(v) for v in np.geomspace(lo, hi, n))


# ------------------------------------------------------------------------------------------------- reports


def _us(s: float) -> str:
    return f"{s * 1e6:,.1f}"


def format_timing(results: Sequence[ModeTiming]) -> str:
    """A table: one line per (slots, mode) with tokens/s and microseconds per decode step, then notes."""
    header = ("mode", "slots", "tok/s", "step us", "transfer us", "prefetch us", "cpu us", "gpu us", "stall us",
              "hit rate", "fetched", "on cpu", "note")
    body = []
    qstar = {r.slots: r for r in results if r.mode == "qstar"}
    for r in results:
        note = []
        if r.future_value:
            note.append(f"future value {r.future_value}")
        if r.prediction is not None:
            note.append(f"{r.predictor}: precision {r.prediction.precision:.2f} recall {r.prediction.recall:.2f}; "
                        f"{r.prefetch_used:,} of {r.prefetched:,} prefetched used")
            base = qstar.get(r.slots)
            if r.mode == "qstar_prefetch" and base is not None and base.step_s > 0:
                gain = base.step_s / r.step_s - 1.0 if r.step_s > 0 else 0.0
                note.append(f"{100 * gain:+.1f}% tok/s vs qstar ({'pays' if gain > 0 else 'does not pay'})")
        body.append((r.mode, str(r.slots), f"{r.tokens_per_s:,.2f}", _us(r.step_s), _us(r.transfer_s),
                     _us(r.prefetch_s), _us(r.cpu_s), _us(r.gpu_s), _us(r.stall_s), f"{100 * r.hit_rate:.1f}%",
                     f"{r.fetched:,}", f"{r.cpu_experts:,}", "; ".join(note)))
    out = text_table(header, body, left={0, 12}, groups=[r.slots for r in results])
    if results:
        r0 = results[0]
        out.append("")
        out.append(f"PCIe {r0.pcie_gbps:g} GB/s, CPU {r0.cpu_gbps:g} GB/s, GPU {r0.gpu_gbps:g} GB/s; "
                   f"{r0.steps:,} decode steps scored ({r0.window}), {r0.tokens_per_step} token(s) per step; "
                   "times are per decode step; step = gpu + stall")
    return "\n".join(s.rstrip() for s in out)


def format_sweep(rows: Sequence[dict]) -> str:
    """tokens/s per mode (columns) against the PCIe/CPU ratio (rows), per slot count; ``best extreme`` is
    max(fetch_all, cpu_all) and ``qstar/best`` the ratio of qstar to it."""
    modes = list(dict.fromkeys(r["mode"] for r in rows))
    extra = "fetch_all" in modes and "cpu_all" in modes and "qstar" in modes
    header = ["slots", "PCIe/CPU", "PCIe GB/s", *modes] + (["qstar/best"] if extra else [])
    table: dict[tuple[int, float], dict] = {}
    for r in rows:
        table.setdefault((r["slots"], r["ratio"]), {"pcie": r["pcie_gbps"]})[r["mode"]] = r["tokens_per_s"]
    body = []
    for (slots, ratio), d in table.items():
        cells = [str(slots), f"{ratio:.3g}x", f"{d['pcie']:.3g}", *(f"{d.get(m, float('nan')):,.2f}" for m in modes)]
        if extra:
            cells.append(f"{d['qstar'] / max(d['fetch_all'], d['cpu_all']):.3f}")
        body.append(cells)
    out = text_table(header, body)
    out.append("tokens/s per mode; PCIe varies, the CPU bandwidth stays")
    return "\n".join(out)


__all__ = ["ALL_MODES", "MODES", "PREDICTORS", "SWEEP_RATIOS", "ModeTiming", "format_sweep", "format_timing",
           "split_vs_extremes_same_state", "sweep", "sweep_ratios", "time_modes"]
