"""`freetoken serve` against the real `openai` client: a live server in a subprocess on a free loopback port, with
the bundled model on the cpu device.

Greedy answers are compared between paths (streamed or whole, alone or among 16 concurrent clients): this server
runs one sequence at a time (``--max-seqs 1``), so the same prompt gives the same tokens whichever way it is asked
for (tests/test_serve_batched.py runs these tests again on a server that batches them, as the default does).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest
from live_server import CTX, KEY, MODEL, Server, kill_mid_stream, running_server

from freetoken.engine.loading.load import DEFAULT_MODEL


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    # one request at a time: the worker without batching (the other API modules' servers batch, the default)
    yield from running_server(tmp_path_factory, "--served-model-name", f"{MODEL},gpt-4o-mini", "--max-seqs", "1")


def _chat(client, text: str, **kw):
    kw.setdefault("temperature", 0)
    kw.setdefault("max_tokens", 12)
    return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": text}], **kw)


def _stream_text(client, text: str, **kw):
    chunks = list(_chat(client, text, stream=True, **kw))
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return content, chunks


def test_health_and_models(server):
    # the port opens before the model has loaded (seconds even with warm kernel caches): 503 first, then 200
    assert server.health[0] == 503 and server.health[-1] == 200 and set(server.health) == {200, 503}
    r = httpx.get(server.url + "/health")  # no key needed
    assert r.status_code == 200 and r.json() == {"status": "ok"}
    models = server.client().models.list()
    assert [m.id for m in models.data] == [MODEL]
    alias = server.client().chat.completions.create(model="gpt-4o-mini", max_tokens=2,
                                                    messages=[{"role": "user", "content": "hi"}])
    assert alias.model == MODEL and alias.usage.completion_tokens <= 2  # an alias from --served-model-name


def test_chat_whole_and_streamed_agree(server):
    client = server.client()
    whole = _chat(client, "def add(a, b):")
    choice = whole.choices[0]
    assert whole.object == "chat.completion" and whole.model == MODEL and choice.message.role == "assistant"
    assert choice.finish_reason in ("stop", "length") and choice.message.content
    u = whole.usage
    assert u.completion_tokens <= 12 and u.total_tokens == u.prompt_tokens + u.completion_tokens
    # the prompt as the template renders it: the bundled template writes each message and a newline
    from tokenizers import Tokenizer

    from freetoken.engine.loading.load import DEFAULT_MODEL

    tok = Tokenizer.from_file(str(DEFAULT_MODEL / "tokenizer.json"))
    assert u.prompt_tokens == len(tok.encode("def add(a, b):\n", add_special_tokens=False).ids)

    text, chunks = _stream_text(client, "def add(a, b):", stream_options={"include_usage": True})
    assert text == choice.message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == choice.finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == u.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])
    # the same conversation again: all but its last prompt token come from the KV cache
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == u.prompt_tokens - 1


def test_text_parts_and_system_messages(server):
    client = server.client()
    a = _chat(client, "import os\n")
    b = client.chat.completions.create(model=MODEL, temperature=0, max_tokens=12, messages=[
        {"role": "user", "content": [{"type": "text", "text": "import "}, {"type": "text", "text": "os\n"}]}])
    assert a.choices[0].message.content == b.choices[0].message.content
    r = client.chat.completions.create(model=MODEL, temperature=0, max_tokens=4, messages=[
        {"role": "developer", "content": "# a module"}, {"role": "user", "content": "import sys"}])
    assert r.usage.completion_tokens <= 4


def test_max_tokens_and_finish_reason_length(server):
    client = server.client()
    r = _chat(client, "class Parser:", max_tokens=3)
    assert r.usage.completion_tokens == 3 and r.choices[0].finish_reason == "length"
    r = _chat(client, "class Parser:", max_completion_tokens=2)
    assert r.usage.completion_tokens == 2


def test_stop_strings(server):
    client = server.client()
    full = _chat(client, "def main(argv):", max_tokens=24).choices[0].message.content
    assert len(full) >= 8, full
    stop = full[4:7]
    cut = full[:full.index(stop)]
    r = _chat(client, "def main(argv):", max_tokens=24, stop=[stop])
    assert r.choices[0].message.content == cut and r.choices[0].finish_reason == "stop"
    text, chunks = _stream_text(client, "def main(argv):", max_tokens=24, stop=stop)
    assert text == cut and [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"


def test_completions(server):
    client = server.client()
    r = client.completions.create(model=MODEL, prompt="import os\nimport ", max_tokens=6, temperature=0)
    assert r.object == "text_completion" and r.choices[0].text and r.usage.completion_tokens <= 6
    streamed = list(client.completions.create(model=MODEL, prompt="import os\nimport ", max_tokens=6,
                                              temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in streamed if c.choices) == r.choices[0].text
    echo = client.completions.create(model=MODEL, prompt="import os\nimport ", max_tokens=6, temperature=0,
                                     echo=True)
    assert echo.choices[0].text == "import os\nimport " + r.choices[0].text
    ids = server.post("/v1/completions", {"prompt": [7, 8, 9], "max_tokens": 2, "temperature": 0})
    assert ids.status_code == 200 and ids.json()["usage"]["prompt_tokens"] == 3


def _vocabulary() -> list[str]:
    """Each token id's text in the bundled model's tokenizer."""
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(DEFAULT_MODEL / "tokenizer.json"))
    return [tok.decode([i], skip_special_tokens=False) for i in range(tok.get_vocab_size())]


def test_logit_bias_forces_and_bans_tokens(server):
    """+100 on a token makes greedy decoding write it every time; -100 on every token that spells the greedy reply's
    first token makes the reply start otherwise (the real client's ``logit_bias``)."""
    client = server.client()
    vocab = _vocabulary()
    forced = next(i for i, t in enumerate(vocab) if t == "foo")
    r = client.completions.create(model=MODEL, prompt="import os\nimport ", max_tokens=3, temperature=0,
                                  logit_bias={str(forced): 100})
    assert r.choices[0].text == "foo" * 3
    first = client.completions.create(model=MODEL, prompt="import os\nimport ", max_tokens=1, temperature=0)
    text = first.choices[0].text
    banned = {str(i): -100 for i, t in enumerate(vocab) if t == text}
    assert banned, text
    other = client.completions.create(model=MODEL, prompt="import os\nimport ", max_tokens=1, temperature=0,
                                      logit_bias=banned)
    assert other.choices[0].text != text
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                          temperature=0, logit_bias={str(forced): 100})
    assert chat.choices[0].message.content == "foo" * 2


