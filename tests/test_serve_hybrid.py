"""A model with linear-attention layers (a tiny Qwen3-Next with the bundled tokenizer) served with continuous
batching, in process: concurrent chat requests get the greedy replies they get one at a time, and a conversation's
next turn resumes from the states its last turn left (reported as cached prompt tokens)."""

import re
import shutil
import threading
import time

import pytest
from tiny_models import make_checkpoint

from freetoken.engine.loading.load import DEFAULT_MODEL, load

MODEL = "tiny-qwen3-next"
QUESTIONS = ("def add(a, b):", "import os\nimport sys", "class Point:")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3_next_served")
    make_checkpoint("qwen3_next", path, vocab_size=4096)  # the bundled tokenizer's vocabulary
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(DEFAULT_MODEL / name, path / name)
    return path


def _client(model_dir, max_seqs: int):
    from starlette.testclient import TestClient

    from freetoken.serve.app import create_app

    model = load(model_dir, device="cpu", ctx=512, kv_dtype="f32")
    assert model.decoder.recurrent
    return TestClient(create_app(lambda: model, MODEL, api_key=None, max_seqs=max_seqs))


def _ready(client):
    deadline = time.monotonic() + 120
    while client.get("/health").status_code != 200:
        assert time.monotonic() < deadline, "the model did not load"
        time.sleep(0.02)


def _chat(client, messages):
    r = client.post("/v1/chat/completions", json={"model": MODEL, "messages": messages, "max_tokens": 8,
                                                  "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()


def test_batched_replies_equal_one_at_a_time_and_turns_resume(model_dir):
    asks = [[{"role": "user", "content": q}] for q in QUESTIONS]
    with _client(model_dir, max_seqs=1) as one:
        _ready(one)
        want = [_chat(one, m)["choices"][0]["message"]["content"] for m in asks]
    with _client(model_dir, max_seqs=3) as batched:
        _ready(batched)
        got = [None] * len(asks)

        def ask(i):
            got[i] = _chat(batched, asks[i])

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(asks))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert [g["choices"][0]["message"]["content"] for g in got] == want
        metrics = batched.get("/metrics").text
        steps = float(re.search(r"^freetoken_steps_total (\S+)$", metrics, re.M).group(1))
        alone = float(re.search(r'^freetoken_step_batch_size_bucket\{le="1.0"\} (\S+)$', metrics, re.M).group(1))
        assert steps > alone  # the batching worker ran them, some steps together
        # the next turn of the first conversation: its prompt repeats the first turn's
        turn = asks[0] + [{"role": "assistant", "content": want[0]}, {"role": "user", "content": "and subtract?"}]
        reply = _chat(batched, turn)
        assert reply["usage"]["prompt_tokens_details"]["cached_tokens"] > got[0]["usage"]["prompt_tokens"] // 2
    with _client(model_dir, max_seqs=1) as fresh:
        _ready(fresh)
        assert _chat(fresh, turn)["choices"][0]["message"]["content"] == reply["choices"][0]["message"]["content"]
