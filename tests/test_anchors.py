"""Anchors (freetoken.engine.reuse.anchors): made at message boundaries, restored only after every check, and refused
with a reason (the request then recomputed, its logits those of a fresh run) when a check fails: bytes changed on the
device, a flipped byte or a torn anchor file, another model's anchor, a forged id whose tokens differ."""

import pytest
from reuse_checks import assert_reuse_close, prefill_logits

from freetoken import load
from freetoken.engine.decoding.sampling import SamplingParams
from freetoken.engine.reuse.anchors import (
    BLOCK_MAGIC,
    BLOCK_SUFFIX,
    FILE_MAGIC,
    FILE_SUFFIX,
    anchor_id,
    read_frame,
    write_frame,
)

GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def ref():
    return load(None, device="cpu")


@pytest.fixture
def model(ref):
    m = load(None, device="cpu")
    yield m
    m.anchors.clear()


def _prompt(model, n_lines=12):
    text = "".join(f"def f{i}(x):\n    return x * {i}\n\n" for i in range(n_lines))
    return model.encode(text, add_special_tokens=False)


def _forget(model):
    """Nothing reusable but the anchors: the decoder's sequence and the prefix cache emptied."""
    model.prefix_cache.clear()
    model.decoder.reset()
    model.cached_ids = []


def _close(got, want):
    assert_reuse_close(got, want)


def _anchored(model, ids, at):
    list(gen := model.generate(ids, max_tokens=1, sampling=GREEDY, reuse_cache=True, boundaries=[at]))
    (aid,) = gen.stats.anchors_made
    return model.anchors.get(aid)


def test_restore_from_each_tier_is_verified_and_exact(model, ref, tmp_path):
    store = model.use_anchor_dir(tmp_path, sample_blocks=2)
    ids = _prompt(model)
    a = _anchored(model, ids, 150)
    assert a.tier == "device" and a.length == 150 and (tmp_path / f"{a.id}{FILE_SUFFIX}").is_file()
    assert a.id == anchor_id(model.fingerprint, ids[:150])
    longer = ids + model.encode("print(f3(2))\n", add_special_tokens=False)
    want = ref.logits(longer)[-1]
    for tier in ("device", "host", "disk"):
        if tier != "device" and a.blocks is not None:
            store._to_host(a)
        if tier == "disk":
            store._drop_host(a)  # as if the host budget had dropped it: the files are left
        _forget(model)
        assert a.tier == tier
        got, st = prefill_logits(model, longer, reuse_cache=True, boundaries=[150])
        assert st.anchor == a.id and st.cached_tokens == 150, tier
        _close(got, want)
        assert a.tier == ("device" if tier == "device" else "host")  # a disk anchor read back stays in host memory
    assert store.refusals == []


def test_changed_bytes_on_the_device_are_refused(model, ref):
    store = model.use_anchor_dir(None, sample_blocks=99)  # every block checked
    ids = _prompt(model)
    a = _anchored(model, ids, 130)
    _forget(model)
    pool = model.decoder.pool
    pool.k[3, a.blocks[1], 5, 0, 7] ^= 0x0040  # a bit flipped in layer 3's keys
    got, st = prefill_logits(model, ids, reuse_cache=True, boundaries=[130])
    assert st.anchor is None and st.cached_tokens == 0
    assert "block 1 changed" in st.anchor_refused and store.refusals[-1][0] == a.id
    _close(got, ref.logits(ids)[-1])
    # the bad anchor left the store: that request made a sound one at the same boundary, which the next restores
    assert st.anchors_made == [a.id] and store.get(a.id) is not a
    _forget(model)
    _, st = prefill_logits(model, ids, reuse_cache=True, boundaries=[130])
    assert st.anchor == a.id and st.cached_tokens == 130


@pytest.mark.parametrize("damage", ["flip_block", "flip_anchor", "truncate", "foreign", "garbage"])
def test_damaged_or_foreign_files_are_refused(ref, tmp_path, damage):
    first = load(None, device="cpu")
    first.use_anchor_dir(tmp_path)
    ids = _prompt(first)
    a = _anchored(first, ids, 140)
    path = tmp_path / f"{a.id}{FILE_SUFFIX}"
    block = tmp_path / "blocks" / f"{a.sums[1]}{BLOCK_SUFFIX}"
    assert block.is_file() and len(list((tmp_path / "blocks").iterdir())) == len(a.sums)
    if damage == "flip_block":  # a KV byte of the second block
        raw = bytearray(block.read_bytes())
        raw[-1000] ^= 0x01
        block.write_bytes(bytes(raw))
    elif damage == "flip_anchor":  # a token id of the anchor file
        raw = bytearray(path.read_bytes())
        raw[-40] ^= 0x01
        path.write_bytes(bytes(raw))
    elif damage == "truncate":
        path.write_bytes(path.read_bytes()[:-30])
    elif damage == "foreign":
        # a file another model made: same layout, another fingerprint (its id made with it, so only that differs)
        header, arrays = read_frame(path, FILE_MAGIC)
        other = "0" * 64
        header = {k: v for k, v in dict(header, fingerprint=other, id=anchor_id(other, arrays["tokens"])).items()
                  if k != "arrays"}
        path.unlink()
        write_frame(tmp_path / f"{header['id']}{FILE_SUFFIX}", FILE_MAGIC, header, [arrays["tokens"]], ["tokens"])
    else:
        raw = bytearray(path.read_bytes())
        raw[:8] = b"NOTANCHR"
        path.write_bytes(bytes(raw))

    restarted = load(None, device="cpu")  # a new server on the same directory
    store = restarted.use_anchor_dir(tmp_path)
    got, st = prefill_logits(restarted, ids, reuse_cache=True, boundaries=[140])
    why = " ".join(w for _, w in store.refusals)
    expect = {"flip_block": "file checksum does not match", "flip_anchor": "file checksum does not match",
              "truncate": "torn or truncated", "foreign": "another model",
              "garbage": "not a freetoken anchor file"}[damage]
    assert expect in why, why
    if damage == "flip_block":  # indexed at start (its anchor file is fine), refused when read back
        assert st.anchor_refused is not None and expect in st.anchor_refused
        read_frame(block, BLOCK_MAGIC)  # the bad anchor left the disk; the request wrote a sound one in its place
    _close(got, ref.logits(ids)[-1])
    if damage != "foreign":  # the request's own anchor at 140 (made again where the damaged one was refused)
        assert st.anchors_made == [a.id] and store.get(a.id).where == "device"


