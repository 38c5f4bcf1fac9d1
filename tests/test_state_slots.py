"""The linear-attention states of a decoder's sequences as slots of one pool per layer (``StateSlots``), and the
batch ops that advance every sequence of a pass in one call (``ops.short_conv_batch``, ``ops.gated_delta_rule_batch``):
the pools grow without touching the states they hold, a dropped sequence gives its slot back, the batch call is
bit-equal to the single call per sequence on cpu and makes two launches per layer on emu, misuse is refused."""

import gc

import numpy as np
import pytest
from test_forward_batch import _decoder  # the same tiny decoder (ctx 48, f32 KV)
from tiny_models import make_checkpoint

from freetoken import ops
from freetoken.device import get_device
from freetoken.models.sequence import INITIAL_STATE_SLOTS, StateSlots


class _Mixer:
    state_shapes = ((3, 10), (2, 4, 5))


def test_slots_grow_keep_values_and_come_back():
    dev = get_device("cpu")
    slots = StateSlots([_Mixer(), object(), _Mixer()], dev)
    assert set(slots.shapes) == {0, 2} and slots.capacity == INITIAL_STATE_SLOTS
    taken = [slots.take() for _ in range(INITIAL_STATE_SLOTS)]
    assert taken == list(range(INITIAL_STATE_SLOTS))
    for s in taken:
        slots.rec[2][s] = s + 1.0
    extra = slots.take()  # every slot taken: the pools grow by half, the states keep their values
    assert slots.capacity == INITIAL_STATE_SLOTS * 3 // 2 and extra == INITIAL_STATE_SLOTS
    assert [float(slots.rec[2][s].max()) for s in taken] == [s + 1.0 for s in taken]
    slots.give_back(1)
    again = slots.take()
    assert again == 1 and not slots.rec[2][1].any() and not slots.conv[0][1].any()  # zeroed when taken
    assert StateSlots([object()], dev).capacity == 0  # no linear-attention layer: no pools


@pytest.fixture(scope="module")
def next_checkpoint(tmp_path_factory):
    from safetensors.numpy import load_file

    path = tmp_path_factory.mktemp("qwen3_next")
    make_checkpoint("qwen3_next", path)
    return path, load_file(str(path / "model.safetensors"))


def test_sequences_hold_slots_while_alive(next_checkpoint):
    dec = _decoder(next_checkpoint, get_device("cpu"))
    slots = dec.state_slots
    base = slots.taken  # the decoder's own sequence
    seqs = [dec.new_sequence() for _ in range(INITIAL_STATE_SLOTS + 2)]  # more than the first pools hold
    assert len({s.slot for s in seqs}) == len(seqs) and slots.taken == base + len(seqs)
    del seqs
    gc.collect()
    assert slots.taken == base


def test_batch_after_growth_equals_alone(next_checkpoint, device):
    """Six sequences (the pools grow under live states), a prompt each then decode steps together: each sequence's
    logits equal its logits alone (within test_forward_batch's bound: the projections over the batch's rows round
    differently from one row's; the linear-attention ops themselves are bit-equal, next test)."""
    dec = _decoder(next_checkpoint, device)
    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, 128, n) for n in (5, 3, 7, 2, 4, 6)]
    steps = [rng.integers(0, 128, 2) for _ in prompts]
    want = []
    for p, f in zip(prompts, steps, strict=True):
        dec.reset()
        want.append([dec.forward(p, last_only=True)[0], *(dec.forward([t])[0] for t in f)])
    dec.reset()
    seqs, got, fed = [], [[] for _ in prompts], [0] * len(prompts)
    for step in range(4):  # three sequences from step 0; three more join at step 1 (the pools grow under the first)
        if step < 2:
            seqs += [dec.new_sequence() for _ in range(3)]
        work = []
        for i, seq in enumerate(seqs):
            if step == i // 3:
                work.append((seq, prompts[i]))
            elif fed[i] < 2:
                work.append((seq, [steps[i][fed[i]]]))
                fed[i] += 1
        logits = dec.forward_batch(work)
        for row, (seq, _) in enumerate(work):
            got[seqs.index(seq)].append(logits[row])
    assert dec.state_slots.capacity > INITIAL_STATE_SLOTS
    for i in range(6):
        assert len(got[i]) == 3
        for g, w in zip(got[i], want[i], strict=True):
            assert float(((g - w) ** 2).sum() / (w**2).sum()) < 1e-9
            assert int(np.argmax(g)) == int(np.argmax(w))


