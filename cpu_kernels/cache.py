"""The expert cache's admission and copy on the CPU: the Numba twin of ``cuda/cache.cu``, on the same arrays and
with the same semantics (see ``cache_admit`` there and the CacheModel reference in ``freetoken.testing``)."""

import numba as nb
import numpy as np

from freetoken.device.constants import (
    CACHE_BYPASSED,
    NO_ROUTE,
    SCORED_G_CONT,
    SCORED_G_LOADS,
    SCORED_G_REUSE,
    SCORED_PROTECT,
    SCORED_TAU_MAX,
    SCORED_TAU_MIN,
)

_NO_KEY = np.int64(0x7FFFFFFFFFFFFFFF)


@nb.njit(error_model="numpy", cache=True, inline="always")
def _active_ids(flat_ids, layer, experts, err):
    """A call's pairs as flat ids (``flat``; -1 for ``NO_ROUTE``, a pair routed to another format's experts, and for
    an id out of [0, experts), which sets err 1) and its distinct flat ids in increasing order (``active[:na]``):
    the start of both admissions (``active_ids`` in ``cuda/cache.cu``)."""
    pairs = flat_ids.size
    flat = np.empty(pairs, np.int64)
    valid = 0
    for p in range(pairs):
        e = flat_ids[p]
        if e == NO_ROUTE:
            flat[p] = -1
        elif e < 0 or e >= experts:
            err[0] = max(err[0], 1)
            flat[p] = -1
        else:
            flat[p] = layer * experts + e
            valid += 1
    cand = np.empty(valid, np.int64)
    j = 0
    for p in range(pairs):
        if flat[p] >= 0:
            cand[j] = flat[p]
            j += 1
    cand.sort()
    active = np.empty(valid, np.int64)
    na = 0
    for i in range(valid):
        if i == 0 or cand[i] != cand[i - 1]:
            active[na] = cand[i]
            na += 1
    return flat, active, na


@nb.njit(error_model="numpy", cache=True)
def cache_admit(ids, layer, experts, slot_for_id, id_of_slot, recency, pinned, clock, worklist, n_work, hits, misses,
                err, count):
    """Admit one layer's routed ids (``ids`` int32, any shape, C-contiguous: expert indices, rewritten in place to slot
    ids). The clock advances once; hits refresh their slot's recency; the misses, in increasing flat-id order, each
    take the slot of lowest recency that is not pinned and holds no id active in this call (ties: lowest slot); the
    victim's old owner loses its mapping; worklist[2 i] = slot, [2 i + 1] = flat id. A pair whose id is ``NO_ROUTE``
    is left out (slot ``NO_ROUTE``, no error). err: max with 1 (an id out of
    [0, experts): its pair gets slot -1) and 2 (no victim left). ``count`` = 0 leaves hits/misses alone."""
    flat_ids = ids.reshape(-1)
    pairs = flat_ids.size
    now = clock[0] + 1
    clock[0] = now
    flat, active, na = _active_ids(flat_ids, layer, experts, err)
    is_hit = np.zeros(na, np.bool_)
    for u in range(na):
        s = slot_for_id[active[u]]
        if s >= 0:
            is_hit[u] = True
            recency[s] = now
    slots = id_of_slot.size
    n_miss = 0
    done = 0
    for u in range(na):
        if is_hit[u]:
            continue
        best_key, best = _NO_KEY, -1
        for s in range(slots):
            r = recency[s]
            key = _NO_KEY if (pinned[s] != 0 or r == now) else r
            if key < best_key:
                best_key, best = key, s
        if best_key == _NO_KEY:
            err[0] = max(err[0], 2)
        else:
            f = active[u]
            old = id_of_slot[best]
            if old >= 0:
                slot_for_id[old] = -1
            id_of_slot[best] = f
            slot_for_id[f] = best
            recency[best] = now
            worklist[2 * done] = best
            worklist[2 * done + 1] = f
            done += 1
        n_miss += 1
    for p in range(pairs):
        flat_ids[p] = slot_for_id[flat[p]] if flat[p] >= 0 else -1
    n_work[0] = done
    if count:
        hits[layer] += na - n_miss
        misses[layer] += n_miss


@nb.njit(error_model="numpy", cache=True)
def cache_copy_bank(worklist, n_work, src, dst, first):
    """Row ``worklist[2 i + 1] - first`` of ``src`` [records, bytes] into row ``worklist[2 i]`` of ``dst`` [slots,
    bytes] (uint8) for i < n_work[0]: one bank of ``cache_copy``."""
    for i in range(n_work[0]):
        s, f = worklist[2 * i], worklist[2 * i + 1]
        dst[s, :] = src[f - first, :]