def test_seeded_sampling_repeats(server):
    client = server.client()
    a = _chat(client, "for i in range(", temperature=1.0, seed=7, max_tokens=10)
    b = _chat(client, "for i in range(", temperature=1.0, seed=7, max_tokens=10, top_p=0.9, extra_body={"top_k": 50})
    c = _chat(client, "for i in range(", temperature=1.0, seed=7, max_tokens=10, top_p=0.9, extra_body={"top_k": 50})
    assert b.choices[0].message.content == c.choices[0].message.content
    assert a.usage.completion_tokens <= 10


@pytest.mark.parametrize("body, status, param", [
    ('{"messages": [', 400, None),  # not JSON
    ("[1, 2]", 400, None),  # JSON, not an object
    ({"model": MODEL}, 400, "messages"),
    ({"messages": []}, 400, "messages"),
    ({"messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}, 400, "temperature"),
    ({"messages": [{"role": "user", "content": "hi"}], "temperature": 3.5}, 400, "temperature"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, 400, "max_tokens"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages.0.role"),
    ({"messages": [{"role": "user"}]}, 400, "messages.0"),
    ({"messages": [{"role": "user", "content": "hi"}], "n": 2}, 400, "n"),
    ({"messages": [{"role": "user", "content": "hi"}], "stop": ["a"] * 17}, 400, "stop"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, 400,
     "messages.content"),
    ({"messages": [{"role": "user", "content": "hi"}], "tool_choice": "required"}, 400, "tool_choice"),
    ({"messages": [{"role": "user", "content": "hi"}], "model": "gpt-9"}, 404, "model"),
    ({"messages": [{"role": "user", "content": "hi"}], "logit_bias": {"abc": 1}}, 400, "logit_bias"),
    ({"messages": [{"role": "user", "content": "hi"}], "logit_bias": {"4096": 1}}, 400, "logit_bias"),
    ({"messages": [{"role": "user", "content": "hi"}], "logit_bias": {"5": 101}}, 400, "logit_bias.5"),
])
def test_bad_requests_get_clear_errors(server, body, status, param):
    r = server.post("/v1/chat/completions", body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["message"] and err["type"] == "invalid_request_error" and err["param"] == param, err
    assert _chat(server.client(), "x = 1", max_tokens=2).usage.completion_tokens <= 2  # still serving


def test_errors_through_the_client(server):
    client = server.client()
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.BadRequestError) as e:
        _chat(client, "x y " * 400)  # over CTX tokens
    assert e.value.code == "context_length_exceeded" and f"holds {CTX} tokens" in str(e.value)
    with pytest.raises(openai.AuthenticationError):
        _chat(server.client(api_key="wrong"), "hi")
    r = server.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, key=None)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    r = httpx.get(server.url + "/v1/models", headers={"x-api-key": KEY})
    assert r.status_code == 200
    r = httpx.get(server.url + "/metrics")
    assert r.status_code == 401
    r = httpx.get(server.url + "/v1/nowhere", headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 404 and r.json()["error"]["message"]
    assert _chat(client, "x = 1", max_tokens=2).usage.completion_tokens <= 2


@pytest.mark.slow
def test_sixteen_concurrent_streams_get_their_own_answers(server):
    client = server.client()
    prompts = [f"def {name}_{i}(x):" for i, name in enumerate(
        ["parse", "render", "load", "save", "merge", "split", "check", "build", "walk", "scan", "fetch", "close",
         "open", "sort", "find", "count"])]
    expected = {p: _chat(client, p, max_tokens=6).choices[0].message.content for p in prompts}
    got, errors = {}, []

    def one(p):
        try:
            got[p] = _stream_text(server.client(), p, max_tokens=6)[0]
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(repr(e))

    threads = [threading.Thread(target=one, args=(p,)) for p in prompts]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    assert not errors and got == expected


def test_a_killed_client_frees_the_engine(server):
    script = (f"import openai, sys\n"
              f"c = openai.OpenAI(base_url='{server.url}/v1', api_key='{KEY}', max_retries=0)\n"
              f"for chunk in c.chat.completions.create(model='{MODEL}', stream=True, max_tokens=4000,\n"
              f"        temperature=1.0, messages=[{{'role': 'user', 'content': 'import os'}}]):\n"
              f"    print('chunk', flush=True)\n")
    kill_mid_stream(server, script, "chunk")
    t0 = time.monotonic()
    assert _chat(server.client(), "y = 2", max_tokens=2).usage.completion_tokens <= 2
    assert time.monotonic() - t0 < 60


def test_metrics(server):
    _chat(server.client(), "import re", max_tokens=3)
    r = httpx.get(server.url + "/metrics", headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    for name in ("freetoken_prompt_tokens_total", "freetoken_generated_tokens_total",
                 "freetoken_cached_prompt_tokens_total", "freetoken_prefill_tokens_per_second",
                 "freetoken_decode_tokens_per_second", "freetoken_time_to_first_token_seconds_count",
                 "freetoken_queue_length", "freetoken_requests_running", 'freetoken_kv_tokens{what="capacity"}',
                 'freetoken_requests_total{endpoint="/v1/chat/completions",status="200"}'):
        assert re.search(rf"^{re.escape(name)} ", r.text, re.M), name
    assert server.metric("freetoken_kv_tokens", '{what="capacity"}') == CTX
    assert server.metric("freetoken_generated_tokens_total") >= 3


def test_health_while_loading_and_after_a_failed_load():
    """In process, with a loader that waits and then fails: /health is 503 "loading", then 503 "error"; the API
    says why (503) instead of hanging."""
    from starlette.testclient import TestClient

    from freetoken.serve.app import create_app

    go, failures = threading.Event(), []

    def load():
        go.wait(30)
        raise ValueError("no such model")

    app = create_app(load, MODEL, api_key=None, on_load_error=failures.append)
    with TestClient(app) as client:
        assert client.get("/health").status_code == 503 and client.get("/health").json() == {"status": "loading"}
        r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 503 and r.json()["error"]["code"] == "model_loading"
        go.set()
        deadline = time.monotonic() + 10
        while not failures and time.monotonic() < deadline:
            time.sleep(0.01)
        h = client.get("/health")
        assert h.status_code == 503 and h.json() == {"status": "error", "error": "no such model"}
        r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 503 and "no such model" in r.json()["error"]["message"]
    assert [str(e) for e in failures] == ["no such model"]


def test_serve_with_a_missing_model_exits_with_one_line(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "freetoken", "serve", "--device", "cpu", "--port", "0", "--model",
                           str(tmp_path / "nothing-here")], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("freetoken serve: error: ") and "nothing-here" in last and "no such model" in last


@pytest.mark.parametrize("argv, expected", [
    (["--port", "70000"], "--port 70000: a TCP port is at most 65535"),
    (["--port", "x"], "argument --port: expected a whole number, got 'x'"),
    (["--pin-hot", "4"], "--pin-hot needs --pin-trace FILE here"),
    (["--max-seqs", "8", "--step-tokens", "4"], "--step-tokens 4 must hold one decode token of each of the "
                                                  "--max-seqs 8 running requests"),
    (["--max-seqs", "0"], "argument --max-seqs"),
])
def test_serve_rejects_bad_flags(argv, expected, capsys):
    from freetoken.cli import main

    assert main(["serve", "--device", "cpu", *argv]) == 2
    assert expected in capsys.readouterr().err


SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 16},
    "kind": {"enum": ["file", "dir", "link"]},
    "sizes": {"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 4},
    "owner": {"type": "object", "properties": {"uid": {"type": "integer"}, "admin": {"type": "boolean"}},
              "required": ["uid", "admin"], "additionalProperties": False}},
    "required": ["name", "kind", "sizes", "owner"], "additionalProperties": False}


def _follows(obj) -> bool:
    """``obj`` follows SCHEMA (checked by hand: no validator library needed)."""
    return (isinstance(obj, dict) and set(obj) == {"name", "kind", "sizes", "owner"}
            and isinstance(obj["name"], str) and len(obj["name"]) <= 16 and obj["kind"] in ("file", "dir", "link")
            and isinstance(obj["sizes"], list) and 1 <= len(obj["sizes"]) <= 4
            and all(isinstance(v, int) and not isinstance(v, bool) for v in obj["sizes"])
            and set(obj["owner"]) == {"uid", "admin"} and isinstance(obj["owner"]["uid"], int)
            and isinstance(obj["owner"]["admin"], bool))


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_json_schema_output_at_temperature_1(server, seed):
    r = _chat(server.client(), "Describe the file setup.py as JSON.", temperature=1.0, seed=seed, max_tokens=200,
              response_format={"type": "json_schema", "json_schema": {"name": "entry", "schema": SCHEMA}})
    text = r.choices[0].message.content
    assert r.choices[0].finish_reason == "stop", text
    assert _follows(json.loads(text)), text


def test_json_object_output_streamed(server):
    """Free-form JSON: nothing bounds its strings, so the reply may run out of tokens; what came is JSON so far,
    and a reply that ended by itself parses as one object."""
    text, chunks = _stream_text(server.client(), "config = ", temperature=1.0, seed=5, max_tokens=200,
                                response_format={"type": "json_object"})
    reason = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
    assert text.startswith("{"), text
    if reason == "stop":
        assert isinstance(json.loads(text), dict), text
    else:
        assert reason == "length"


def test_forced_tool_call_round_trip_with_the_bundled_model(server):
    client = server.client()
    tools = [{"type": "function", "function": {"name": "read_file", "parameters": {
        "type": "object", "properties": {"path": {"type": "string", "maxLength": 24}}, "required": ["path"],
        "additionalProperties": False}}},
             {"type": "function", "function": {"name": "list_dir", "parameters": {"type": "object"}}}]
    messages = [{"role": "user", "content": "Open the setup file."}]
    r = client.chat.completions.create(model=MODEL, messages=messages, tools=tools, temperature=1.0, seed=3,
                                       max_tokens=120, tool_choice={"type": "function",
                                                                    "function": {"name": "read_file"}})
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    [call] = choice.message.tool_calls
    args = json.loads(call.function.arguments)
    assert call.function.name == "read_file" and set(args) == {"path"} and len(args["path"]) <= 24
    streamed = list(client.chat.completions.create(model=MODEL, messages=messages, tools=tools, temperature=1.0,
                                                   seed=4, max_tokens=120, tool_choice="required", stream=True))
    deltas = [tc for c in streamed if c.choices for tc in c.choices[0].delta.tool_calls or ()]
    assert deltas[0].function.name in ("read_file", "list_dir")
    assert isinstance(json.loads("".join(d.function.arguments or "" for d in deltas)), dict)
    assert streamed[-1].choices[0].finish_reason == "tool_calls"
    messages += [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                 {"role": "tool", "tool_call_id": call.id, "content": "from setuptools import setup\nsetup()"}]
    answer = client.chat.completions.create(model=MODEL, messages=messages, tools=tools, temperature=0,
                                            max_tokens=8)
    assert answer.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert answer.usage.prompt_tokens > r.usage.prompt_tokens


@pytest.mark.parametrize("response_format, match", [
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "properties": 5}}},
     "response_format"),
    ({"type": "json_schema"}, "json_schema"),
    ({"type": "xml"}, "response_format.type"),
])
def test_bad_response_formats(server, response_format, match):
    with pytest.raises(openai.BadRequestError, match=match):
        _chat(server.client(), "x", response_format=response_format)