def test_a_restarted_store_restores_from_disk(ref, tmp_path):
    first = load(None, device="cpu")
    first.use_anchor_dir(tmp_path)
    ids = _prompt(first)
    a = _anchored(first, ids, 140)
    second = load(None, device="cpu")
    store = second.use_anchor_dir(tmp_path)
    assert [x.id for x in store.list()] == [a.id] and store.get(a.id).tier == "disk"
    assert store.get(a.id).sums == a.sums
    got, st = prefill_logits(second, ids, anchor=a.id)
    assert st.anchor == a.id and st.cached_tokens == 140 and store.refusals == []
    _close(got, ref.logits(ids)[-1])


def test_a_forged_id_with_other_tokens_is_refused(model, ref):
    store = model.use_anchor_dir(None)
    ids = _prompt(model)
    other = ids[:100] + [(t + 1) % 100 for t in ids[100:150]]
    a = _anchored(model, other, 150)
    _forget(model)
    # a hash collision, simulated: the other tokens' anchor filed under the id this request's boundary has
    forged = anchor_id(model.fingerprint, ids[:150])
    store.anchors[forged] = a
    got, st = prefill_logits(model, ids, reuse_cache=True, boundaries=[150])
    assert st.anchor is None and st.cached_tokens == 0
    assert "not a prefix" in st.anchor_refused or "id does not match" in st.anchor_refused
    _close(got, ref.logits(ids)[-1])
    assert store.get(a.id) is a  # the anchor itself is sound: only the entry filed under another id went
    assert store.get(forged) is not a and st.anchors_made == [forged]  # a true one made in its place


def test_another_models_anchor_and_unknown_ids_are_refused(model, ref):
    ids = _prompt(model)
    a = _anchored(model, ids, 120)
    _forget(model)
    a.fingerprint = "f" * 64  # as if another model made it
    got, st = prefill_logits(model, ids, anchor=a)
    assert st.cached_tokens == 0 and "another model" in st.anchor_refused
    _close(got, ref.logits(ids)[-1])
    _forget(model)
    got, st = prefill_logits(model, ids, anchor="ab" * 32)
    assert st.cached_tokens == 0 and st.anchor_refused == "no such anchor"


def test_rollback_and_the_fingerprint(model, ref):
    ids = _prompt(model)
    list(model.generate(ids, max_tokens=4, sampling=GREEDY, reuse_cache=True))
    a = model.anchor(100, label="before the call")
    list(model.generate(ids + [5, 6, 7], max_tokens=4, sampling=GREEDY, reuse_cache=True))
    assert model.rollback(a) == 100 and model.decoder.length == 100 and model.cached_ids == ids[:100]
    assert model.fingerprint == ref.fingerprint  # the same files: the same model
    with pytest.raises(ValueError, match="an anchor of 0 tokens"):
        model.anchor(0)


def test_a_full_pool_makes_room_for_a_side_request_and_the_restore_after_it(ref):
    """A pool the conversation nearly fills: a long side request evicts the conversation from the prefix cache
    (its anchor, over the device budget, lives in host memory), then the retry restores it from there; neither runs
    out of blocks, and the logits are a fresh run's."""
    cfg = ref.config
    from freetoken.models.kv import kv_block_bytes

    blocks = 12
    m = load(None, device="cpu", kv_memory=blocks * kv_block_bytes(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim,
                                                                   "bf16"))
    assert m.decoder.ctx == blocks * 64
    text = "".join(f"def f{i}(x):\n    return x * {i}\n\n" for i in range(60))
    convo = m.encode(text, add_special_tokens=False)[:600]
    side = m.encode("The quick brown fox jumps over the lazy dog. " * 80, add_special_tokens=False)[:620]
    a = _anchored(m, convo, 590)
    assert a.where == "host"  # 10 blocks: over the default device budget of half the pool
    prefill_logits(m, side, reuse_cache=True)
    assert m.prefix_cache.match(convo)[1] < 590  # the side request took the conversation's blocks
    retry = convo[:590] + m.encode("print(f7(3))\n" * 12, add_special_tokens=False)[:150]
    assert len(retry) < m.decoder.ctx
    got, st = prefill_logits(m, retry, reuse_cache=True, boundaries=[590])
    assert st.anchor == a.id and st.cached_tokens == 590
    _close(got, ref.logits(retry)[-1])
    # and near the context's end: a prefix that ends inside a shared block is copied before the pass allocates
    near = retry + [5] * (m.decoder.ctx - len(retry) - 2)
    _, st = prefill_logits(m, near, reuse_cache=True)
    assert st.cached_tokens == len(retry)
