"""The decode-step time model's kernel (Numba): one pass over a trace's calls through the device LRU
(:mod:`freetoken.policy.lru`), the q* split (:mod:`freetoken.policy.qstar`), the future-value estimators
(:mod:`freetoken.policy.estimators`) and next-call prefetch. The model itself is described in
:mod:`freetoken.sim.timing`, which validates the arguments and calls :func:`timing_kernel`; a cache policy's
decisions (:func:`lru_decisions`, :func:`scored_decisions`) are timed by :func:`policy_timing_kernel`."""

from __future__ import annotations

import numba as nb
import numpy as np

from freetoken.policy.estimators import (
    FV_AUTO,
    FV_FIXED,
    LAST_USED,
    fv_auto_values,
    fv_end_call,
    fv_evicted,
    fv_first_uses,
    fv_global_value,
    fv_new,
    fv_pool,
    fv_prefetched,
)
from freetoken.policy.lru import SLOT_OF, lru_admit, lru_borrow, lru_end, lru_insert, lru_lookup, lru_new, sort_ids
from freetoken.policy.qstar import best_q, best_q_values, critical_path, order_misses
from freetoken.policy.scored import BYPASSED as BYPASSED_ID
from freetoken.policy.scored import PARAMS as PARAMS_S
from freetoken.policy.scored import PRIOR_KEEP as PRIOR_KEEP_S
from freetoken.policy.scored import PRIOR_WEIGHT as PRIOR_WEIGHT_S
from freetoken.policy.scored import SLOT_OF as SLOT_OF_S
from freetoken.policy.scored import scored_admit, scored_borrow, scored_prefill

#: The kernel's per-step accumulators, in row order.
FIELDS = ("time", "transfer", "prefetch", "cpu", "gpu", "stall", "hits", "misses", "fetched", "prefetched",
          "prefetch_used", "disk", "disk_reads")
#: Mode codes: which misses are fetched.
FETCH_ALL, CPU_ALL, QSTAR = 0, 1, 2


@nb.njit(cache=True)
def cap_of(width, npred, borrow_n):  # pragma: no cover - compiled
    return max(width, npred, borrow_n, 1)