@pytest.mark.slow
def test_on_emu_with_a_small_expert_cache(tmp_path):
    """The same server on the emu device through a 40-slot expert cache (the bundled model has 96 experts): the
    reply streams, and /metrics shows the cache's counters and hit rate."""
    from live_server import Server

    emu = Server(tmp_path, "--device", "emu", "--cache-slots", "40")
    try:
        client = emu.client()
        text, chunks = _stream_text(client, "def add(a, b):", max_tokens=6, stream_options={"include_usage": True})
        assert text and chunks[-1].usage.completion_tokens <= 6
        whole = _chat(client, "def add(a, b):", max_tokens=6)
        assert whole.choices[0].message.content == text
        assert 0.0 <= emu.metric("freetoken_expert_cache_hit_rate") <= 1.0
        assert emu.metric("freetoken_experts_total", '{counter="cache_hits"}') + \
            emu.metric("freetoken_experts_total", '{counter="cache_misses"}') > 0
    finally:
        emu.stop()
    assert emu.proc.returncode == 0, emu.log.read_text()


# ---- hostile requests: a 4xx in the API's shape, counted, and the server still serving --------------------------
_DEEP = "[" * 10_000 + "]" * 10_000


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/messages"])
@pytest.mark.parametrize("raw,param,what", [
    ('{"messages": [{"role": "user", "content": "a\\ud800b"}], "max_tokens": 4}', "messages.0.content",
     "lone surrogate"),
    ('{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "metadata": ' + _DEEP + "}", None,
     "10001 deep"),
])
def test_hostile_bodies_get_a_400_in_the_apis_shape(server, path, raw, param, what):
    before = server.metric("freetoken_requests_total", f'{{endpoint="{path}",status="400"}}')
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as http:
        r = http.post(path, content=raw)
        assert r.status_code == 400 and r.headers["content-type"] == "application/json", r.text
        body = r.json()
        if path == "/v1/messages":
            assert body["type"] == "error" and what in body["error"]["message"], body
        else:
            assert body["error"]["type"] == "invalid_request_error" and what in body["error"]["message"], body
            assert body["error"]["param"] == param
        # the same keep-alive connection still serves
        ok = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x = 1"}],
                                                     "max_tokens": 2, "temperature": 0})
        assert ok.status_code == 200, ok.text
    assert server.metric("freetoken_requests_total", f'{{endpoint="{path}",status="400"}}') == before + 1


