"""freetoken.trace: the trace file, the recorder, the synthetic generator, the cache policies and the CLI."""

from __future__ import annotations

import functools
import itertools
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from freetoken.cli import main as trace_main
from freetoken.sim import POLICIES, format_table, simulate
from freetoken.sim import policies as P
from freetoken.trace import Trace, TraceError, TraceRecorder, load_trace, make_trace, prepare, save_trace

ROOT = Path(__file__).resolve().parents[1]


def _trace(ids, segs=None, L=None, E=4, record_bytes=100, nseg=None) -> Trace:
    """A trace from decode ids [steps, layers, tokens, k]; prefill counts are zero."""
    ids = np.asarray(ids, np.int32)
    steps, layers, _, k = ids.shape
    segs = np.zeros(steps, np.int32) if segs is None else np.asarray(segs, np.int32)
    nseg = int(segs.max()) + 1 if nseg is None else nseg
    return Trace(decode_ids=ids, step_segment=segs, prefill_counts=np.zeros((nseg, layers, E), np.int32),
                 num_experts=E, num_layers=layers, top_k=k, record_bytes=record_bytes).validate()


def _one_token(calls_per_step):
    """[steps][layers] lists of expert ids (one token) -> ids [steps, layers, 1, k]."""
    return np.asarray(calls_per_step, np.int32)[:, :, None, :]


# --------------------------------------------------------------------------------------------- file format


def test_save_load_round_trip(tmp_path):
    t = make_trace(num_layers=3, num_experts=10, top_k=2, steps=20, segments=3, locality=0.5, seed=1,
                   record_bytes=1234, tokens=2)
    t.model = "tiny-moe"
    path = tmp_path / "t.trace"  # any name: save_trace does not append .npz
    save_trace(path, t)
    assert path.exists()
    u = load_trace(path)
    assert u.decode_ids.dtype == np.int16 and u.step_segment.dtype == np.int32
    np.testing.assert_array_equal(u.decode_ids, t.decode_ids)
    np.testing.assert_array_equal(u.step_segment, t.step_segment)
    np.testing.assert_array_equal(u.prefill_counts, t.prefill_counts)
    assert (u.num_experts, u.num_layers, u.top_k, u.record_bytes, u.model, u.version) == (10, 3, 2, 1234,
                                                                                          "tiny-moe", 1)
    assert (u.steps, u.tokens, u.num_segments, u.num_flat) == (20, 2, 3, 30)


def _good_fields():
    return {
        "decode_ids": np.array([[[[0, 1]], [[2, 3]]], [[[1, 2]], [[0, 3]]]], np.int16),  # [2, 2, 1, 2]
        "step_segment": np.array([0, 1], np.int32),
        "prefill_counts": np.zeros((2, 2, 4), np.int32),
        "version": np.int64(1), "num_experts": np.int64(4), "num_layers": np.int64(2), "top_k": np.int64(2),
        "record_bytes": np.int64(10),
    }