@nb.njit(cache=True)
def timing_kernel(active, counts, tokcnt, seg_start, slots, num_flat, num_experts, borrow_n, mode, x, c, g, hand,
                  ctok, layer_s, step_s, fv_kind, fv_fixed, s_hit, prior_hits, prior_weight, max_hits, pred,
                  use_pf, qdiag, host_rows, disk_s):  # pragma: no cover - compiled
    """float64 [len(FIELDS), steps]: the per-step sums of every call. ``mode``: FETCH_ALL, CPU_ALL or QSTAR;
    ``fv_kind``: FV_FIXED (``fv_fixed`` seconds), FV_AUTO or FV_GLOBAL; ``pred`` int32 [steps, L, n] predicted
    experts (-1 padded), used when ``use_pf``; ``qdiag`` float64 [steps, L, 3] or empty: per call, critical(q*),
    critical(0), critical(m) on the same cache state. ``host_rows`` > 0: host memory holds that many records (a
    host tier, its own LRU): every miss of a call (fetched or computed on the CPU) and every prefetched record is
    looked up there first, and each one not there is read from disk in ``disk_s`` seconds, on the critical path
    before the call's copies and CPU work; a segment start (a prompt) streams every layer's records through it."""
    steps, layers, width = active.shape
    out = np.zeros((13, steps))
    use_tier = host_rows > 0
    hst = lru_new(num_flat, max(host_rows, 1))
    hcap = max(cap_of(width, pred.shape[2], borrow_n), num_experts)
    hids = np.empty(hcap, np.int32)
    hscratch = np.empty(hcap, np.int32)
    hevicted = np.empty(hcap, np.int32)
    st = lru_new(num_flat, slots)
    slot_of = st[SLOT_OF]
    est = fv_new(num_flat)
    last_used = est[LAST_USED]
    npred = pred.shape[2]
    cap = max(width, npred, borrow_n, 1)
    miss_id = np.empty(cap, np.int32)  # a call's misses (demand) or prefetch candidates, in arrival order
    miss_tok = np.empty(cap, np.int64)
    miss_ru = np.empty(cap, np.int64)  # reuse score: the step last routed
    miss_key = np.empty(cap, np.int64)  # last tie-break: the id (demand) or the prediction rank (prefetch)
    fvals = np.zeros(cap)  # per-miss future values (auto); zeros otherwise
    zeros = np.zeros(cap)
    perm = np.empty(cap, np.int64)
    scratch = np.empty(cap, np.int64)
    ord_id = np.empty(cap, np.int32)
    tok_ord = np.empty(cap, np.int64)
    fv_ord = np.empty(cap)
    fetch = np.empty(cap, np.int32)
    evicted = np.empty(cap, np.int32)
    president = np.empty(cap, np.int32)  # prefetch: the predicted ids already resident
    slot = np.empty(cap, np.int32)
    for t in range(steps):
        if seg_start[t]:  # prefill borrows slots [0, 2E): owners evicted, least recent
            k = lru_borrow(st, 0, borrow_n, evicted)
            fv_evicted(est, evicted, k, t, False)
            if use_tier:  # the prompt streams every layer through host memory (not timed: decode steps are)
                for layer in range(layers):
                    for e in range(num_experts):
                        hids[e] = layer * num_experts + e
                    lru_admit(hst, hids, num_experts, hscratch, hevicted)
        step_time = step_s
        step_gpu = step_s
        for layer in range(layers):
            cnt = counts[t, layer]
            ids = active[t, layer]
            h = lru_lookup(st, ids, cnt, slot)  # hits first: they leave the victim list
            hpf = fv_first_uses(est, ids, slot, cnt)  # first uses of prefetched records: what the prefetch bought
            out[10, t] += hpf
            m = 0
            for j in range(cnt):
                if slot[j] < 0:
                    f = ids[j]
                    miss_id[m] = f
                    miss_tok[m] = tokcnt[t, layer, j]
                    miss_ru[m] = last_used[f]
                    miss_key[m] = f
                    m += 1
            p_pool = fv_pool(est)
            # fetch order: the highest future value, then most tokens, then most recently routed, then lowest id
            vals = zeros
            if mode == QSTAR and fv_kind == FV_AUTO:
                fv_auto_values(est, miss_id, m, fvals, p_pool, prior_weight, max_hits, s_hit)
                vals = fvals
            order_misses(vals, miss_tok, miss_ru, miss_key, m, perm, scratch)
            for i in range(m):
                ord_id[i] = miss_id[perm[i]]
                tok_ord[i] = miss_tok[perm[i]]
                fv_ord[i] = vals[perm[i]]
            if mode == FETCH_ALL:
                q = m
            elif mode == CPU_ALL:
                q = 0
            elif fv_kind == FV_AUTO:
                q = best_q_values(x, c, g, hand, ctok, m, h, tok_ord, fv_ord)
            else:
                fv = fv_fixed if fv_kind == FV_FIXED else fv_global_value(est, prior_hits, s_hit)
                q = best_q(x, c, g, hand, ctok, m, h, tok_ord, fv)
            if use_tier and m > 0:  # every miss needs its record in host memory: read from disk if not there
                for i in range(m):
                    hids[i] = miss_id[i]
                sort_ids(hids, m)
                dm = lru_admit(hst, hids, m, hscratch, hevicted)
                step_time += dm * disk_s
                out[5, t] += dm * disk_s
                out[11, t] += dm * disk_s
                out[12, t] += dm
            rest = 0
            for i in range(q, m):
                rest += tok_ord[i]
            if qdiag.shape[0] > 0:  # per-call diagnostics: critical of q*, 0, m on this same cache state
                qdiag[t, layer, 0] = critical_path(x, c, g, hand, ctok, m, h, q, rest)
                r0 = 0
                for i in range(m):
                    r0 += tok_ord[i]
                qdiag[t, layer, 1] = critical_path(x, c, g, hand, ctok, m, h, 0, r0)
                qdiag[t, layer, 2] = critical_path(x, c, g, hand, ctok, m, h, m, 0)
            for i in range(q):
                fetch[i] = ord_id[i]
            sort_ids(fetch, q)
            lru_insert(st, fetch, q, False, evicted)  # the fetched misses in increasing id order, into LRU victims
            fv_evicted(est, evicted, q, t, True)
            crit = critical_path(x, c, g, hand, ctok, m, h, q, rest)
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
            fv_end_call(est, ids, cnt, t, h - hpf)
            lru_end(st)
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
                if slot_of[f] >= 0:
                    already = False
                    for a in range(hp):
                        if president[a] == f:
                            already = True
                    if not already:
                        president[hp] = f
                        hp += 1
                else:
                    dup = False
                    for a in range(nc):
                        if miss_id[a] == f:
                            dup = True
                    if not dup:  # qstar: most recently routed first (as the demand order), then prediction rank
                        miss_id[nc] = f
                        miss_tok[nc] = 1
                        miss_ru[nc] = last_used[f] if mode != FETCH_ALL else 0
                        miss_key[nc] = nc
                        nc += 1
            # copy what the split would fetch for the predicted call, as far as the window allows
            vals = zeros
            if mode != FETCH_ALL and fv_kind == FV_AUTO:
                fv_auto_values(est, miss_id, nc, fvals, p_pool, prior_weight, max_hits, s_hit)
                vals = fvals
            order_misses(vals, miss_tok, miss_ru, miss_key, nc, perm, scratch)
            for i in range(nc):
                tok_ord[i] = 1
                fv_ord[i] = vals[perm[i]]
            if mode == FETCH_ALL:
                qp = nc
            elif fv_kind == FV_AUTO:
                qp = best_q_values(x, c, g, hand, ctok, nc, hp, tok_ord, fv_ord)
            else:
                fv = fv_fixed if fv_kind == FV_FIXED else fv_global_value(est, prior_hits, s_hit)
                qp = best_q(x, c, g, hand, ctok, nc, hp, tok_ord, fv)
            nc = min(qp, budget)
            if nc <= 0:
                continue
            for i in range(nc):
                fetch[i] = miss_id[perm[i]]
            sort_ids(fetch, nc)
            lru_lookup(st, president, hp, slot)  # an admit call on the predicted set: resident ones are refreshed
            nadm = lru_insert(st, fetch, nc, True, evicted)  # never into the slots the current call computes from
            fv_evicted(est, evicted, nadm, t, True)
            fv_prefetched(est, fetch, nadm)
            lru_end(st)
            if use_tier and nadm > 0:  # the prefetched records are read into host memory first (on the host)
                for i in range(nadm):
                    hids[i] = fetch[i]
                dm = lru_admit(hst, hids, nadm, hscratch, hevicted)
                step_time += dm * disk_s
                out[5, t] += dm * disk_s
                out[11, t] += dm * disk_s
                out[12, t] += dm
            out[2, t] += nadm * x
            out[9, t] += nadm
        out[0, t] = step_time
        out[4, t] = step_gpu
    return out