@nb.njit(error_model="numpy", cache=True)
def cache_borrow_layer(layer, first, experts, slot_for_id, id_of_slot, recency, worklist, n_work):
    """Prefill borrows slots [first, first + experts) for ``layer``: their owners lose mapping and recency, the slots
    stay unregistered, and the worklist lists the layer's records (slot first + e <- record layer * experts + e)."""
    n_work[0] = experts
    for e in range(experts):
        s = first + e
        old = id_of_slot[s]
        if old >= 0:
            slot_for_id[old] = -1
        id_of_slot[s] = -1
        recency[s] = -1
        worklist[2 * e] = s
        worklist[2 * e + 1] = layer * experts + e


@nb.njit(error_model="numpy", cache=True, inline="always")
def _scored_key(o, lo, c, last, c1, c2, c3, c4, dp, dp2, lclock, q, q2, kappa, long_weight, layers, cycle, pbar,
                itau):
    a = lclock[lo] - last[o]
    r = q * (c1[o] * dp[min(a, dp.size - 1)])
    if long_weight != 0.0:
        r = ((1.0 - long_weight) * r) + (long_weight * (q2 * (c4[o] * dp2[min(a, dp2.size - 1)])))
    w = 1.0 / (r + itau)
    d = layers
    if cycle:
        d = (lo - c - 1 + layers) % layers + 1
    if a == 0:
        p = (c2[o] + kappa * pbar) / (c3[o] + kappa)
        return SCORED_PROTECT - ((((1.0 - p) * layers) * w) + d)
    return -((layers * (w - 1.0)) + d)


@nb.njit(error_model="numpy", cache=True)
def cache_admit_scored(ids, layer, experts, slot_for_id, id_of_slot, stamp, pinned, clock, lclock, last, c1, c2,
                       c3, c4, dp, dp2, glob, q, q2, rho, kappa, id_decay, global_decay, load_weight, long_weight,
                       layers, bypass, cycle, worklist, n_work, bypass_list, n_bypass, hits, misses, bypassed, err,
                       count, max_bypass):
    """The scored (next_use) admission of one layer's routed ids: ``cache_admit_scored`` of ``cuda/cache.cu`` on the
    same arrays (the ScoredConsts fields as scalars). Bypassed misses' pairs get ``CACHE_BYPASSED`` and their flat
    ids go to ``bypass_list`` (count in ``n_bypass[0]``); at most ``max_bypass`` per call (later ones are admitted)."""
    flat_ids = ids.reshape(-1)
    pairs = flat_ids.size
    call = clock[0] + 1
    clock[0] = call
    flat, active, na = _active_ids(flat_ids, layer, experts, err)
    lclock[layer] += 1
    now = lclock[layer]
    is_hit = np.zeros(na, np.bool_)
    for u in range(na):
        f = active[u]
        g = now - last[f]
        cont = 0.0
        if last[f] > 0:
            if g == 1:
                cont = 1.0
            glob[SCORED_G_CONT] = global_decay * glob[SCORED_G_CONT] + cont
            glob[SCORED_G_REUSE] = global_decay * glob[SCORED_G_REUSE] + 1.0
            c2[f] = id_decay * c2[f] + cont
            c3[f] = id_decay * c3[f] + 1.0
        inc = 1.0
        if cont != 0.0:
            inc = rho
        c1[f] = inc + c1[f] * dp[min(g, dp.size - 1)]
        c4[f] = inc + c4[f] * dp2[min(g, dp2.size - 1)]
        last[f] = now
        s = slot_for_id[f]
        if s >= 0:
            is_hit[u] = True
            stamp[s] = call
    slots = id_of_slot.size
    pbar = glob[SCORED_G_CONT] / glob[SCORED_G_REUSE]
    ld = glob[SCORED_G_LOADS]
    tau = SCORED_TAU_MAX
    if ld > 0.0:
        tau = slots / (layers * ld)
    tau = min(max(tau, SCORED_TAU_MIN), SCORED_TAU_MAX)
    itau = 1.0 / tau
    n_miss = 0
    done = 0
    nb_ = 0
    for u in range(na):
        if is_hit[u]:
            continue
        n_miss += 1
        f = active[u]
        best = -1
        best_key = np.inf
        for s in range(slots):
            if pinned[s] != 0 or stamp[s] == call:
                continue
            o = id_of_slot[s]
            k = -np.inf
            if o >= 0:
                k = _scored_key(o, o // experts, layer, last, c1, c2, c3, c4, dp, dp2, lclock, q, q2, kappa,
                                long_weight, layers, cycle != 0, pbar, itau)
            if best < 0 or k < best_key:
                best, best_key = s, k
        if best < 0:
            err[0] = max(err[0], 2)
            continue
        old = id_of_slot[best]
        if bypass != 0 and nb_ < max_bypass and old >= 0:
            kin = _scored_key(f, layer, layer, last, c1, c2, c3, c4, dp, dp2, lclock, q, q2, kappa, long_weight,
                              layers, cycle != 0, pbar, itau)
            if not kin > best_key:
                bypass_list[nb_] = f
                nb_ += 1
                continue
        if old >= 0:
            slot_for_id[old] = -1
        id_of_slot[best] = f
        slot_for_id[f] = best
        stamp[best] = call
        worklist[2 * done] = best
        worklist[2 * done + 1] = f
        done += 1
    for p in range(pairs):
        f = flat[p]
        if f < 0:
            flat_ids[p] = NO_ROUTE
        elif slot_for_id[f] >= 0:
            flat_ids[p] = slot_for_id[f]
        else:
            flat_ids[p] = CACHE_BYPASSED
    n_work[0] = done
    n_bypass[0] = nb_
    keep = (1.0 - load_weight) * glob[SCORED_G_LOADS]
    if n_miss == 0:
        glob[SCORED_G_LOADS] = keep
    else:
        glob[SCORED_G_LOADS] = keep + load_weight * done
    if count:
        hits[layer] += na - n_miss
        misses[layer] += n_miss
        bypassed[layer] += nb_


