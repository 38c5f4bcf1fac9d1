"""Parity cases of the cache ops (``ops.cache_admit``, ``ops.cache_copy``, ``ops.cache_borrow_layer``:
``cuda/cache.cu``) against ``CacheModel``, and of ``ExpertCache`` admissions over PCIe (gpu/emu, timed by
bench/gpu_check)."""

from __future__ import annotations

import numpy as np

from freetoken import formats, ops
from freetoken.device.constants import NO_ROUTE
from freetoken.formats import RecordLayout
from freetoken.ops.cache import CopyTable
from freetoken.testing.cases.base import KernelCase
from freetoken.testing.reference.cache import CacheModel, ScoredCacheModel, stream_bypassed_reference


# ---- cache.cu -------------------------------------------------------------------------------------------------
def _cache_dims(size):
    # (hidden, inter, layers, experts, slots, k): issue 4's benchmark point on gpu, a toy on emu
    return (64, 32, 2, 16, 40, 8) if size == "small" else (2048, 768, 2, 128, 1024, 8)


def _make_cache_case(fmt_name: str, what: str):
    def make(rng, size):
        hidden, inter, layers, experts, slots, k = _cache_dims(size)
        layout = RecordLayout(formats.get(fmt_name), hidden, inter)
        ids = [np.sort(rng.permutation(experts)[:k]).astype(np.int32)[None, :] for _ in range(32)]
        return {"layout": layout, "layers": layers, "experts": experts, "slots": slots, "ids": ids, "seed": 7}

    def setup(dev, inp):
        from freetoken.cache import ExpertCache, HostPool

        pool = HostPool(dev, inp["layout"], inp["layers"], inp["experts"])
        rng = np.random.default_rng(inp["seed"])
        for name in pool.banks:  # random record bytes: copies are checked byte for byte
            host = pool.host(name).view(np.uint8)
            host[...] = rng.integers(0, 256, host.shape, dtype=np.uint8)
        cache = ExpertCache(pool, inp["slots"], max_active=inp["ids"][0].size)
        first = dev.asarray(inp["ids"][0])
        cache.admit(0, first)
        cache.copy_missing()
        dev.synchronize()
        return {"cache": cache, "first": first, "ids": [dev.asarray(i) for i in inp["ids"]], "i": [0]}

    def launch(dev, st):
        cache = st["cache"]
        if what == "copy":
            cache.copy_missing()  # the first admit's worklist again: k records over PCIe
            return
        i = st["i"][0] = st["i"][0] + 1
        ids = st["ids"][i % len(st["ids"])].copy()
        cache.admit(i % cache.num_layers, ids)
        cache.copy_missing()

    def fetch(dev, st):
        cache = st["cache"]
        slots = dev.to_host(st["first"]).ravel()
        flat = dev.to_host(cache.id_of_slot)[slots]
        same = all(np.array_equal(dev.to_host(bank[int(s)]).view(np.uint8), cache.pool.host(n)[int(f)].view(np.uint8))
                   for n, bank in cache.slot_banks.items() for s, f in zip(slots, flat, strict=True))
        return {"first_slots": slots, "rows_match": np.array([int(same)])}

    def reference(inp):
        model = CacheModel(inp["layers"], inp["experts"], inp["slots"])
        want, _ = model.admit(0, inp["ids"][0])
        return {"first_slots": want.ravel(), "rows_match": np.array([1])}

    return KernelCase(f"cache_{what}_{fmt_name}", "cache.cu", make, setup, launch, reference, fetch_fn=fetch,
                      cuda_only=True, bytes_moved=lambda inp: inp["ids"][0].size * inp["layout"].record_bytes,
                      op="cache_copy" if what == "copy" else "cache_admit")


