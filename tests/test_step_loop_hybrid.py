"""The step loop on models with Gated DeltaNet layers (Qwen3-Next, Qwen3.5-MoE): requests batched together produce
what each produces alone, and reuse works as it does for ``Model.generate``: prompt chunks end where the recurrent
states must be kept (message boundaries, every ``snapshot_every`` tokens), a request that continues an earlier
conversation resumes from the states its sequence left in the state cache, anchors made in the loop carry the
states, and a preempted sequence readmitted finds its own states again."""

import json

import pytest
from tiny_models import make_checkpoint

from freetoken.device import get_device
from freetoken.engine.batching.step_loop import StepLoop
from freetoken.engine.decoding.sampling import SamplingParams
from freetoken.engine.generation.generate import Model
from freetoken.engine.loading.build import build_decoder
from freetoken.engine.options import LoadOptions
from freetoken.models import from_hf
from freetoken.models.kv import KVPool

GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module", params=("qwen3_next", "qwen3_5_moe"))
def checkpoint(request, tmp_path_factory):
    from safetensors.numpy import load_file

    path = tmp_path_factory.mktemp(request.param)
    make_checkpoint(request.param, path)
    return path, load_file(str(path / "model.safetensors"))


def _model(checkpoint, ctx=256) -> Model:
    path, tensors = checkpoint
    cfg = from_hf(json.loads((path / "config.json").read_text()))
    dec = build_decoder(cfg, lambda name: tensors[name], get_device("cpu"), LoadOptions(ctx=ctx, kv_dtype="f32"))
    assert dec.recurrent
    return Model(dec)


@pytest.fixture(scope="module")
def alone(checkpoint):
    """``alone(ids, n)``: the greedy tokens of ``ids`` run by themselves on a fresh sequence of another model."""
    model = _model(checkpoint)
    return lambda ids, n: list(model.generate(ids, max_tokens=n, sampling=GREEDY))


def _prompts():
    return ([(7 * i + 3) % 128 for i in range(14)], [(5 * i + 1) % 128 for i in range(21)],
            [(11 * i + 2) % 128 for i in range(9)])


def test_batched_equals_alone(checkpoint, alone):
    """Three requests in steps of 8 tokens (prompt chunks beside decode tokens), one with message boundaries and a
    snapshot every 8 tokens: each request's tokens equal its tokens alone, and the states were kept at the chunk
    ends the cuts asked for."""
    model = _model(checkpoint)
    model.decoder.snapshot_every = 8
    loop = StepLoop(model, max_seqs=3, step_tokens=8)
    prompts = _prompts()
    reqs = [loop.submit(p, 6, GREEDY, boundaries=[5, 11] if i == 0 else ()) for i, p in enumerate(prompts)]
    assert reqs[0].seq.cuts == (5, 8, 11) and reqs[1].seq.cuts == (8, 16)
    loop.run()
    for r, p in zip(reqs, prompts, strict=True):
        assert r.output == alone(p, 6)
    kept = set(model.state_cache.lengths())
    assert {5, 8, 11, 14, 16, 21, 9} <= kept  # boundaries, periodic points, prompt ends
    assert len(reqs[0].stats.anchors_made) == 2
    assert all(model.anchors.get(a).info()["linear_states"] for a in reqs[0].stats.anchors_made)


def test_next_turn_resumes_from_the_state_cache(checkpoint, alone):
    """A conversation's next request (its prompt: the last prompt, the reply, more) resumes where the last sequence
    ended, a branch at a message boundary resumes there, an unrelated prompt recomputes; the tokens are those of a
    fresh run."""
    model = _model(checkpoint)
    loop = StepLoop(model, max_seqs=2, step_tokens=8)
    a = _prompts()[0]
    first = loop.submit(a, 4, GREEDY, boundaries=[9])
    loop.run()
    longer = a + first.output + [5, 6, 7]
    branch = a[:9] + [1, 2, 3]
    other = [3] * 10
    reqs = [loop.submit(p, 4, GREEDY) for p in (longer, branch, other)]
    loop.run()
    assert [r.cached_tokens for r in reqs] == [len(a) + 4 - 1, 9, 0]  # (the last sampled token was never fed)
    for r, p in zip(reqs, (longer, branch, other), strict=True):
        assert r.output == alone(p, 4)


def test_a_named_anchor_restores_its_states(checkpoint, alone):
    model = _model(checkpoint)
    loop = StepLoop(model, max_seqs=2, step_tokens=8)
    ids = _prompts()[1][:16]
    made = loop.submit(ids, 2, GREEDY, boundaries=[11, 16])
    loop.run()
    assert len(made.stats.anchors_made) == 2
    model.state_cache.clear()  # only the anchor holds the states now
    longer = ids + [1, 2]
    req = loop.submit(longer, 4, GREEDY, anchor=made.stats.anchors_made[1])
    loop.run()
    assert req.stats.anchor == made.stats.anchors_made[1] and req.cached_tokens == 16
    assert req.output == alone(longer, 4)


def test_preempted_sequences_resume_and_match(checkpoint, alone):
    """A pool too small for three growing sequences: the newest is preempted, readmitted from the states it left in
    the state cache, and every request still gets its tokens alone."""
    model = _model(checkpoint)
    dec = model.decoder
    cfg = dec.cfg
    pool = KVPool(dec.dev, len(cfg.kv_layers), cfg.kv_cache_heads, cfg.kv_cache_dim, 5, kind="f32", block_size=8)
    dec.set_context(pool, 40, dec.prefill_chunk)
    prompts = [p[:12] for p in _prompts()[:2]] + [_prompts()[2]]
    loop = StepLoop(model, max_seqs=3, step_tokens=64)
    reqs = [loop.submit(p, 8, GREEDY) for p in prompts]
    loop.run()
    assert loop.preemptions > 0
    for r, p in zip(reqs, prompts, strict=True):
        assert r.output == alone(p, 8)
