"""The continuous-batching scheduler (freetoken.engine.batching.scheduler) over a real KV pool, driven by a stand-in
model whose next token is a function of a sequence's whole history, and which writes each fed token's id into its K
rows: so a sequence's outputs in a batch must equal its outputs alone (also across preemption and recompute), and its
rows must hold exactly its tokens after every step (block tables, copy on write and preemption never mix sequences)."""

import numpy as np
import pytest

from freetoken.device import get_device
from freetoken.engine.batching.scheduler import Scheduler, Sequence, Status
from freetoken.models.kv import KVPool, KVSequence

CPU = get_device("cpu")
BS = 4  # tokens per block: sequences cross block boundaries every few tokens


def _pool(blocks: int) -> KVPool:
    return KVPool(CPU, 1, 1, 1, blocks, "f32", block_size=BS)


def _next_token(history: list[int]) -> int:
    """The stand-in model: deterministic in the whole history, so a recomputed sequence continues the same way."""
    return (sum(history[-3:]) * 7 + len(history)) % 97 + 3


def _rows(kv: KVSequence) -> list[int]:
    """The token ids kv's K rows hold, in position order."""
    return [int(kv.pool.k[0][kv.blocks[p // BS], p % BS, 0, 0]) for p in range(kv.length)]


def _write(kv: KVSequence, start: int, ids: list[int]) -> None:
    """The stand-in forward pass's KV store: token ids into the K rows of positions ``start ..``."""
    for j, tok in enumerate(ids):
        p = start + j
        kv.pool.k[0][kv.blocks[p // BS], p % BS, 0, 0] = tok


def _run_step(sched: Scheduler):
    """Plan a step, 'run' it (write the fed ids into the chunk's rows, sample from the histories), account it."""
    plan = sched.schedule()
    assert plan.tokens <= sched.step_tokens
    assert len({id(c.seq) for c in plan.chunks}) == len(plan.chunks), "a sequence twice in one step"
    sampled = {}
    for c in plan.chunks:
        assert c.seq.status is Status.RUNNING and c.start == c.seq.computed
        _write(c.seq.kv, c.start, c.ids)
        if c.samples:
            sampled[c.seq] = _next_token(c.seq.tokens)
    ended = sched.finish_step(plan, sampled)
    for seq in sched.running:
        assert _rows(seq.kv) == seq.tokens[:seq.computed]
    return plan, ended


def _drain(sched: Scheduler, limit=500):
    plans = []
    for _ in range(limit):
        if not sched.has_work:
            return plans
        plans.append(_run_step(sched)[0])
    raise AssertionError("the scheduler did not finish its sequences")


def _alone(prompt: list[int], max_tokens: int) -> list[int]:
    history = list(prompt)
    for _ in range(max_tokens):
        history.append(_next_token(history))
    return history[len(prompt):]


def test_prompt_only_sequence_ends_after_its_prompt():
    pool = _pool(16)
    sched = Scheduler(pool, ctx=64, step_tokens=4, max_seqs=2)
    seq = Sequence(prompt=list(range(10, 20)), max_tokens=0)
    sched.add(seq)
    steps = 0
    while sched.has_work:
        plan = sched.schedule()
        assert not plan.sampling or plan.chunks[-1].start + len(plan.chunks[-1].ids) == 10
        assert sched.finish_step(plan, {}) == ([seq] if plan.sampling else [])
        steps += 1
    assert steps == 3 and seq.output == [] and seq.finish_reason == "length" and np.all(pool.refs == 0)


def test_one_sequence_prefills_in_chunks_then_decodes():
    pool = _pool(16)
    sched = Scheduler(pool, ctx=64, step_tokens=4, max_seqs=2)
    seq = Sequence(prompt=list(range(10, 20)), max_tokens=5)
    sched.add(seq)
    plans = _drain(sched)
    assert [[len(c.ids) for c in p.chunks] for p in plans] == [[4], [4], [2], [1], [1], [1], [1]]
    assert [p.chunks[0].samples for p in plans] == [False, False, True, True, True, True, True]
    assert seq.output == _alone(seq.prompt, 5) and seq.finish_reason == "length"
    assert seq.kv is None and pool.free_blocks == pool.num_blocks


def test_a_prompt_being_prefilled_is_not_computed_twice():
    """share_prefills: a request whose prompt mostly repeats one still being prefilled waits for it (the engine's
    prefix cache then holds the rows) and is admitted at the next step; one sharing a few first tokens only is not
    held; without the flag both run at once."""
    prompt = list(range(10, 30))
    for share, others, first_step, second_at in ((True, prompt[:12] + [5], [0], 1),
                                                 (False, prompt[:12] + [5], [0, 1], 0),
                                                 (True, prompt[:3] + [7] * 10, [0, 1], 0)):
        sched = Scheduler(_pool(32), ctx=64, step_tokens=32, max_seqs=3, share_prefills=share)
        seqs = [Sequence(prompt=list(prompt), max_tokens=2), Sequence(prompt=others, max_tokens=2)]
        for q in seqs:
            sched.add(q)
        plans = _drain(sched)
        assert [seqs.index(c.seq) for c in plans[0].chunks] == first_step
        assert next(i for i, p in enumerate(plans) if any(c.seq is seqs[1] for c in p.chunks)) == second_at
        assert [q.output for q in seqs] == [_alone(q.prompt, 2) for q in seqs]


def test_prompt_chunks_end_at_the_cuts():
    """A sequence's cuts (where the engine copies linear-attention states) end its prompt chunks there, whatever
    the budget; the rest of the budget is not spent on it in that step."""
    pool = _pool(16)
    sched = Scheduler(pool, ctx=64, step_tokens=8, max_seqs=2)
    seq = Sequence(prompt=list(range(10, 30)), max_tokens=2, cuts=(3, 5, 13))
    sched.add(seq)
    plans = _drain(sched)
    assert [[(c.start, len(c.ids)) for c in p.chunks] for p in plans] == [
        [(0, 3)], [(3, 2)], [(5, 8)], [(13, 7)], [(20, 1)]]
    assert seq.output == _alone(seq.prompt, 2)


def test_decodes_share_every_step_with_a_long_prompt():
    sched = Scheduler(_pool(32), ctx=64, step_tokens=6, max_seqs=4)
    a = Sequence(prompt=[5, 6, 7], max_tokens=20)
    sched.add(a)
    _run_step(sched)  # a's prompt, its first token
    b = Sequence(prompt=list(range(30, 60)), max_tokens=3)
    sched.add(b)
    for _ in range(6):  # b's 30 prompt tokens go in chunks of 5 beside a's decode token each step
        plan, _ = _run_step(sched)
        assert [(c.seq, len(c.ids)) for c in plan.chunks] == [(a, 1), (b, 5)]
    assert len(b.output) == 1
    _drain(sched)
    assert a.output == _alone(a.prompt, 20) and b.output == _alone(b.prompt, 3)


def test_a_short_request_behind_a_long_generation_starts_at_the_next_step():
    sched = Scheduler(_pool(64), ctx=128, step_tokens=16, max_seqs=4)
    long_gen = Sequence(prompt=[1, 2, 3, 4], max_tokens=100)
    sched.add(long_gen)
    for _ in range(10):
        _run_step(sched)
    short = Sequence(prompt=[9, 8, 7], max_tokens=2)
    sched.add(short)
    plan, _ = _run_step(sched)
    assert short in plan.sampling and len(short.output) == 1  # its prefill and first token in one step
    plan, ended = _run_step(sched)
    assert ended == [short] and long_gen.status is Status.RUNNING
    _drain(sched)
    assert long_gen.output == _alone(long_gen.prompt, 100)


def test_max_seqs_caps_the_running_set_and_admission_is_fifo():
    sched = Scheduler(_pool(64), ctx=64, step_tokens=32, max_seqs=2)
    seqs = [Sequence(prompt=[i, i + 1], max_tokens=3 + i) for i in range(4)]
    for s in seqs:
        sched.add(s)
    plan, _ = _run_step(sched)
    assert [c.seq for c in plan.chunks] == seqs[:2] and list(sched.waiting) == seqs[2:]
    admitted = []
    while sched.has_work:
        assert len(sched.running) <= 2
        plan, _ = _run_step(sched)
        admitted += [c.seq for c in plan.chunks if c.start == 0]
    assert admitted == seqs[2:]
    for s in seqs:
        assert s.output == _alone(s.prompt, s.max_tokens) and s.finish_reason == "length"


def test_a_short_pool_preempts_the_newest_and_recomputes_it_to_the_same_tokens():
    pool = _pool(10)  # 40 rows for three running sequences that want 24 each
    sched = Scheduler(pool, ctx=64, step_tokens=5, max_seqs=3)  # prompts in chunks, beside the decodes
    seqs = [Sequence(prompt=[10 * i + j for j in range(6)], max_tokens=18) for i in range(4)]
    for s in seqs:
        sched.add(s)
    preempted = []
    while sched.has_work:
        before = set(sched.running)
        plan, _ = _run_step(sched)
        preempted += plan.preempted
        assert all(s.arrival == max(r.arrival for r in [*sched.running, s]) for s in plan.preempted)
        if plan.preempted:  # no admission in a step that had to preempt (it would take the blocks just freed)
            assert all(c.seq in before for c in plan.chunks)
        # a preempted sequence waits ahead of those that arrived after it: the queue stays in arrival order
        assert [w.arrival for w in sched.waiting] == sorted(w.arrival for w in sched.waiting)
    assert len(preempted) >= 2 and sched.preemptions == len(preempted)
    assert seqs[0].preemptions == 0  # the oldest is never the one preempted while others run
    for s in seqs:
        assert s.output == _alone(s.prompt, 18) and s.finish_reason == "length"
    assert pool.free_blocks == pool.num_blocks


def test_the_newest_preempts_itself_and_is_not_readmitted_in_the_same_step():
    pool = _pool(4)  # 16 rows: a's 7 and b's 8 prompt tokens fill all four blocks
    sched = Scheduler(pool, ctx=64, step_tokens=16, max_seqs=2)
    a, b = Sequence(prompt=list(range(7)), max_tokens=6), Sequence(prompt=list(range(20, 28)), max_tokens=6)
    sched.add(a)
    sched.add(b)
    _run_step(sched)
    sched.step_tokens = 4  # b's recompute would fit a small chunk into the blocks it has just given back
    plan, _ = _run_step(sched)  # a decodes into its last free row; b needs a fifth block: it is the newest
    assert plan.preempted == [b] and [c.seq for c in plan.chunks] == [a]
    assert list(sched.waiting) == [b] and b.kv is None and b.status is Status.WAITING
    _drain(sched)
    assert a.output == _alone(a.prompt, 6) and b.output == _alone(b.prompt, 6) and b.preemptions >= 1


def test_a_sequence_that_cannot_fit_alone_ends_and_the_rest_go_on():
    pool = _pool(4)  # 16 rows
    sched = Scheduler(pool, ctx=64, step_tokens=64, max_seqs=4)
    big = Sequence(prompt=list(range(20)), max_tokens=4)
    small = Sequence(prompt=[1, 2], max_tokens=3)
    sched.add(big)
    sched.add(small)
    _drain(sched)
    assert big.finish_reason == "kv" and big.output == []
    assert small.finish_reason == "length" and small.output == _alone(small.prompt, 3)
    grows = Sequence(prompt=list(range(12)), max_tokens=10)  # fits at first, outgrows the pool while alone
    sched.add(grows)
    _drain(sched)
    assert grows.finish_reason == "kv" and grows.output == _alone(grows.prompt, 5)
    assert pool.free_blocks == pool.num_blocks


def test_stop_ids_the_context_and_abort_end_sequences():
    pool = _pool(32)
    sched = Scheduler(pool, ctx=10, step_tokens=16, max_seqs=4)
    prompt = [4, 5, 6]
    stop_at = _alone(prompt, 4)[2]
    stopped = Sequence(prompt=prompt, max_tokens=50, stop_ids={stop_at})
    full = Sequence(prompt=list(range(8)), max_tokens=50)
    running = Sequence(prompt=[7, 7], max_tokens=50)
    queued = Sequence(prompt=[8, 8], max_tokens=50)
    for s in (stopped, full, running):
        sched.add(s)
    _run_step(sched)
    sched.add(queued)
    sched.abort(queued)
    sched.abort(running)
    assert queued.finish_reason == running.finish_reason == "aborted" and running.kv is None
    _drain(sched)
    assert stopped.finish_reason == "stop" and stopped.output[-1] == stop_at and len(stopped.output) <= 3
    # 8 prompt tokens in a context of 10: positions 8 and 9 take two outputs, whose last sample is the third
    assert full.finish_reason == "context" and len(full.output) == 3
    assert pool.free_blocks == pool.num_blocks


def test_a_prefix_attached_at_admission_is_shared_and_copied_on_write():
    pool = _pool(16)
    cached = KVSequence(pool, 64)  # a prefix cache's entry: 10 rows of an earlier sequence
    earlier = list(range(40, 50))
    cached.prepare(0, len(earlier))
    _write(cached, 0, earlier)
    cached.length = len(earlier)

    def attach(seq):  # the engine's prefix lookup: the first 9 rows match, the last of their blocks partly
        seq.kv = KVSequence(pool, 64)
        seq.kv.adopt(cached.blocks[:3], 9)

    sched = Scheduler(pool, ctx=64, step_tokens=32, max_seqs=2, attach=attach)
    seq = Sequence(prompt=earlier[:9] + [99, 98], max_tokens=4)
    sched.add(seq)
    plan, _ = _run_step(sched)
    assert plan.chunks[0].start == 9 and plan.chunks[0].ids == [99, 98]  # only the new tail is fed
    _drain(sched)
    assert seq.output == _alone(seq.prompt, 4)
    assert _rows(cached) == earlier  # the shared block was copied before seq wrote into it
    cached.reset()
    assert pool.free_blocks == pool.num_blocks


def test_an_attach_that_runs_out_of_blocks_waits_like_a_short_prepare():
    """The engine's attach copies a shared, partly filled block of the prefix it adopts: with the pool full that
    allocation fails, and the sequence waits for a running one to end (alone, it would end as "kv")."""
    pool = _pool(8)
    calls = []

    def attach(seq):
        seq.kv = KVSequence(pool, 64)
        calls.append(seq)
        pool.allocate(0 if len(calls) == 1 else pool.free_blocks + 1)  # the later admissions find the pool full

    sched = Scheduler(pool, ctx=64, step_tokens=64, max_seqs=2, attach=attach)
    first, second = Sequence(prompt=list(range(20)), max_tokens=3), Sequence(prompt=[5, 6], max_tokens=2)
    sched.add(first)
    sched.add(second)
    plan, _ = _run_step(sched)
    assert [c.seq for c in plan.chunks] == [first] and second.status is Status.WAITING and second.kv is None
    _drain(sched)
    assert first.output == _alone(first.prompt, 3)
    assert second.finish_reason == "kv"  # alone and still short: it never fits (this attach always is)
    assert pool.free_blocks == pool.num_blocks


def test_bad_arguments_are_refused():
    pool = _pool(4)
    with pytest.raises(ValueError, match="max_seqs"):
        Scheduler(pool, ctx=16, step_tokens=8, max_seqs=0)
    with pytest.raises(ValueError, match="step_tokens"):
        Scheduler(pool, ctx=16, step_tokens=2, max_seqs=4)
    sched = Scheduler(pool, ctx=16, step_tokens=8, max_seqs=2)
    with pytest.raises(ValueError, match="at least one prompt token"):
        sched.add(Sequence(prompt=[], max_tokens=1))
    with pytest.raises(ValueError, match="context holds 16"):
        sched.add(Sequence(prompt=list(range(17)), max_tokens=1))
    with pytest.raises(ValueError, match="max_tokens"):
        sched.add(Sequence(prompt=[1], max_tokens=-1))
    assert not sched.has_work and np.all(pool.refs == 0)
