"""The step loop on the bundled model: requests batched through the scheduler and ``forward_batch`` produce the tokens
each produces alone (``Model.generate``), with prompts cut into chunks that share steps with decoding requests, a
request waiting for a free seat, preemption when the KV pool runs short (recomputed, same tokens), an abort, and
seeded sampling."""

import numpy as np
import pytest

from freetoken.engine.batching.step_loop import StepLoop
from freetoken.engine.decoding.sampling import SamplingParams
from freetoken.engine.loading.load import load
from freetoken.models.kv import KVPool

TEXTS = ("def fibonacci(n):\n    if n < 2:\n        return n\n",
         "import os\n",
         "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n",
         "# sort a list of numbers\nnumbers = [5, 3, 9, 1]\n")
GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def model():
    return load(device="cpu", ctx=256, kv_dtype="f32")


def _alone(model, ids, n, sampling=GREEDY):
    out = list(model.generate(ids, n, sampling))
    model.decoder.reset()
    return out


def _small_pool(model, blocks: int, block_size: int = 16):
    """The decoder on a pool of ``blocks`` blocks (the context: all of them)."""
    dec = model.decoder
    cfg = dec.cfg
    pool = KVPool(dec.dev, len(cfg.kv_layers), cfg.kv_cache_heads, cfg.kv_cache_dim, blocks, kind="f32",
                  block_size=block_size)
    dec.set_context(pool, blocks * block_size, dec.prefill_chunk)
    return pool


def _all_back(model) -> bool:
    """Every block of the pool is free once the prefix cache lets go of what it keeps."""
    model.prefix_cache.clear()
    pool = model.decoder.pool
    return pool.free_blocks == pool.num_blocks


def test_batched_equals_alone(model):
    prompts = [model.encode(t) for t in TEXTS]
    assert sorted(len(p) for p in prompts)[-1] > 24  # a prompt longer than a step's budget: it runs in chunks
    want = [_alone(model, p, 10) for p in prompts]
    loop = StepLoop(model, max_seqs=3, step_tokens=24)
    reqs = [loop.submit(p, 10, GREEDY) for p in prompts]
    streamed = {id(r): [] for r in reqs}
    ends = {}
    max_running = 0
    while loop.has_work:
        for ev in loop.step():
            if ev.token is not None:
                streamed[id(ev.request)].append(ev.token)
            if ev.finish_reason is not None:
                assert id(ev.request) not in ends
                ends[id(ev.request)] = ev.finish_reason
        max_running = max(max_running, loop.running)
        assert loop.running <= 3
    assert max_running == 3 and loop.stats.most_tokens <= 24
    for r, w in zip(reqs, want, strict=True):
        assert r.output == w
        assert streamed[id(r)] == w
        assert ends[id(r)] == r.finish_reason == ("length" if len(w) == 10 else "stop")
    # some step carried a prompt chunk beside decode tokens
    assert loop.steps < sum(len(p) for p in prompts) // 24 + 10 * len(prompts)
    st = loop.stats
    assert sum(st.batch_sizes) == sum(st.step_tokens) == st.steps and st.sequences <= 3 * st.steps
    assert st.batch_sizes[2] > 0 and not any(st.batch_sizes[3:])  # steps of 3 sequences (bucket 3-4), none more
    assert _all_back(model)


def test_preemption_recomputes(model):
    _small_pool(model, blocks=4)
    # one block of 16 each at admission, all three admitted; two each once they grow past 16 tokens: 6 > 4
    prompts = [model.encode(t)[:12] for t in (TEXTS[0], TEXTS[2], TEXTS[3])]
    want = [_alone(model, p, 8) for p in prompts]
    loop = StepLoop(model, max_seqs=3, step_tokens=64)
    reqs = [loop.submit(p, 8, GREEDY) for p in prompts]
    loop.run()
    assert loop.preemptions == loop.scheduler.preemptions > 0
    assert [r.output for r in reqs] == want
    assert _all_back(model)


def test_abort_and_seeded_sampling(model):
    _small_pool(model, blocks=32)
    prompts = [model.encode(t) for t in TEXTS[:3]]
    hot = SamplingParams(temperature=0.9, top_p=0.95, seed=11)
    want = _alone(model, prompts[1], 12, hot)
    loop = StepLoop(model, max_seqs=4)
    a, b, c = (loop.submit(p, 12, hot if i == 1 else GREEDY) for i, p in enumerate(prompts))
    for _ in range(3):
        loop.step()
    loop.abort(a)
    loop.abort(c)
    assert a.finished and a.finish_reason == "aborted" and c.finish_reason == "aborted"
    loop.run()
    assert b.output == want
    assert _all_back(model)


def test_refusals(model):
    loop = StepLoop(model, max_seqs=2)
    with pytest.raises(ValueError, match="at least one prompt token"):
        loop.submit([], 4)
    with pytest.raises(ValueError, match="token ids"):
        loop.submit([model.decoder.cfg.vocab_size], 4)
    with pytest.raises(ValueError, match="max_tokens"):
        loop.submit([1, 2], -1)
    with pytest.raises(ValueError, match="context holds"):
        loop.submit(list(np.arange(model.decoder.max_ctx + 1) % 100), 4)
    assert not loop.has_work