BAD_FILES = [
    ("missing decode_ids", lambda f: f.pop("decode_ids"), "missing field 'decode_ids'"),
    ("missing scalars", lambda f: (f.pop("top_k"), f.pop("version")), "missing fields 'version', 'top_k'"),
    ("unknown version", lambda f: f.update(version=np.int64(7)), "field 'version': unknown trace version 7"),
    ("ids shape", lambda f: f.update(decode_ids=np.zeros((2, 3, 1, 2), np.int16)),
     "field 'decode_ids': shape (2, 3, 1, 2) does not match"),
    ("ids ndim", lambda f: f.update(decode_ids=np.zeros((2, 2, 2), np.int16)), "field 'decode_ids': must have 4"),
    ("ids float", lambda f: f.update(decode_ids=np.zeros((2, 2, 1, 2), np.float32)),
     "field 'decode_ids': must be an integer array"),
    ("id too big", lambda f: f["decode_ids"].__setitem__((1, 0, 0, 1), 4),
     "field 'decode_ids': expert id 4 out of range [0, 4) (first at [step, layer, token, k] = [1, 0, 0, 1])"),
    ("id negative", lambda f: f["decode_ids"].__setitem__((0, 1, 0, 0), -1), "expert id -1 out of range"),
    ("repeated id", lambda f: f["decode_ids"].__setitem__((0, 1, 0, 0), 3),
     "field 'decode_ids': repeated expert id within one token's top-k"),
    ("segment shape", lambda f: f.update(step_segment=np.zeros(3, np.int32)), "field 'step_segment': shape (3,)"),
    ("segment range", lambda f: f.update(step_segment=np.array([0, 2], np.int32)),
     "field 'step_segment': segment index out of range [0, 2)"),
    ("segment order", lambda f: f.update(step_segment=np.array([1, 0], np.int32)),
     "field 'step_segment': segment indices must be non-decreasing"),
    ("prefill shape", lambda f: f.update(prefill_counts=np.zeros((2, 2, 5), np.int32)),
     "field 'prefill_counts': shape (2, 2, 5) does not match"),
    ("prefill negative", lambda f: f["prefill_counts"].__setitem__((0, 0, 0), -1),
     "field 'prefill_counts': counts must be non-negative"),
    ("top_k scalar", lambda f: f.update(top_k=np.array([2, 2])), "field 'top_k': must be an integer scalar"),
    ("experts zero", lambda f: f.update(num_experts=np.int64(0)), "field 'num_experts': must be >= 1"),
    ("model type", lambda f: f.update(model=np.array([1, 2])), "field 'model': must be a string"),
]


@pytest.mark.parametrize("mutate,message", [b[1:] for b in BAD_FILES], ids=[b[0] for b in BAD_FILES])
def test_load_validation_errors(tmp_path, mutate, message):
    fields = _good_fields()
    path = tmp_path / "bad.npz"
    np.savez(path, **fields)
    load_trace(path)  # the unmodified file is fine
    mutate(fields)
    np.savez(path, **fields)
    with pytest.raises(TraceError) as e:
        load_trace(path)
    assert str(e.value).startswith(f"trace file {path}: ")
    assert message in str(e.value)


def test_load_unreadable_files(tmp_path):
    with pytest.raises(TraceError, match="no such file"):
        load_trace(tmp_path / "nope.npz")
    junk = tmp_path / "junk.npz"
    junk.write_bytes(b"this is not a zip archive")
    with pytest.raises(TraceError, match=r"junk.npz: not a readable \.npz archive"):
        load_trace(junk)
    npy = tmp_path / "array.npy"
    np.save(npy, np.zeros(3))
    with pytest.raises(TraceError, match=r"array.npy: not an \.npz archive \(it holds a single ndarray\)"):
        load_trace(npy)
    with pytest.raises(TraceError, match="not a readable"):
        load_trace(tmp_path)  # a directory


def test_save_validates():
    t = _trace(_one_token([[[0, 1]]]))
    t.decode_ids = t.decode_ids + 4
    with pytest.raises(TraceError, match=r"^trace: field 'decode_ids': expert id 5 out of range"):
        save_trace("/nonexistent/never-written.npz", t)


