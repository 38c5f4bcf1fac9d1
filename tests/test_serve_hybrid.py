"""`freetoken serve` with a Qwen3.5-MoE model (Gated DeltaNet layers): a live server in a subprocess on a tiny random
checkpoint that carries the bundled tokenizer, and the same checkpoint in process to recompute each greedy answer
from scratch.

An agent's requests repeat the conversation so far: the second request resumes from the linear layers' state kept at
the first one's message boundary (reported as cached tokens) and answers as a fresh run does, also after another
conversation replaced the engine's sequence; anchors carry the linear layers' states.
"""

from __future__ import annotations

import json
import shutil

import pytest
from live_server import running_server
from tiny_models import make_checkpoint

from freetoken.engine.generation.chat import model_template
from freetoken.engine.generation.sampling import SamplingParams
from freetoken.engine.loading.load import DEFAULT_MODEL
from freetoken.testing.oracles import need

NAME = "tiny-qwen35"
MAX_TOKENS = 5
SYSTEM = "You review Python code." + "".join(f"\n# rule {i}: keep functions short" for i in range(6))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    need("torch")
    path = tmp_path_factory.mktemp("hybrid") / "qwen35"
    vocab = json.loads((DEFAULT_MODEL / "config.json").read_text())["vocab_size"]
    make_checkpoint("qwen3_5_moe", path, vocab_size=vocab, eos_token_id=0)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(DEFAULT_MODEL / name, path / name)
    return path


@pytest.fixture(scope="module")
def server(tmp_path_factory, checkpoint):
    yield from running_server(tmp_path_factory, "--model", str(checkpoint), "--served-model-name", NAME)


@pytest.fixture(scope="module")
def engine(checkpoint):
    from freetoken.engine.loading.load import load

    model = load(checkpoint, device="cpu", ctx=512)
    return model, model_template(model)


def _conv(user: str) -> list[dict]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]


def _answer(engine, messages) -> str:
    model, template = engine
    ids = model.encode(template.render(messages, add_generation_prompt=True), add_special_tokens=False)
    return "".join(model.generate_text(ids, MAX_TOKENS, SamplingParams(temperature=0), stop=template.stop_strings()))


def _chat(server, messages):
    return server.client().chat.completions.create(model=NAME, messages=messages, temperature=0,
                                                   max_tokens=MAX_TOKENS)


def test_a_shared_system_prompt_resumes_from_its_state(server, engine):
    model, template = engine
    system = len(model.encode(template.render(_conv("x")[:1], add_generation_prompt=False),
                              add_special_tokens=False))
    first = _chat(server, _conv("def add(a, b):"))
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert first.choices[0].message.content == _answer(engine, _conv("def add(a, b):"))
    second = _chat(server, _conv("def mul(a, b):"))
    assert second.usage.prompt_tokens_details.cached_tokens == system  # the state at the system message's end
    assert second.choices[0].message.content == _answer(engine, _conv("def mul(a, b):"))


def test_a_conversation_resumes_after_another_one(server, engine):
    """Another conversation (another system prompt) in between replaces the engine's sequence; the first one's next
    request still resumes at its system message, from the state kept there (an anchor at that boundary, or the state
    cache), and answers as a fresh run does."""
    model, template = engine
    other = [{"role": "system", "content": "You write haiku."}, {"role": "user", "content": "autumn"}]
    system = len(model.encode(template.render(_conv("x")[:1], add_generation_prompt=False),
                              add_special_tokens=False))
    _chat(server, _conv("def div(a, b):"))
    _chat(server, other)
    back = _chat(server, _conv("def mod(a, b):"))
    assert back.usage.prompt_tokens_details.cached_tokens == system
    assert back.choices[0].message.content == _answer(engine, _conv("def mod(a, b):"))


def test_anchors_keep_the_linear_states(server, engine):
    """``POST /v1/anchors`` anchors the conversation with the linear layers' states; a request naming the anchor,
    after another conversation, resumes from it whole and answers as a fresh run does."""
    model, template = engine
    conv = _conv("def neg(a):")
    r = server.post("/v1/anchors", {"messages": conv})
    assert r.status_code == 200, r.text
    a = r.json()
    assert a["linear_states"] and a["tokens"] == len(model.encode(template.render(conv, add_generation_prompt=False),
                                                                   add_special_tokens=False))
    _chat(server, _conv("something else entirely"))
    later = conv + [{"role": "assistant", "content": "return -a"}, {"role": "user", "content": "and for zero?"}]
    resp = server.client().chat.completions.create(model=NAME, messages=later, temperature=0, max_tokens=MAX_TOKENS,
                                                   extra_body={"anchor": a["id"]})
    assert resp.model_extra["anchor"]["restored"] == a["id"], resp.model_extra["anchor"]
    assert resp.usage.prompt_tokens_details.cached_tokens == a["tokens"]
    assert resp.choices[0].message.content == _answer(engine, later)
    # the same conversation, no longer: its last token's logits are not kept with the states, so the anchor cannot
    # serve it (the linear layers cannot step back one token); it is refused with that reason and recomputed
    same = server.client().chat.completions.create(model=NAME, messages=conv, temperature=0, max_tokens=MAX_TOKENS,
                                                   extra_body={"anchor": a["id"]})
    assert "only" in same.model_extra["anchor"]["refused"] and same.choices[0].message.content == _answer(engine, conv)


def test_chat_anchor_and_rollback(engine):
    """`freetoken chat`'s /anchor and /rollback on a hybrid model: the anchor is taken at the longest start of the
    conversation whose linear states were kept, and after a rollback the next turn answers as a fresh chat does."""
    from freetoken.engine.generation.chat import Chat

    model, _ = engine
    greedy = SamplingParams(temperature=0)
    chat = Chat(model, system=SYSTEM)
    "".join(chat.send("def add(a, b):", MAX_TOKENS, greedy))
    a = chat.anchor()
    assert a.info()["linear_states"] and a.length in model.decoder.resume_points()
    "".join(chat.send("and sub?", MAX_TOKENS, greedy))
    chat.rollback(a)
    assert model.decoder.length == a.length and len(chat.messages) == 3
    got = "".join(chat.send("and mul?", MAX_TOKENS, greedy))
    assert model.stats.cached_tokens >= a.length
    assert got == _answer(engine, chat.messages[:-1])  # recomputed from scratch
