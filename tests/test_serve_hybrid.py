"""`freetoken serve` with a Qwen3.5-MoE model (Gated DeltaNet layers): a live server in a subprocess on a tiny random
checkpoint that carries the bundled tokenizer, and the same checkpoint in process to recompute each greedy answer
from scratch.

An agent's requests repeat the conversation so far: the second request resumes from the linear layers' state kept at
the first one's message boundary (reported as cached tokens) and answers as a fresh run does. Anchors need KV blocks
alone, so ``POST /v1/anchors`` refuses such a model with a reason.
"""

from __future__ import annotations

import json
import shutil

import pytest
from live_server import running_server
from tiny_models import make_checkpoint

from freetoken.engine.chat import model_template
from freetoken.engine.load import DEFAULT_MODEL
from freetoken.engine.sampling import SamplingParams
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
    from freetoken.engine.load import load

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


def test_anchors_are_refused_with_the_reason(server):
    r = server.post("/v1/anchors", {"messages": _conv("def neg(a):")})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "anchors_unsupported" and "linear-attention" in err["message"]