# ---- the ops alone, on every device (cpu: the Numba twin), against CacheModel --------------------------------------
def _make_sequence(rng, size):
    """A sequence of admissions (repeated ids within a call, pinned slots, ``NO_ROUTE`` pairs) with prefill borrows in
    between."""
    layers, experts, slots, calls = (3, 16, 40, 30) if size == "small" else (4, 128, 1024, 200)
    k, tokens = (6, 2) if size == "small" else (8, 4)
    steps = []
    for i in range(calls):
        if i % 11 == 5:
            steps.append(("borrow", i % layers, (i // 11) % 2 * experts))
        else:
            ids = rng.integers(0, experts, (tokens, k)).astype(np.int32)  # duplicates across tokens: one record
            if i % 5 == 2:  # pairs routed to another format's experts: left out, no error (all of them in call 7)
                ids[(rng.random(ids.shape) < 0.4) | (i == 7)] = NO_ROUTE
            steps.append(("admit", i % layers, ids, i % 7 != 3))  # every 7th a prefetch (not counted)
    pins = [(layers - 1, 1, slots - 1), (0, 2, slots - 2)]  # (layer, expert, slot)
    return {"layers": layers, "experts": experts, "slots": slots, "steps": steps, "pins": pins}


def _seq_setup(dev, inp):
    layers, experts, slots = inp["layers"], inp["experts"], inp["slots"]
    pairs = max(s[2].size for s in inp["steps"] if s[0] == "admit")
    i32, i64 = np.int32, np.int64
    sfi, ios = np.full(layers * experts, -1, i32), np.full(slots, -1, i32)
    rec, pin = np.full(slots, -1, i64), np.zeros(slots, np.uint8)
    for layer, e, s in inp["pins"]:
        sfi[layer * experts + e], ios[s], rec[s], pin[s] = s, layer * experts + e, 0, 1
    arr = dev.asarray
    return {"sfi": arr(sfi), "ios": arr(ios), "rec": arr(rec), "pin": arr(pin), "clock": arr(np.zeros(1, i64)),
            "hits": arr(np.zeros(layers, i64)), "misses": arr(np.zeros(layers, i64)), "err": arr(np.zeros(1, i32)),
            "work": arr(np.full(2 * max(pairs, experts), -7, i32)), "n_work": arr(np.zeros(1, i32)),
            "steps": inp["steps"], "experts": experts, "out": []}


def _seq_launch(dev, st):
    st["out"] = out = []  # per call: (rewritten ids or None, a copy of the worklist, a copy of its count)
    for step in st["steps"]:
        ids = None
        if step[0] == "borrow":
            ops.cache_borrow_layer(step[1], step[2], st["experts"], st["sfi"], st["ios"], st["rec"], st["work"],
                                   st["n_work"], device=dev)
        else:
            ids = dev.asarray(step[2].copy())
            ops.cache_admit(ids, step[1], st["experts"], st["sfi"], st["ios"], st["rec"], st["pin"], st["clock"],
                            st["work"], st["n_work"], st["hits"], st["misses"], st["err"], count=step[3], device=dev)
        out.append((ids, st["work"].copy(), st["n_work"].copy()))


def _seq_fetch(dev, st):
    slot_ids, work, state = [], [], []
    for ids, wl, nw in st["out"]:
        if ids is not None:
            slot_ids.append(dev.to_host(ids).ravel())
        work.append(dev.to_host(wl)[:2 * int(dev.to_host(nw)[0])])
    for name in ("sfi", "ios", "rec", "hits", "misses", "err", "clock"):
        state.append(dev.to_host(st[name]).astype(np.int64))
    return {"slot_ids": np.concatenate(slot_ids).astype(np.int64), "work": np.concatenate(work).astype(np.int64),
            "state": np.concatenate(state)}


def _seq_reference(inp):
    model = CacheModel(inp["layers"], inp["experts"], inp["slots"])
    for layer, e, s in inp["pins"]:
        model.pin(layer * inp["experts"] + e, s)
    slot_ids, work = [], []
    for step in inp["steps"]:
        if step[0] == "borrow":
            work += model.borrow(step[1], step[2])
            continue
        hits, misses = model.hits.copy(), model.misses.copy()
        got, w = model.admit(step[1], step[2])
        if not step[3]:
            model.hits, model.misses = hits, misses
        slot_ids.append(got.ravel())
        work += w
    state = [model.slot_for_id, model.id_of_slot, model.recency, model.hits, model.misses, np.zeros(1),
             np.array([model.clock])]
    return {"slot_ids": np.concatenate(slot_ids).astype(np.int64), "work": np.array(work, np.int64).reshape(-1),
            "state": np.concatenate([np.asarray(a, np.int64) for a in state])}


def _make_copy(rng, size):
    records, slots, n = (50, 20, 7) if size == "small" else (1024, 512, 256)
    row_bytes = (48, 36, 7) if size == "small" else (49152, 4096, 36)  # 16-, 4- and 1-byte paths
    src = [rng.integers(0, 256, (records, b), dtype=np.uint8) for b in row_bytes]
    dst_slots = rng.permutation(slots)[:n + 3].astype(np.int32)  # entries past n_work name real slots: never copied
    work = np.stack([dst_slots, rng.integers(0, records, n + 3).astype(np.int32)], axis=1).reshape(-1)
    return {"src": src, "slots": slots, "work": work, "n": n}


def _copy_setup(dev, inp):
    dst = [dev.asarray(np.full((inp["slots"], s.shape[1]), 0xAB, np.uint8)) for s in inp["src"]]
    pinned = []
    for s in inp["src"]:
        p = dev.pinned_empty(s.shape, np.uint8)
        p.host[...] = s
        pinned.append(p)
    table = CopyTable(dev, list(zip(pinned, dst, strict=True)))
    return {"table": table, "work": dev.asarray(inp["work"]), "n_work": dev.asarray(np.array([inp["n"]], np.int32)),
            "max_items": inp["n"] + 3, **{f"out_bank{i}": d for i, d in enumerate(dst)}, "_pinned": pinned}


def _copy_launch(dev, st):
    ops.cache_copy(st["work"], st["n_work"], st["table"], st["max_items"], device=dev)


def _copy_reference(inp):
    out = {}
    work = inp["work"].reshape(-1, 2)[:inp["n"]]
    for i, s in enumerate(inp["src"]):
        d = np.full((inp["slots"], s.shape[1]), 0xAB, np.uint8)
        d[work[:, 0]] = s[work[:, 1]]
        out[f"bank{i}"] = d
    return out


CACHE_CASES = [_make_cache_case(f, w) for w in ("admit_copy", "copy") for f in ("q4_0", "bf16")]
CASES = CACHE_CASES + [
    KernelCase("cache_admit_sequence", "cache.cu", _make_sequence, _seq_setup, _seq_launch, _seq_reference,
               fetch_fn=_seq_fetch, op="cache_admit"),
    KernelCase("cache_borrow_layer", "cache.cu", _make_sequence, _seq_setup, _seq_launch, _seq_reference,
               fetch_fn=_seq_fetch, op="cache_borrow_layer"),
    KernelCase("cache_copy_banks", "cache.cu", _make_copy, _copy_setup, _copy_launch, _copy_reference,
               bytes_moved=lambda inp: inp["n"] * sum(s.shape[1] for s in inp["src"]), op="cache_copy"),
]


# ---- the scored (next_use) admission against ScoredCacheModel ------------------------------------------------------
def _routed_ids(rng, experts: int, tokens: int, k: int, no_route: float) -> np.ndarray:
    """One call's routed ids [tokens, k] (repeats allowed), about a ``no_route`` fraction of them ``NO_ROUTE``."""
    ids = rng.integers(0, experts, (tokens, k)).astype(np.int32)
    if no_route:
        ids[rng.random(ids.shape) < no_route] = NO_ROUTE
    return ids


def _make_scored(rng, size):
    """Calls of the recommended policy (bypass, long memory, prefill prior) in a cache smaller than a step's ids
    (bypass acts), with repeated ids, ``NO_ROUTE`` pairs, prefetches (not counted), prefill priors and one pin."""
    layers, experts, slots, calls = (3, 8, 7, 60) if size == "small" else (4, 128, 256, 200)
    k, tokens = (3, 2) if size == "small" else (8, 4)
    steps = []
    for i in range(calls):
        ids = _routed_ids(rng, experts, tokens, k, 0.4 if i % 5 == 2 else 0.0)
        if i % 13 == 6:  # a prompt's prefill prior for the layer (its routing counts; one layer without tokens)
            counts = rng.integers(0, 9, experts).astype(np.float64) * (i % 39 != 6)
            steps.append(("prior", i % layers, counts, float(k * tokens)))
        steps.append(("admit", i % layers, ids, i % 7 != 3))
    return {"layers": layers, "experts": experts, "slots": slots, "steps": steps, "pin": (layers - 1, 1)}


def _scored_model(inp):
    model = ScoredCacheModel(inp["layers"], inp["experts"], inp["slots"])
    layer, e = inp["pin"]
    model.pin(layer * inp["experts"] + e, inp["slots"] - 1)
    return model


def _scored_setup(dev, inp):
    model = _scored_model(inp)
    i32, i64 = np.int32, np.int64
    n = model.num_layers * model.num_experts

    def arr(a):
        return dev.asarray(np.array(a, copy=True))

    return {"sfi": arr(model.slot_for_id), "ios": arr(model.id_of_slot), "stamp": arr(model.stamp),
            "pin": arr(model.pinned.astype(np.uint8)), "clock": arr(np.zeros(1, i64)), "lclock": arr(model.lclock),
            "last": arr(model.last), **{c: arr(getattr(model, c)) for c in ("c1", "c2", "c3", "c4")},
            "dp": arr(model.dp), "dp2": arr(model.dp2), "glob": arr(model.glob), "consts": model.consts(),
            "work": arr(np.full(2 * n, -7, i32)), "n_work": arr(np.zeros(1, i32)),
            "bypass": arr(np.full(n, -7, i32)), "n_bypass": arr(np.zeros(1, i32)),
            "hits": arr(np.zeros(model.num_layers, i64)), "misses": arr(np.zeros(model.num_layers, i64)),
            "bypassed": arr(np.zeros(model.num_layers, i64)), "err": arr(np.zeros(1, i32)),
            "steps": inp["steps"], "experts": inp["experts"], "out": []}


def _scored_launch(dev, st):
    st["out"] = out = []
    for kind, layer, ids0, count in st["steps"]:
        if kind == "prior":
            ops.cache_scored_prefill(layer, st["experts"], dev.asarray(ids0), count, st["lclock"], st["last"],
                                     st["c1"], st["c4"], st["dp"], st["dp2"], st["consts"], device=dev)
            continue
        ids = dev.asarray(ids0.copy())
        ops.cache_admit_scored(ids, layer, st["experts"], st["sfi"], st["ios"], st["stamp"], st["pin"], st["clock"],
                               st["lclock"], st["last"], st["c1"], st["c2"], st["c3"], st["c4"], st["dp"], st["dp2"],
                               st["glob"], st["consts"], st["work"], st["n_work"], st["bypass"], st["n_bypass"],
                               st["hits"], st["misses"], st["bypassed"], st["err"], count=count, device=dev)
        out.append((ids, st["work"].copy(), st["n_work"].copy(), st["bypass"].copy(), st["n_bypass"].copy()))


def _scored_fetch(dev, st):
    h = dev.to_host
    slot_ids, work, byp = [], [], []
    for ids, wl, nw, bl, nb in st["out"]:
        slot_ids.append(h(ids).ravel())
        work.append(h(wl)[:2 * int(h(nw)[0])])
        byp.append(h(bl)[:int(h(nb)[0])])
    ints = np.concatenate([h(st[n]).astype(np.int64) for n in ("sfi", "ios", "stamp", "lclock", "last", "hits",
                                                                "misses", "bypassed", "err")])
    stats = np.concatenate([h(st[n]) for n in ("c1", "c2", "c3", "c4", "glob")])
    return {"slot_ids": np.concatenate(slot_ids).astype(np.int64), "work": np.concatenate(work).astype(np.int64),
            "bypass": np.concatenate(byp).astype(np.int64), "state": ints, "stats": stats}


def _scored_reference(inp):
    model = _scored_model(inp)
    slot_ids, work, byp = [], [], []
    for kind, layer, ids, count in inp["steps"]:
        if kind == "prior":
            model.prefill(layer, ids, count)
            continue
        hits, misses, bypassed = model.hits.copy(), model.misses.copy(), model.bypassed.copy()
        got, w, b = model.admit(layer, ids)
        if not count:
            model.hits, model.misses, model.bypassed = hits, misses, bypassed
        slot_ids.append(got.ravel())
        work += w
        byp += b
    ints = np.concatenate([np.asarray(a, np.int64) for a in (model.slot_for_id, model.id_of_slot, model.stamp,
                                                             model.lclock, model.last, model.hits, model.misses,
                                                             model.bypassed, np.zeros(1))])
    return {"slot_ids": np.concatenate(slot_ids).astype(np.int64), "work": np.array(work, np.int64).reshape(-1),
            "bypass": np.array(byp, np.int64), "state": ints,
            "stats": np.concatenate([model.c1, model.c2, model.c3, model.c4, model.glob])}


CASES += [KernelCase("cache_admit_scored_sequence", "cache.cu", _make_scored, _scored_setup, _scored_launch,
                     _scored_reference, fetch_fn=_scored_fetch, op="cache_admit_scored"),
          KernelCase("cache_scored_prefill", "cache.cu", _make_scored, _scored_setup, _scored_launch,
                     _scored_reference, fetch_fn=_scored_fetch, op="cache_scored_prefill")]


# ---- bypassed misses streamed through scratch slots (after each scored admission) ----------------------------------
def _make_stream(rng, size):
    """A scored cache smaller than a step's ids (bypass acts; a call's distinct ids still fit), calls of several tokens
    with repeated ids and ``NO_ROUTE`` pairs, each followed by ``cache_stream_bypassed`` into scratch slots past the
    cache's own; fewer scratch slots than a call may bypass (the admission's ``max_bypass`` admits the rest). Every
    third call streams only the first of its bypassed misses (``limit`` 1: the others' pairs become ``NO_ROUTE``, as
    the hybrid split's CPU share)."""
    layers, experts, slots, calls = (3, 8, 7, 40) if size == "small" else (4, 128, 80, 100)
    k, tokens = (3, 2) if size == "small" else (8, 8)
    steps = [("admit", i % layers, _routed_ids(rng, experts, tokens, k, 0.3 if i % 4 == 1 else 0.0), True)
             for i in range(calls)]
    return {"layers": layers, "experts": experts, "slots": slots, "steps": steps, "pin": (layers - 1, 1),
            "scratch": slots, "max_bypass": 2 if size == "small" else 5}


def _stream_launch(dev, st):
    st["out"] = out = []
    for _, layer, ids0, _ in st["steps"]:
        ids = dev.asarray(ids0)
        slots = ids.copy()
        ops.cache_admit_scored(slots, layer, st["experts"], st["sfi"], st["ios"], st["stamp"], st["pin"], st["clock"],
                               st["lclock"], st["last"], st["c1"], st["c2"], st["c3"], st["c4"], st["dp"], st["dp2"],
                               st["glob"], st["consts"], st["work"], st["n_work"], st["bypass"], st["n_bypass"],
                               st["hits"], st["misses"], st["bypassed"], st["err"], max_bypass=st["max_bypass"],
                               device=dev)
        ops.cache_stream_bypassed(ids, slots, layer, st["experts"], st["bypass"], st["n_bypass"], st["scratch"],
                                  st["work"], st["n_work"], st["err"], limit=_stream_limit(len(out)), device=dev)
        out.append((slots, st["work"].copy(), st["n_work"].copy()))


def _stream_limit(call: int) -> int:
    return 1 if call % 3 == 2 else -1


def _stream_setup(dev, inp):
    return {**_scored_setup(dev, inp), "scratch": inp["scratch"], "max_bypass": inp["max_bypass"]}


def _stream_fetch(dev, st):
    h = dev.to_host
    return {"slot_ids": np.concatenate([h(s).ravel() for s, _, _ in st["out"]]).astype(np.int64),
            "work": np.concatenate([h(w)[:2 * int(h(n)[0])] for _, w, n in st["out"]]).astype(np.int64),
            "err": h(st["err"]).astype(np.int64)}


def _stream_reference(inp):
    model = _scored_model(inp)
    slot_ids, work = [], []
    for call, (_, layer, ids, _) in enumerate(inp["steps"]):
        got, w, b = model.admit(layer, ids, max_bypass=inp["max_bypass"])
        got, w = stream_bypassed_reference(ids, got, layer, inp["experts"], b, inp["scratch"], w, _stream_limit(call))
        slot_ids.append(got.ravel())
        work += w
    return {"slot_ids": np.concatenate(slot_ids).astype(np.int64), "work": np.array(work, np.int64).reshape(-1),
            "err": np.zeros(1, np.int64)}


CASES += [KernelCase("cache_stream_bypassed_sequence", "cache.cu", _make_stream, _stream_setup, _stream_launch,
                     _stream_reference, fetch_fn=_stream_fetch, op="cache_stream_bypassed")]