def test_recorder(tmp_path):
    rec = TraceRecorder(num_layers=2, num_experts=4, top_k=2, record_bytes=64, model="m")
    with pytest.raises(RuntimeError, match="begin_segment"):
        rec.add_prefill(0, np.array([[0, 1]]))
    assert rec.begin_segment() == 0
    rec.add_prefill(0, np.array([[0, 1], [1, 2], [1, 3]]))
    rec.add_prefill(0, np.array([[3, 1]]))  # chunked prefill adds up
    rec.add_prefill(1, [[2, 3]])
    rec.add_decode_step([np.array([[0, 1]]), np.array([[2, 3]])])
    rec.add_decode_step([np.array([[1, 2]]), np.array([[3, 0]])])
    assert rec.begin_segment() == 1  # a segment without decode steps
    rec.add_prefill(1, np.array([[0, 1]]))
    rec.begin_segment()
    rec.add_decode_step([np.array([[3, 2]]), np.array([[0, 1]])])
    with pytest.raises(ValueError, match="out of range"):
        rec.add_prefill(0, np.array([[0, 4]]))
    with pytest.raises(ValueError, match="layer 2 out of range"):
        rec.add_prefill(2, np.array([[0, 1]]))
    with pytest.raises(ValueError, match="expected 2 layers"):
        rec.add_decode_step([np.array([[0, 1]])])
    with pytest.raises(ValueError, match=r"shape \[tokens, top_k=2\]"):
        rec.add_decode_step([np.array([0, 1]), np.array([[0, 1]])])
    with pytest.raises(ValueError, match="decode batch changed from 1 to 2"):
        rec.add_decode_step([np.array([[0, 1], [2, 3]])] * 2)
    t = rec.save(tmp_path / "rec.npz")
    u = load_trace(tmp_path / "rec.npz")
    assert (u.steps, u.num_segments, u.tokens, u.model, u.record_bytes) == (3, 3, 1, "m", 64)
    np.testing.assert_array_equal(u.step_segment, [0, 0, 2])
    np.testing.assert_array_equal(u.decode_ids[:, :, 0], [[[0, 1], [2, 3]], [[1, 2], [3, 0]], [[3, 2], [0, 1]]])
    np.testing.assert_array_equal(u.prefill_counts[0], [[1, 4, 1, 2], [0, 0, 1, 1]])
    np.testing.assert_array_equal(u.prefill_counts[1], [[0, 0, 0, 0], [1, 1, 0, 0]])
    np.testing.assert_array_equal(u.prefill_counts[2], 0)
    np.testing.assert_array_equal(t.decode_ids, u.decode_ids)


def test_recorder_add_segment_is_the_three_calls():
    """add_segment(prefill, decode) records what begin_segment + add_prefill per layer + add_decode_step per step
    do (one generation's stats)."""
    prefill = [np.array([[0, 1], [1, 2]]), np.array([[2, 3]])]
    decode = [[np.array([[0, 1]]), np.array([[2, 3]])], [np.array([[1, 2]]), np.array([[3, 0]])]]
    one = TraceRecorder(num_layers=2, num_experts=4, top_k=2, record_bytes=64)
    assert one.add_segment(prefill, decode) == 0 and one.add_segment(prefill[:1], []) == 1
    by_hand = TraceRecorder(num_layers=2, num_experts=4, top_k=2, record_bytes=64)
    by_hand.begin_segment()
    for layer, ids in enumerate(prefill):
        by_hand.add_prefill(layer, ids)
    for step in decode:
        by_hand.add_decode_step(step)
    by_hand.begin_segment()
    by_hand.add_prefill(0, prefill[0])
    a, b = one.to_trace(), by_hand.to_trace()
    for field in ("decode_ids", "step_segment", "prefill_counts"):
        np.testing.assert_array_equal(getattr(a, field), getattr(b, field))


# ------------------------------------------------------------------------------------------------ synthetic


def test_synthetic_properties():
    t = make_trace(num_layers=4, num_experts=16, top_k=4, steps=2001, segments=4, locality=0.8, seed=3, tokens=2)
    assert t.decode_ids.shape == (2001, 4, 2, 4)
    np.testing.assert_array_equal(np.bincount(t.step_segment), [501, 500, 500, 500])
    srt = np.sort(t.decode_ids, -1)
    assert (srt[..., 1:] != srt[..., :-1]).all()  # distinct top-k
    assert (t.prefill_counts.sum(-1) == 256 * 4).all()
    again = make_trace(num_layers=4, num_experts=16, top_k=4, steps=2001, segments=4, locality=0.8, seed=3, tokens=2)
    np.testing.assert_array_equal(t.decode_ids, again.decode_ids)
    # temporal correlation: the fraction of a token's experts kept from the previous step tracks locality
    same = t.decode_ids[1:] == t.decode_ids[:-1]  # positions that kept their expert
    assert 0.78 < same.mean() < 0.9  # kept with p=0.8, plus fresh draws that happen to coincide
    cold = make_trace(num_layers=4, num_experts=16, top_k=4, steps=2000, segments=4, locality=0.0, seed=3)
    assert (cold.decode_ids[1:] == cold.decode_ids[:-1]).mean() < 0.2  # only chance coincidences
    # prefill counts predict the segment's decode routing
    for s in range(4):
        dec = np.zeros((4, 16))
        for layer in range(4):
            dec[layer] = np.bincount(t.decode_ids[t.step_segment == s, layer].ravel(), minlength=16)
        corr = np.corrcoef(dec.ravel(), t.prefill_counts[s].ravel())[0, 1]
        assert corr > 0.5