def test_prompt_only_request(model):
    """``max_tokens`` 0: the prompt runs in the step with the others (its full blocks into the prefix cache), no
    token is sampled, and the request ends with "length" and an event without a token; its rows retired whole, the
    next request with that prompt adopts all of them but the last token (fed again for its logits)."""
    _small_pool(model, blocks=64)
    ids = model.encode(TEXTS[2] + TEXTS[0])
    assert len(ids) >= 16
    loop = StepLoop(model, max_seqs=2)
    warm, other = loop.submit(ids, 0), loop.submit(model.encode(TEXTS[0]), 3, GREEDY)
    events = loop.step()
    assert [(e.request, e.token, e.finish_reason) for e in events if e.request is warm] == [(warm, None, "length")]
    assert warm.finished and warm.output == [] and warm.stats.generated_tokens == 0
    assert warm.stats.finish_reason == "length" and warm.stats.prompt_tokens == len(ids)
    loop.run()
    assert other.output == _alone(model, model.encode(TEXTS[0]), 3)
    again = loop.submit(ids, 2, GREEDY)
    loop.run()
    assert again.stats.cached_tokens == len(ids) - 1 and again.output == _alone(model, ids, 2)
    assert _all_back(model)


def test_prefix_reuse(model):
    """A request that shares a finished one's start adopts its rows from the prefix cache; one that shares a
    running request's prompt adopts that prompt's full blocks; the tokens are those of a run without reuse."""
    _small_pool(model, blocks=64)
    base = model.encode(TEXTS[2] + TEXTS[0])
    assert len(base) > 32  # two full blocks of 16 at least
    other = base[:-3] + model.encode("pop", add_special_tokens=False)
    want = [_alone(model, p, 6) for p in (base, other, base)]
    loop = StepLoop(model, max_seqs=4)
    first = loop.submit(base, 6, GREEDY)
    loop.run()
    second = loop.submit(other, 6, GREEDY)
    third = loop.submit(base, 6, GREEDY)  # the same prompt as the first: all but its last token reused
    loop.run()
    common = next(i for i, (a, b) in enumerate(zip(other, base + first.output, strict=False)) if a != b)
    assert first.cached_tokens == 0 and second.cached_tokens == common and third.cached_tokens == len(base) - 1
    assert [first.output, second.output, third.output] == want
    fresh = model.encode(TEXTS[0] + TEXTS[3])
    assert len(fresh) > 16
    want_fresh = _alone(model, fresh, 8)
    running = loop.submit(fresh, 8, GREEDY)
    loop.step()  # its prompt prefilled in one step: its full blocks are in the cache now, while it decodes
    twin = loop.submit(fresh + [7], 3, GREEDY)
    loop.step()
    assert not running.finished and twin.cached_tokens == len(fresh) // 16 * 16
    loop.run()
    assert running.output == want_fresh
    plain = StepLoop(model, max_seqs=4, reuse=False)
    again = plain.submit(base, 6, GREEDY)
    plain.run()
    assert again.cached_tokens == 0 and again.output == want[0]
    # submitted together, the same long start: the second waits one step for the first's prompt, then adopts it
    model.prefix_cache.clear()
    pair = [loop.submit(fresh, 8, GREEDY), loop.submit(fresh + [7], 3, GREEDY)]
    loop.step()
    assert pair[1].seq.kv is None  # not admitted beside it
    loop.run()
    assert pair[0].cached_tokens == 0 and pair[1].cached_tokens == len(fresh) // 16 * 16
    assert pair[0].output == want_fresh


def test_anchors(model):
    """Anchors made at a request's boundaries once its prompt ran serve a later request (the prefix cache emptied
    first, so the rows come from the anchor); an unknown anchor is refused and the prompt recomputed."""
    _small_pool(model, blocks=64)
    prompt = model.encode(TEXTS[2] + TEXTS[0])
    loop = StepLoop(model, max_seqs=2)
    first = loop.submit(prompt, 4, GREEDY, boundaries=[20, len(prompt)])
    loop.run()
    assert len(first.stats.anchors_made) == 2 and first.stats.finish_reason == "length"
    model.prefix_cache.clear()
    longer = prompt + model.encode("x = 1\n", add_special_tokens=False)
    second = loop.submit(longer, 4, GREEDY, boundaries=[20, len(prompt)])
    loop.run()
    assert second.stats.anchor == first.stats.anchors_made[-1] and second.cached_tokens == len(prompt)
    assert second.stats.prompt_tokens == len(longer) - len(prompt)
    third = loop.submit(prompt, 4, GREEDY, anchor="0" * 64)
    loop.run()
    assert third.stats.anchor is None and "no such anchor" in third.stats.anchor_refused
    assert second.output == _alone(model, longer, 4) and third.output == first.output