# ---------------------------------------------------------------------------------- a cache policy's decisions

#: what a policy did with each access of a call (:func:`lru_decisions`, :func:`scored_decisions`)
HIT, ADMITTED, BYPASSED_MISS = 0, 1, 2


@nb.njit(cache=True)
def lru_decisions(active, counts, seg_start, slots, num_flat, borrow_n):  # pragma: no cover - compiled
    """int8 [steps, L, A]: the device LRU's decision per access (HIT or ADMITTED; LRU admits every miss), replayed
    as :func:`freetoken.policy.lru.lru_replay_calls` does (a borrow of slots [0, borrow_n) at each segment start)."""
    steps, layers, width = active.shape
    status = np.zeros((steps, layers, max(width, 1)), np.int8)
    st = lru_new(num_flat, slots)
    slot = np.empty(max(width, 1), np.int32)
    fetch = np.empty(max(width, 1), np.int32)
    evicted = np.empty(max(width, borrow_n, 1), np.int32)
    for t in range(steps):
        if seg_start[t]:
            lru_borrow(st, 0, borrow_n, evicted)
        for layer in range(layers):
            cnt = counts[t, layer]
            ids = active[t, layer]
            lru_lookup(st, ids, cnt, slot)
            m = 0
            for j in range(cnt):
                if slot[j] < 0:
                    status[t, layer, j] = ADMITTED
                    fetch[m] = ids[j]
                    m += 1
            if lru_insert(st, fetch, m, False, evicted) < m:
                raise ValueError("no victim: too few slots for one call")
            lru_end(st)
    return status