def test_synthetic_argument_errors():
    with pytest.raises(ValueError, match="locality"):
        make_trace(locality=1.5)
    with pytest.raises(ValueError, match="top_k 9 exceeds"):
        make_trace(num_experts=8, top_k=9)


# ---------------------------------------------------------------------------------------------------- LRU


def _lru_reference(trace: Trace, slots: int, prefill_borrow: bool = True):
    """The device LRU written out literally (O(S) per miss): per-step misses and the final id_of_slot."""
    E = trace.num_experts
    slot_of = {}
    owner = np.full(slots, -1)
    recency = np.full(slots, -1)
    clock = 0
    misses = []
    for t in range(trace.steps):
        if prefill_borrow and (t == 0 or trace.step_segment[t] != trace.step_segment[t - 1]):
            for s in range(min(2 * E, slots)):
                if owner[s] >= 0:
                    del slot_of[owner[s]]
                owner[s], recency[s] = -1, -1
        m = 0
        for layer in range(trace.num_layers):
            clock += 1
            active = sorted({layer * E + int(e) for e in trace.decode_ids[t, layer].ravel()})
            for f in active:
                if f in slot_of:
                    recency[slot_of[f]] = clock
            for f in active:
                if f in slot_of:
                    continue
                held = {slot_of[g] for g in active if g in slot_of}
                eligible = [s for s in range(slots) if s not in held]
                v = min(eligible, key=lambda s: (recency[s], s))
                if owner[v] >= 0:
                    del slot_of[owner[v]]
                owner[v], slot_of[f], recency[v] = f, v, clock
                m += 1
        misses.append(m)
    return np.array(misses), owner


def test_lru_hand_worked_ties_and_recency():
    # 2 layers x 4 experts (layer 1's flat ids are 4..7), top-2, 4 slots, no borrowing.
    t = _trace(_one_token([[[0, 1], [2, 3]],    # c1: 0->s0, 1->s1 (empty slots, ties->lowest); c2: 6->s2, 7->s3
                           [[2, 1], [0, 3]],    # c3: hit 1; 2 -> s0 (rec 1) evicts 0.  c4: hit 7; 4 -> s2 (rec 2)
                           [[3, 0], [0, 3]]]),  # c5: 0 -> s0 (s0, s1 tie at rec 3 -> lowest), 3 -> s1.  c6: hits
               L=2, E=4)
    misses, owner = P.lru_replay(t, 4, prefill_borrow=False)
    assert misses.tolist() == [4, 2, 2]
    assert owner.tolist() == [0, 3, 4, 7]
    r = P.lru(t, 4, window="all", prefill_borrow=False)
    assert (r.accesses, r.misses, r.loads, r.bytes_moved) == (12, 8, 8, 800)
    assert r.miss_rate == pytest.approx(8 / 12)
    r2 = P.lru(t, 4, window="second_half", prefill_borrow=False)  # steps 1..2
    assert (r2.window, r2.accesses, r2.misses) == ("second_half", 8, 4)