@nb.njit(error_model="numpy", cache=True)
def cache_scored_prefill(layer, experts, counts, k_eff, lclock, last, c1, c4, dp, dp2, q, q2, prior_weight,
                         prior_keep, long_prior_keep):
    """next_use's prefill prior for one layer: ``cache_scored_prefill`` of ``cuda/cache.cu`` (the ScoredConsts
    fields it reads as scalars)."""
    total = 0.0
    for e in range(experts):
        total += counts[e]
    if not total > 0.0:
        return
    now = lclock[layer]
    steady = 1.0 / q
    steady2 = 1.0 / q2
    for e in range(experts):
        f = layer * experts + e
        a = now - last[f]
        t = c1[f] * dp[min(a, dp.size - 1)]
        t2 = c4[f] * dp2[min(a, dp2.size - 1)]
        p = (k_eff * counts[e]) / total
        if p > 1.0:
            p = 1.0
        wp = prior_weight * p
        c1[f] = prior_keep * t + wp * steady
        c4[f] = long_prior_keep * t2 + wp * steady2
        last[f] = now


@nb.njit(error_model="numpy", cache=True)
def cache_stream_bypassed(ids, slots, layer, experts, bypass, n_bypass, scratch, limit, worklist, n_work, err):
    """The last scored admission's bypassed misses, the first ``limit`` (all when < 0) streamed through scratch slots
    (``cache_stream_bypassed`` in ``cuda/cache.cu``): ``bypass[i]`` goes to slot ``scratch + i``, its worklist item
    after the admitted misses', and every pair of ``slots`` marked ``CACHE_BYPASSED`` reads it there; the pairs of
    the rest get ``NO_ROUTE`` (``ids``: the call's expert ids). A marked pair whose id is not listed gets
    ``NO_ROUTE`` and err 1."""
    nb_, nw = n_bypass[0], n_work[0]
    ns = nb_ if limit < 0 else min(limit, nb_)
    flat_ids, flat_slots = ids.reshape(-1), slots.reshape(-1)
    for p in range(flat_slots.size):
        if flat_slots[p] != CACHE_BYPASSED:
            continue
        f = layer * experts + flat_ids[p]
        s = NO_ROUTE
        listed = False
        for i in range(nb_):
            if bypass[i] == f:
                listed = True
                if i < ns:
                    s = scratch + i
                break
        if not listed:
            err[0] = max(err[0], 1)
        flat_slots[p] = s
    for i in range(ns):
        worklist[2 * (nw + i)] = scratch + i
        worklist[2 * (nw + i) + 1] = bypass[i]
    n_work[0] = nw + ns