def test_an_oversized_body_gets_a_413_without_being_read(server):
    from freetoken.serve.request_body import MAX_BODY_BYTES

    for declared in (True, False):  # told by Content-Length, or found while the body streams in
        def chunks():
            piece = b" " * (1 << 20)
            for _ in range((MAX_BODY_BYTES >> 20) + 2):
                yield piece
        content = b" " * (MAX_BODY_BYTES + 1) if declared else chunks()
        r = httpx.post(server.url + "/v1/chat/completions", content=content, timeout=60,
                       headers={"Authorization": f"Bearer {KEY}"})
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large", r.text
    assert server.metric("freetoken_requests_total", '{endpoint="/v1/chat/completions",status="413"}') >= 2
    assert _chat(server.client(), "x = 1", max_tokens=2).usage.completion_tokens <= 2


def test_an_internal_error_is_a_counted_json_500():
    """A bug in a route: the client gets the API's JSON error body, /metrics counts it, the server goes on."""
    from starlette.testclient import TestClient

    from freetoken.serve.app import create_app

    def never_loads():  # long enough to outlast the test; then a load error, not a model of False
        threading.Event().wait(30)
        raise RuntimeError("this test's model never loads")

    app = create_app(never_loads, MODEL, api_key=None)

    @app.get("/v1/messages/broken")
    async def broken():
        raise TypeError("TextInputSequence must be str")

    with TestClient(app) as client:
        r = client.get("/v1/messages/broken")
        assert r.status_code == 500 and r.json() == {
            "type": "error", "error": {"type": "api_error",
                                       "message": "internal error: TypeError: TextInputSequence must be str"}}
        assert client.get("/health").status_code == 503  # still answering
        text = client.get("/metrics").text
    assert re.search(r'^freetoken_requests_total\{endpoint="other",status="500"\} 1\.0$', text, re.M), text
    assert re.search(r"^freetoken_requests_failed_total 1\.0$", text, re.M)