def test_batch_ops_bit_equal_to_single_on_cpu():
    dev, rng = get_device("cpu"), np.random.default_rng(2)
    hk, hv, dk, dv, c, k = 2, 4, 16, 40, 150, 4
    counts, slots = (1, 20, 3, 1), (3, 0, 4, 1)
    t = sum(counts)
    x = rng.standard_normal((t, c), dtype=np.float32)
    w = rng.standard_normal((c, k), dtype=np.float32)
    conv = rng.standard_normal((5, k - 1, c), dtype=np.float32)
    qkv = rng.standard_normal((t, 2 * hk * dk + hv * dv), dtype=np.float32)
    g = rng.uniform(-3, 0, (t, hv)).astype(np.float32)
    beta = rng.uniform(0, 1, (t, hv)).astype(np.float32)
    rec = rng.standard_normal((5, hv, dk, dv), dtype=np.float32)
    batch = ops.StateBatch(slots, counts, device=dev)
    conv_b, rec_b = conv.copy(), rec.copy()
    y = ops.short_conv_batch(x, w, conv_b, batch, device=dev)
    o = ops.gated_delta_rule_batch(qkv, g, beta, rec_b, hk, batch, device=dev)
    for s, lo, hi in zip(slots, batch.bounds[:-1], batch.bounds[1:], strict=True):
        np.testing.assert_array_equal(y[lo:hi], ops.short_conv(x[lo:hi], w, conv[s], device=dev))
        np.testing.assert_array_equal(o[lo:hi], ops.gated_delta_rule(qkv[lo:hi], g[lo:hi], beta[lo:hi], rec[s], hk,
                                                                     device=dev))
    np.testing.assert_array_equal(conv_b, conv)  # the single calls advanced the same states the same way
    np.testing.assert_array_equal(rec_b, rec)


def test_one_launch_per_op_for_the_batch_on_emu(next_checkpoint):
    """A decode step of three sequences: each linear-attention layer launches short_conv_f32 and
    gated_delta_rule_f32 once (span by span it was three times each)."""
    import freetoken.ops.linear_batch as launchers

    dev = get_device("emu")
    dec = _decoder(next_checkpoint, dev)
    seqs = [dec.new_sequence() for _ in range(3)]
    dec.forward_batch([(s, [1, 2, 3]) for s in seqs])
    names, lookup = [], launchers.cuda_kernel

    def counting(d, source, kernel, *a):
        names.append(kernel)
        return lookup(d, source, kernel, *a)

    launchers.cuda_kernel = counting
    try:
        dec.forward_batch([(s, [4]) for s in seqs])
    finally:
        launchers.cuda_kernel = lookup
    linear = sum(1 for layer in dec.layers if hasattr(layer.attention, "state_shapes"))
    assert linear and names.count("short_conv_f32") == linear and names.count("gated_delta_rule_f32") == linear


def test_batch_ops_refuse_misuse():
    dev = get_device("cpu")
    with pytest.raises(ValueError, match="distinct"):
        ops.StateBatch([0, 0], [1, 1])
    with pytest.raises(ValueError, match="at least one row"):
        ops.StateBatch([0, 1], [1, 0])
    with pytest.raises(ValueError, match="one of each"):
        ops.StateBatch([0, 1], [1])
    batch = ops.StateBatch([2, 0], [1, 2], device=dev)
    x = np.zeros((3, 8), np.float32)
    w = np.zeros((8, 4), np.float32)
    with pytest.raises(ValueError, match="slot 2 is past the pool's 2 states"):
        ops.short_conv_batch(x, w, np.zeros((2, 3, 8), np.float32), batch, device=dev)
    with pytest.raises(ValueError, match=r"states must be float32 \[N, 3, 8\]"):
        ops.short_conv_batch(x, w, np.zeros((3, 2, 8), np.float32), batch, device=dev)
    with pytest.raises(ValueError, match="4 rows given for a batch of 3"):
        ops.short_conv_batch(np.zeros((4, 8), np.float32), w, np.zeros((3, 3, 8), np.float32), batch, device=dev)
    with pytest.raises(TypeError, match="StateBatch"):
        ops.short_conv_batch(x, w, np.zeros((3, 3, 8), np.float32), (2, 0), device=dev)
    qkv = np.zeros((3, 2 * 4 + 2 * 4), np.float32)
    g = np.zeros((3, 2), np.float32)
    with pytest.raises(ValueError, match="pool of 4 axes"):
        ops.gated_delta_rule_batch(qkv, g, g, np.zeros((3, 4, 4), np.float32), 1, batch, device=dev)
    with pytest.raises(ValueError, match="must divide"):
        ops.gated_delta_rule_batch(qkv, g, g, np.zeros((3, 2, 4, 4), np.float32), 3, batch, device=dev)
    with pytest.raises(ValueError, match=r"beta must be \[3, 2\]"):
        ops.gated_delta_rule_batch(qkv, g, g[:, :1], np.zeros((3, 2, 4, 4), np.float32), 1, batch, device=dev)
    with pytest.raises(ValueError, match="made for the cpu device"):
        ops.gated_delta_rule_batch(qkv, g, g, np.zeros((3, 2, 4, 4), np.float32), 1, batch,
                                   device=get_device("emu"))
