"""The radix prefix cache (freetoken.engine.reuse.prefix_cache) on its own, and with anchors under a model: random
interleavings of requests that share, extend, diverge from and roll back to prefixes give the logits of a fresh
computation, every block's reference count equals its holders at every step, and everything returns to the pool."""

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from reuse_checks import assert_reused_exactly, prefill_logits

from freetoken import load
from freetoken.device import get_device
from freetoken.engine.reuse.prefix_cache import RadixCache
from freetoken.models.kv import KVPool, KVSequence, kv_block_bytes

CPU = get_device("cpu")
BS = 4


def _pool(blocks=16):
    return KVPool(CPU, 1, 1, 2, blocks, "f32", block_size=BS)


def _seq(pool, ids):
    """A sequence holding ``ids`` (its K rows = the token ids, so a block's content says which tokens it holds)."""
    s = KVSequence(pool, 64)
    s.prepare(0, len(ids))
    for p, t in enumerate(ids):
        pool.k[0, s.blocks[p // BS], p % BS] = t
    s.length = len(ids)
    return s


def _rows(pool, blocks, n):
    return [float(pool.k[0, blocks[p // BS], p % BS, 0, 0]) for p in range(n)]


def test_match_full_blocks_then_the_longest_common_start_of_one_more():
    pool = _pool()
    cache = RadixCache(pool)
    a = list(range(10))  # blocks [0-3] [4-7] [8 9]
    s = _seq(pool, a)
    assert cache.insert(a, s.blocks) == 3
    blocks, n = cache.match(a + [99])
    assert n == 10 and blocks == s.blocks and _rows(pool, blocks, n) == a
    blocks, n = cache.match([0, 1, 2, 3, 4, 5, 77])  # diverges inside the second block
    assert n == 6 and blocks == s.blocks[:2]
    assert cache.match([0, 1, 2, 3, 4, 5], limit=5)[1] == 5  # the limit cuts inside a block
    assert cache.match([5, 6])[1] == 0


def test_insert_keeps_existing_blocks_and_replaces_a_partial_one_it_extends():
    pool = _pool()
    cache = RadixCache(pool)
    s1 = _seq(pool, [1, 2, 3, 4, 5, 6])  # [1-4] [5 6]
    cache.insert([1, 2, 3, 4, 5, 6], s1.blocks)
    s2 = _seq(pool, [1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert cache.insert([1, 2, 3, 4, 5, 6, 7, 8, 9], s2.blocks) == 2  # [5-8] replaces the partial [5 6]; [9]
    assert cache.nodes == 3
    blocks, n = cache.match([1, 2, 3, 4, 5, 6, 7, 8, 9, 0])
    assert n == 9 and blocks == [s1.blocks[0], *s2.blocks[1:]]
    assert pool.refs[s1.blocks[1]] == 1  # the replaced partial block: only its sequence holds it now
    assert cache.insert([1, 2, 3, 4, 5], s2.blocks) == 0  # [5] is the start of [5-8]: nothing new


def test_evict_takes_least_recently_used_leaves_nobody_else_holds():
    pool = _pool(blocks=6)
    cache = RadixCache(pool)
    old, new = _seq(pool, [1] * 8), _seq(pool, [2] * 4)
    ones, twos = list(old.blocks), list(new.blocks)
    cache.insert([1] * 8, ones)
    cache.insert([2] * 4, twos)
    new.reset()
    old.reset()
    assert pool.free_blocks == 3
    cache.match([2] * 5)  # used last: goes last
    held = _seq(pool, [3] * 4)  # a block held by a live sequence besides the tree is never evicted
    cache.insert([3] * 4, held.blocks)
    assert cache.evict(1) == 1 and pool.refs[ones[1]] == 0 and pool.refs[ones[0]] == 1  # the leaf at 4..7
    got = pool.allocate(5)  # short by two: the pool asks the cache, which evicts the rest of the 1s, then the 2s
    assert (pool.refs[ones] == 1).all() and (pool.refs[twos] == 1).all() and cache.nodes == 1
    assert cache.match([3] * 4)[1] == 4 and pool.refs[held.blocks[0]] == 2
    pool.release(got)


# ---- under a model: random interleavings ----------------------------------------------------------------------------
POOL_BLOCKS = 14  # 896 tokens: prompts of up to ~300 tokens, anchors and the tree compete for room


@pytest.fixture(scope="module")
def models():
    """The model under test (a small pool, so eviction and spilling happen) and a reference that never reuses."""
    probe = load(None, device="cpu")
    cfg = probe.config
    pool_bytes = POOL_BLOCKS * kv_block_bytes(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, "bf16")
    m = load(None, device="cpu", kv_memory=pool_bytes, ctx=POOL_BLOCKS * 64 - 64)
    m.use_anchor_dir(None, device_blocks=4, host_bytes=4 * pool_bytes // POOL_BLOCKS)
    return m, probe


def _segments(model):
    text = ["def add(a, b):\n    return a + b\n", "class Stack:\n    def __init__(self):\n        self.items = []\n",
            "import os\nimport sys\n\nprint(sys.argv)\n", "# a comment that goes on " * 6,
            "for i in range(10):\n    print(i * i)\n", "x = {'k': [1, 2, 3], 'v': None}\n" * 3]
    return [model.encode(t, add_special_tokens=False) for t in text]


def _holders(model) -> np.ndarray:
    pool = model.decoder.pool
    counts = np.zeros(pool.num_blocks, np.int64)
    for b in [*model.decoder.kv.blocks, *model.prefix_cache.held_blocks(), *model.anchors.held_blocks()]:
        counts[b] += 1
    return counts


def _check_refs(model) -> None:
    pool = model.decoder.pool
    np.testing.assert_array_equal(pool.refs, _holders(model))  # every reference is a holder, and back
    assert sorted(pool._free) == sorted(np.nonzero(pool.refs == 0)[0].tolist())


op = st.tuples(st.sampled_from(["extend", "share", "diverge", "rollback", "fresh"]),
               st.lists(st.integers(0, 5), min_size=1, max_size=4), st.integers(0, 10 ** 6))


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=st.lists(op, min_size=3, max_size=9))
def test_random_interleavings_reuse_exactly_and_release_everything(models, ops):
    model, ref = models
    segs = _segments(model)
    history: list[list[int]] = []
    anchors = []
    try:
        for kind, parts, salt in ops:
            new = [t for p in parts for t in segs[p]]
            if kind == "extend" and history:
                ids = history[-1] + new
            elif kind == "share" and history:
                base = history[salt % len(history)]
                ids = base[:max(1, (salt // 7) % len(base))] + new
            elif kind == "diverge" and history:
                base = history[-1]
                cut = max(1, (salt // 7) % len(base))
                ids = base[:cut] + [(base[cut] + 1) % 100 if cut < len(base) else 7] + new
            elif kind == "rollback" and anchors:
                a = anchors[salt % len(anchors)]
                ids = [*a.tokens.tolist(), *new]
            else:
                ids = new
            ids = ids[-(model.decoder.ctx - 8):]  # within the context
            bounds = sorted({len(ids) // 2, len(ids)})
            anchor = a.id if kind == "rollback" and anchors and a.id in model.anchors.anchors else None
            got, st = prefill_logits(model, ids, reuse_cache=True, boundaries=bounds, anchor=anchor)
            assert_reused_exactly(model, ref, ids, got, st.cached_tokens)
            assert st.anchor_refused is None
            assert st.cached_tokens + st.prompt_tokens == len(ids)
            _check_refs(model)
            history.append(ids)
            anchors.extend(model.anchors.get(i) for i in st.anchors_made)
            anchors = [x for x in anchors if x is not None and x.id in model.anchors.anchors][-6:]
    finally:
        model.anchors.clear()
        model.prefix_cache.clear()
        model.decoder.reset()
        model.cached_ids = []
    pool = model.decoder.pool
    assert (pool.refs == 0).all() and pool.free_blocks == pool.num_blocks


@pytest.mark.slow  # ~3 min on 2 cores: two emu models, five prompts
def test_share_extend_diverge_rollback_on_emu():
    """The same checks on the emulated GPU, one fixed interleaving: a fresh prompt, an extension of it, one that
    diverges inside a block, a side prompt, then back to an anchor made before the divergence (spilled to host)."""
    from freetoken.device import device_status

    if not device_status()["emu"][0]:
        pytest.fail("the emu device is unavailable: " + str(device_status()["emu"][1]))
    model, ref = load(None, device="emu"), load(None, device="emu")
    segs = _segments(model)
    a = segs[0] + segs[1] + segs[3]
    steps = [(a, [len(a) - 9]), (a + segs[2], []), (a[:70] + [5] + segs[4], []), (segs[5], [])]
    for ids, bounds in steps:
        got, st = prefill_logits(model, ids, reuse_cache=True, boundaries=bounds)
        want = ref.logits(ids)[-1]
        # a reused prefix was computed in another pass: the emu's bf16 tensor-core tiles round otherwise
        assert float(((got - want) ** 2).sum() / (want ** 2).sum()) < 1e-5
        _check_refs(model)
    anchor = model.anchors.list()[0]
    model.anchors._to_host(anchor)
    model.prefix_cache.clear()
    ids = [*anchor.tokens.tolist(), *segs[2]]
    got, st = prefill_logits(model, ids, reuse_cache=True, boundaries=[anchor.length])
    assert st.anchor == anchor.id and st.cached_tokens == anchor.length
    want = ref.logits(ids)[-1]
    assert float(((got - want) ** 2).sum() / (want ** 2).sum()) < 1e-5
    _check_refs(model)