def test_mutated_requests_never_get_a_5xx(server):
    """300 requests made by mutating real bodies (types swapped, fields dropped, bytes flipped, nesting, huge
    numbers): each gets a 2xx or a 4xx with the API's error body, never a 5xx or a hang, and /health stays up.
    bench/fuzz_server.py runs the same generator for 10,000 requests."""
    from freetoken.testing import request_fuzz

    report = request_fuzz.run(server.url, 300, seed=40, api_key=KEY)
    assert not report.failures, report.table()
    assert sum(report.statuses.values()) == 300
    assert {c for _, c in report.statuses} <= {"2xx", "4xx"}
    # the mutations reach both outcomes on the main routes: some still valid, some refused
    for path in ("/v1/chat/completions", "/v1/messages", "/v1/responses"):
        assert report.statuses[path, "2xx"] > 0 and report.statuses[path, "4xx"] > 0, report.table()


def _run_client(code: str) -> subprocess.Popen:
    """A client process running ``code`` (``c``: an openai client of the server's)."""
    return subprocess.Popen([sys.executable, "-c", code])


def _wait_for(server, name: str, value: float, seconds: float = 60) -> None:
    deadline = time.monotonic() + seconds
    while server.metric(name) != value:
        assert time.monotonic() < deadline, f"{name} did not become {value}"
        time.sleep(0.05)