@nb.njit(cache=True)
def scored_decisions(st, active, counts, seg_start, step_segment, prefill, k_eff, borrow_n):  # pragma: no cover
    """int8 [steps, L, A]: a scored policy's decision per access (HIT, ADMITTED, or BYPASSED_MISS: a miss it does
    not load), replayed exactly as :func:`freetoken.policy.scored.scored_replay_calls` does."""
    slot_of, params = st[SLOT_OF_S], st[PARAMS_S]
    steps, layers, width = active.shape
    status = np.zeros((steps, layers, max(width, 1)), np.int8)
    evicted = np.empty(max(width, borrow_n, 1), np.int32)
    prior = params[PRIOR_WEIGHT_S] != 0.0 or params[PRIOR_KEEP_S] != 1.0
    for t in range(steps):
        if seg_start[t]:
            scored_borrow(st, 0, borrow_n, evicted)
            if prior:
                for layer in range(layers):
                    scored_prefill(st, layer, prefill[step_segment[t], layer], k_eff)
        for layer in range(layers):
            cnt = counts[t, layer]
            ids = active[t, layer]
            for j in range(cnt):
                if slot_of[ids[j]] < 0:
                    status[t, layer, j] = ADMITTED
            m = scored_admit(st, layer, ids, cnt, evicted)
            i = 0
            for j in range(cnt):
                if status[t, layer, j] == ADMITTED:
                    if evicted[i] == BYPASSED_ID:
                        status[t, layer, j] = BYPASSED_MISS
                    i += 1
            if i != m:
                raise ValueError("scored_decisions: miss count mismatch")
    return status


@nb.njit(cache=True)
def policy_timing_kernel(active, counts, tokcnt, status, seg_start, num_flat, num_experts, x, c, g, hand, ctok,
                         layer_s, step_s, host_rows, disk_s):  # pragma: no cover - compiled
    """float64 [len(FIELDS), steps]: :func:`timing_kernel`'s accumulators for a cache policy's decisions
    ``status`` (:func:`lru_decisions`, :func:`scored_decisions`): per call, the admitted misses are fetched
    (q = admitted) and the bypassed ones computed on the CPU (not cached). With LRU's decisions it is
    ``fetch_all`` (the same expressions in the same order: bit-identical). No prefetch; the host tier as there."""
    steps, layers, width = active.shape
    out = np.zeros((13, steps))
    use_tier = host_rows > 0
    hst = lru_new(num_flat, max(host_rows, 1))
    hcap = max(width, num_experts, 1)
    hids = np.empty(hcap, np.int32)
    hscratch = np.empty(hcap, np.int32)
    hevicted = np.empty(hcap, np.int32)
    for t in range(steps):
        if seg_start[t] and use_tier:
            for layer in range(layers):
                for e in range(num_experts):
                    hids[e] = layer * num_experts + e
                lru_admit(hst, hids, num_experts, hscratch, hevicted)
        step_time = step_s
        step_gpu = step_s
        for layer in range(layers):
            cnt = counts[t, layer]
            ids = active[t, layer]
            h = 0
            m = 0
            q = 0
            rest = 0
            for j in range(cnt):
                s = status[t, layer, j]
                if s == HIT:
                    h += 1
                else:
                    hids[m] = ids[j]
                    m += 1
                    if s == ADMITTED:
                        q += 1
                    else:
                        rest += tokcnt[t, layer, j]
            if use_tier and m > 0:
                sort_ids(hids, m)
                dm = lru_admit(hst, hids, m, hscratch, hevicted)
                step_time += dm * disk_s
                out[5, t] += dm * disk_s
                out[11, t] += dm * disk_s
                out[12, t] += dm
            crit = critical_path(x, c, g, hand, ctok, m, h, q, rest)
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
        out[0, t] = step_time
        out[4, t] = step_gpu
    return out