def test_lru_never_evicts_an_active_id():
    # 1 layer, top-2, 2 slots (= the active set size).
    t = _trace(_one_token([[[0, 1]],    # c1: 0->s0, 1->s1
                           [[1, 2]],    # c2: hit 1 (s1 now rec 2); 2 -> s0, evicting 0
                           [[0, 2]],    # c3: hit 2 in s0; 0 -> s1 although s0 and s1 tied at rec 2 before the hit
                           [[0, 1]]]),  # c4: hit 0 in s1; 1 -> s0, evicting 2
               L=1, E=4)
    misses, owner = P.lru_replay(t, 2, prefill_borrow=False)
    assert misses.tolist() == [2, 1, 1, 1]
    assert owner.tolist() == [1, 0]
    with pytest.raises(ValueError, match=r"largest active set \(2"):
        P.lru(t, 1)


def test_lru_prefill_borrowing():
    # 3 layers x 2 experts (flat = 2 * layer + e), top-1, 5 slots; prefill borrows slots 0..3 per segment.
    # Segment 1 has no decode steps; segments 0 -> 2 is one segment change (borrowing twice = once).
    calls = _one_token([[[0], [0], [0]],    # c1-3: 0->s0, 2->s1, 4->s2
                        [[1], [0], [1]],    # c4: 1->s3 (empty, lowest)  c5: hit 2  c6: 5->s4
                        [[0], [1], [1]],    # borrow empties s0..s3 (owners 0,2,4,1). c7: 0->s0  c8: 3->s1  c9: hit 5
                        [[1], [0], [0]]])   # c10: 1->s2  c11: 2->s3  c12: 4 -> s0 (rec 7, the least recent)
    t = _trace(calls, segs=[0, 0, 2, 2], L=3, E=2, nseg=3)
    misses, owner = P.lru_replay(t, 5, prefill_borrow=True)
    assert misses.tolist() == [3, 2, 2, 3]
    assert owner.tolist() == [4, 3, 1, 2, 5]
    # without borrowing: c7 hit 0; c8: 3 -> s2 (rec 3) evicts 4; c9 hit 5; c10 hit 1; c11 hit 2; c12: 4 -> s0
    misses, owner = P.lru_replay(t, 5, prefill_borrow=False)
    assert misses.tolist() == [3, 2, 1, 1]
    assert owner.tolist() == [4, 2, 3, 1, 5]
    assert P.lru(t, 5, window="all").misses == 10
    assert P.lru(t, 5, window="all", prefill_borrow=False).misses == 7


def test_lru_batch_tokens_share_accesses():
    # 1 layer, 2 tokens, top-2, 3 slots: the active set is the union of the tokens' ids
    t = _trace([[[[0, 1], [1, 2]]],    # active {0,1,2}: s0, s1, s2
                [[[2, 3], [3, 0]]]],   # active {0,2,3}: hits 0, 2; 3 -> s1 evicting 1
               L=1, E=4)
    misses, owner = P.lru_replay(t, 3, prefill_borrow=False)
    assert misses.tolist() == [3, 1] and owner.tolist() == [0, 3, 2]
    assert P.lru(t, 3, window="all").accesses == 6
    with pytest.raises(ValueError, match="largest active set"):
        P.lru(t, 2)


@pytest.mark.parametrize("seed", range(6))
def test_lru_matches_literal_reference(seed):
    rng = np.random.default_rng(seed)
    tokens = int(rng.integers(1, 3))
    t = make_trace(num_layers=3, num_experts=5, top_k=2, steps=60, segments=int(rng.integers(1, 5)),
                   locality=float(rng.random()), seed=seed, tokens=tokens)
    for slots in (4, 7, 12, 16):
        for borrow in (True, False):
            want_m, want_owner = _lru_reference(t, slots, borrow)
            got_m, got_owner = P.lru_replay(t, slots, borrow)
            np.testing.assert_array_equal(got_m, want_m)
            np.testing.assert_array_equal(got_owner, want_owner)


# ------------------------------------------------------------------------------------------------- Belady