def test_a_non_streamed_request_whose_client_leaves_is_stopped_running_or_queued(tmp_path):
    """Agents send max_tokens of 8,000-64,000 without streaming: a client that gives up must free the engine within
    a decode step (running) or leave the queue (waiting), and each is counted cancelled. A server of its own with
    the model's whole context: the first request has ~8,000 tokens to write (a minute and more here), so the second
    surely finds it running and waits (at the module server's 512 it could finish before the second arrived)."""
    # one at a time; the model's own 32k: the first request surely outlasts the second's arrival
    server = Server(tmp_path, "--max-seqs", "1", ctx=None)
    try:
        _leaving_clients_are_cancelled(server)
    finally:
        server.stop()


def endless_client(server) -> str:
    """Code of a client process whose request cannot end before the model's context fills (minutes): a completion
    (no end-of-turn stop strings) with max_tokens 64,000 and the end-of-sequence token banned by ``logit_bias``
    (at temperature 1 a chat reply ended on its own once, in CI, before the test's next request arrived)."""
    eos = json.loads((DEFAULT_MODEL / "config.json").read_text())["eos_token_id"]
    return (f"import openai\nc = openai.OpenAI(base_url='{server.url}/v1', api_key='{KEY}', max_retries=0)\n"
            f"c.completions.create(model='{MODEL}', max_tokens=64000, temperature=1.0, prompt='import os',"
            f" logit_bias={{'{eos}': -100}})\n")


