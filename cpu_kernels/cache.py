"""The expert cache's admission and copy on the CPU: the Numba twin of ``cuda/cache.cu``, on the same arrays and
with the same semantics (see ``cache_admit`` there and the CacheModel reference in ``freetoken.testing``)."""

import numba as nb
import numpy as np

from freetoken.device.constants import NO_ROUTE

_NO_KEY = np.int64(0x7FFFFFFFFFFFFFFF)


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
    flat = np.empty(pairs, np.int64)
    valid = 0
    for p in range(pairs):
        e = flat_ids[p]
        if e == NO_ROUTE:  # routed to another format's experts: left out, no error
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