def _brute_force_misses(seq, slots, block_starts):
    """Minimum misses over every cache schedule: free contents at each block start, then on each miss bypass,
    insert into a free slot, or evict any resident id. Exhaustive (memoised) search."""
    bounds = list(block_starts) + [len(seq)]
    total = 0
    for b0, b1 in itertools.pairwise(bounds):
        block = tuple(seq[b0:b1])

        @functools.cache
        def best(i, state, block=block):
            if i == len(block):
                return 0
            f = block[i]
            if f in state:
                return best(i + 1, state)
            options = [best(i + 1, state)]  # bypass
            if len(state) < slots:
                options.append(best(i + 1, state | {f}))
            options += [best(i + 1, (state - {y}) | {f}) for y in state]
            return 1 + min(options)

        ids = sorted(set(block))
        starts = itertools.chain.from_iterable(itertools.combinations(ids, r) for r in range(min(slots, len(ids)) + 1))
        total += min(best(0, frozenset(c)) for c in starts)
    return total


def test_belady_matches_brute_force():
    rng = np.random.default_rng(0)
    for _ in range(60):
        n = int(rng.integers(1, 13))
        ids = int(rng.integers(2, 6))
        seq = rng.integers(0, ids, n)
        slots = int(rng.integers(0, 4))
        starts = [0] + sorted(set(rng.integers(1, n, int(rng.integers(0, 3))).tolist())) if n > 1 else [0]
        for blocks in ([0], starts):
            misses, inserted, placed = P.belady_sequence(seq, slots, blocks, ids)
            assert misses == _brute_force_misses(seq.tolist(), slots, blocks), (seq, slots, blocks)
            assert 0 <= inserted <= misses and 0 <= placed <= slots * len(blocks)


def test_belady_hand_example():
    # 2 slots; the free initial contents are the first two ids used, {0, 1}. At index 2, id 2 (next use 4) evicts
    # 1 (next use 5); the last access, 1, is never used again: bypassed. Loads: 2 placed + 1 inserted.
    seq = [0, 1, 2, 0, 2, 1]
    assert P.belady_sequence(np.array(seq), 2) == (2, 1, 2)
    assert _brute_force_misses(seq, 2, [0]) == 2
    # blocks [0, 3) and [3, 6): 2 is bypassed in the first block (no later use there); the refill places {0, 2}
    # (one new record); the final 1 is bypassed
    assert P.belady_sequence(np.array(seq), 2, [0, 3]) == (2, 0, 3)
    assert P.belady_sequence(np.array(seq), 3, [0, 3]) == (0, 0, 3)


def _belady_reference(seq, slots):
    """Belady with bypass and free initial contents, O(n S)."""
    inf = len(seq) + 1
    nxt, last = [inf] * len(seq), {}
    for i in range(len(seq) - 1, -1, -1):
        nxt[i], last[seq[i]] = last.get(seq[i], inf), i
    cache = {}
    for i, f in enumerate(seq):  # the first `slots` distinct ids, keyed by their first use
        if len(cache) == slots:
            break
        cache.setdefault(f, i)
    misses = 0
    for i, f in enumerate(seq):
        if f in cache:
            cache[f] = nxt[i]
            continue
        misses += 1
        if nxt[i] == inf or slots == 0:
            continue
        far = max(cache, key=cache.get)
        if cache[far] > nxt[i]:
            del cache[far]
            cache[f] = nxt[i]
    return misses


def test_belady_long_sequences():
    # many hits per slot: exercises the lazy-deletion heap and its rebuilds
    rng = np.random.default_rng(1)
    seq = (rng.zipf(1.3, 20000) % 50).astype(np.int32)
    for slots in (0, 1, 3, 8, 30):
        assert P.belady_sequence(seq, slots)[0] == _belady_reference(seq.tolist(), slots)


# -------------------------------------------------------------------------------------- policy properties