def _leaving_clients_are_cancelled(server):
    client = endless_client(server)
    cancelled = server.metric("freetoken_requests_cancelled_total")
    generated = server.metric("freetoken_generated_tokens_total")
    running = _run_client(client)  # runs (the queue is empty)
    try:
        _wait_for(server, "freetoken_requests_running", 1)
        waiting = _run_client(client)  # waits behind it
        try:
            _wait_for(server, "freetoken_queue_length", 1)
        finally:
            waiting.kill()
            waiting.wait()
        _wait_for(server, "freetoken_queue_length", 0, 10)  # dropped from the queue
        assert server.metric("freetoken_requests_cancelled_total") == cancelled + 1
        assert server.metric("freetoken_requests_running") == 1  # while the first still runs
    finally:
        running.kill()
        running.wait()
    _wait_for(server, "freetoken_requests_running", 0, 10)
    assert server.metric("freetoken_requests_cancelled_total") == cancelled + 2
    assert server.metric("freetoken_generated_tokens_total") == generated  # neither finished


def test_max_tokens_past_the_context_is_capped_and_reported(server):
    r = server.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "def f():"}],
                                             "max_tokens": 64000, "temperature": 0, "stop": ["\n", " ", "("]})
    body = r.json()
    assert r.status_code == 200 and body["max_tokens_capped"] == {
        "requested": 64000, "granted": CTX - body["usage"]["prompt_tokens"]}, body
    r = server.post("/v1/messages", {"model": MODEL, "messages": [{"role": "user", "content": "def f():"}],
                                     "max_tokens": 3, "temperature": 0})
    assert r.status_code == 200 and "max_tokens_capped" not in r.json()  # it fits: nothing to report
    with server.client().chat.completions.stream(model=MODEL, max_tokens=64000, temperature=0, stop=["\n", " "],
                                                 messages=[{"role": "user", "content": "x = 1"}]) as s:
        chunks = [e.chunk for e in s if e.type == "chunk"]
    last = chunks[-1].model_extra or {}
    assert [c for c in chunks if c.choices and c.choices[0].finish_reason] and \
        last.get("max_tokens_capped", {}).get("requested") == 64000, last