@pytest.mark.parametrize("seed", range(5))
def test_belady_is_a_lower_bound(seed):
    rng = np.random.default_rng(seed)
    t = make_trace(num_layers=3, num_experts=8, top_k=2, steps=80, segments=int(rng.integers(1, 6)),
                   locality=float(rng.random()), seed=seed, tokens=int(rng.integers(1, 3)), prefill_tokens=16)
    lo = prepare(t).max_active
    for slots in (lo, 6, 10, 16, 24):
        for window in ("all", "second_half"):
            rows = simulate(t, [slots], window=window, policies=list(POLICIES))
            rows += simulate(t, [slots], window=window, policies=["lru"], prefill_borrow=False)
            for r in rows:
                bound = P.belady(t, slots, r["window"])
                assert bound.accesses == r["accesses"]
                assert bound.misses <= r["misses"], (r, bound)
                if r["policy"] not in ("prefill_placement", "belady"):  # these may re-place at segment starts
                    assert P.belady_start(t, slots, r["window"]).misses <= r["misses"], r


def test_static_policies():
    t = make_trace(num_layers=2, num_experts=6, top_k=2, steps=50, segments=2, locality=0.5, seed=0)
    r = P.static_frequency(t, 12, window="all")
    assert (r.window, r.misses, r.loads) == ("second_half", 0, 12)
    assert r.accesses == prepare(t).step_offsets[-1] - prepare(t).step_offsets[25]
    assert P.static_frequency(t, 100).misses == 0
    assert P.static_frequency(t, 0).misses == r.accesses
    # routing_blind with S = L * E holds everything; with S < L holds nothing
    assert P.routing_blind(t, 12).misses == 0 and P.routing_blind(t, 1).misses == P.routing_blind(t, 1).accesses
    # prefill placement of everything: no misses; loads = one placement
    assert P.prefill_placement(t, 12, window="all").misses == 0
    assert P.prefill_placement(t, 12, window="all").loads == 12


def test_static_frequency_hand_example():
    # 1 layer x 4 experts, top-1; first half accesses 2, 2, 1 -> place {2} (S=1), {1, 2} (S=2);
    # ties at 0 count between 0 and 3 -> lower id (0) for S=3
    t = _trace(_one_token([[[2]], [[2]], [[1]], [[3]], [[2]], [[0]]]), L=1, E=4)
    assert P.static_frequency(t, 1).misses == 2  # window: 3, 2, 0
    assert P.static_frequency(t, 2).misses == 2
    assert P.static_frequency(t, 3).misses == 1  # {0, 1, 2}: 3 misses
    assert P.routing_blind(t, 1).misses == 2  # expert 0 only
    assert P.belady(t, 1, "second_half").misses == 2


def test_prefill_placement_hand_example():
    # 1 layer x 4 experts, top-1, 2 slots; segment 0 prefers {3, 1}, segment 1 {0, 2} (tie 0/2 vs 3 -> lower ids)
    ids = _one_token([[[3]], [[1]], [[2]], [[0]], [[2]], [[3]]])
    t = _trace(ids, segs=[0, 0, 0, 1, 1, 1], L=1, E=4)
    t.prefill_counts = np.array([[[0, 5, 1, 7]], [[4, 0, 4, 4]]], np.int32)
    r = P.prefill_placement(t, 2, window="all")
    assert (r.misses, r.loads) == (1 + 1, 2 + 2)
    r = P.prefill_placement(t, 2, window="second_half")  # steps 3..5, all in segment 1
    assert (r.misses, r.loads) == (1, 2)


def test_simulate_and_table():
    t = make_trace(num_layers=4, num_experts=8, top_k=2, steps=100, segments=2, locality=0.5, seed=0)
    rows = simulate(t, [8, 16], window="all")
    assert [(r["slots"], r["policy"]) for r in rows[:5]] == [(8, p) for p in P.DEFAULT_POLICIES]
    assert {r["window"] for r in rows} == {"all", "second_half"}
    text = format_table(rows)
    assert "miss rate" in text and "GB moved" in text and "belady" in text
    with pytest.raises(ValueError, match="unknown policy nope"):
        simulate(t, [8], policies=["nope"])
    with pytest.raises(ValueError, match="unknown window"):
        simulate(t, [8], window="first_half")


def test_summary_hand_example():
    from freetoken.sim.simulate import format_summary, summarize

    # 1 layer x 4 experts, top-1: ids 0 1 0 2 | 0 0 (segments 0 and 2; segment 1 has no decode steps)
    t = _trace(_one_token([[[0]], [[1]], [[0]], [[2]], [[0]], [[0]]]), segs=[0, 0, 0, 0, 2, 2], L=1, E=4, nseg=3)
    s = summarize(t)
    assert (s["accesses"], s["distinct_ids"], s["max_active"], s["segments_without_decode"]) == (6, 3, 1, 1)
    assert s["hot_set"] == {0.5: 1, 0.9: 3, 0.99: 3}
    assert s["working_set"] == {1: 1.0}  # windows longer than the trace are left out
    assert s["segment_working_set"] == (1, 2.0, 3)
    p = np.array([4, 1, 1, 0]) / 6
    assert s["entropy_bits"][0] == pytest.approx(-(p[:3] * np.log2(p[:3])).sum())
    assert "3 of 4 flat ids used" in format_summary(s)


# ------------------------------------------------------------------------------------------------------ CLI


def test_cli_end_to_end(tmp_path, capsys):
    path = tmp_path / "syn.npz"
    assert trace_main(["trace", "synth", str(path), "--layers", "4", "--experts", "16", "--top-k", "2", "--steps",
                       "300", "--segments", "3", "--locality", "0.7", "--seed", "5", "--record-bytes", "1000"]) == 0
    assert "wrote" in capsys.readouterr().out
    t = load_trace(path)
    assert t.decode_ids.shape == (300, 4, 1, 2) and t.record_bytes == 1000
    png = tmp_path / "miss.png"
    assert trace_main(["trace", "simulate", str(path), "--slots", "8,16,32", "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    for name in P.DEFAULT_POLICIES:
        assert name in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 1000
    assert trace_main(["trace", "simulate", str(path), "--slots", "16", "--window", "all", "--no-prefill-borrow",
                       "--policies", "lru,belady_start"]) == 0
    out = capsys.readouterr().out
    assert "no prefill borrowing" in out and "belady_start" in out and "static_frequency" not in out
    assert trace_main(["trace", "simulate", str(path), "--slots", "16", "--policies", "belady", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["policy"], r["slots"], r["window"]) for r in rows] == [("belady", 16, "second_half")]
    assert trace_main(["trace", "info", str(path)]) == 0
    out = capsys.readouterr().out
    assert "300 steps x 4 MoE layers" in out and "entropy" in out and "distinct ids per window" in out


def test_cli_errors(tmp_path, capsys):
    bad = tmp_path / "bad.npz"
    fields = _good_fields()
    fields["decode_ids"][0, 0, 0, 0] = 9
    np.savez(bad, **fields)
    for argv in (["trace", "simulate", str(bad), "--slots", "4"], ["trace", "info", str(bad)],
                 ["trace", "info", str(tmp_path / "missing.npz")]):
        assert trace_main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith("freetoken trace: error: trace file ") and "Traceback" not in err
    good = tmp_path / "good.npz"
    np.savez(good, **_good_fields())
    assert trace_main(["trace", "simulate", str(good), "--slots", "1"]) == 2  # lru needs 2 slots
    assert "largest active set" in capsys.readouterr().err
    assert trace_main(["trace", "simulate", str(good), "--slots", "4", "--policies", "fifo"]) == 2
    assert "unknown policy fifo" in capsys.readouterr().err
    assert trace_main(["trace"]) == 2
    # through a real process: a clean message, no traceback
    proc = subprocess.run([sys.executable, "-m", "freetoken", "trace", "simulate", str(bad), "--slots", "4"],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 2
    assert "field 'decode_ids': expert id 9 out of range" in proc.stderr and "Traceback" not in proc.stderr
