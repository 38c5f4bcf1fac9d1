"""`freetoken serve`'s Anthropic Messages endpoints against the real `anthropic` client: a live server in a
subprocess (the bundled model on the cpu device), and in process a fake model for what the live one cannot show
(a load in progress, an engine that fails mid-stream).

The bundled model's chat template writes each message's content and a newline, so the prompt a conversation
becomes is known exactly, and the token counts are checked against the tokenizer.
"""

from __future__ import annotations

import json
import threading
import time

import anthropic
import httpx
import pytest
from live_server import CTX, KEY, MODEL, kill_mid_stream, running_server
from tokenizers import Tokenizer

from freetoken.engine.loading.load import DEFAULT_MODEL

USER = [{"role": "user", "content": "def add(a, b):"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    yield from running_server(tmp_path_factory)


@pytest.fixture(scope="module")
def tokens():
    tok = Tokenizer.from_file(str(DEFAULT_MODEL / "tokenizer.json"))
    return lambda text: len(tok.encode(text, add_special_tokens=False).ids)


def _client(server, key=KEY) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key=key, max_retries=0, timeout=300)


def _create(client, messages=USER, **kw):
    """A greedy reply. The client's recent versions no longer take ``temperature`` as an argument (newer Claude
    models ignore it): it goes as an extra field, which the server reads."""
    kw.setdefault("extra_body", {"temperature": 0})
    kw.setdefault("max_tokens", 12)
    return client.messages.create(model=MODEL, messages=messages, **kw)


def _streamed(client, messages=USER, **kw):
    kw.setdefault("extra_body", {"temperature": 0})
    kw.setdefault("max_tokens", 12)
    with client.messages.stream(model=MODEL, messages=messages, **kw) as stream:
        text = "".join(stream.text_stream)
        return text, stream.get_final_message()


def _post(server, path: str, body, key: str | None = KEY) -> httpx.Response:
    headers = {"x-api-key": key, "anthropic-version": "2023-06-01"} if key is not None else {}
    content = body if isinstance(body, str) else json.dumps(body)
    return httpx.post(server.url + path, content=content, headers=headers, timeout=300)


def _prompt_tokens(usage) -> int:
    """The whole prompt: ``input_tokens`` counts only what was not read from the cache, as the Anthropic API does."""
    return usage.input_tokens + usage.cache_read_input_tokens + usage.cache_creation_input_tokens


def _still_serving(server):
    assert _create(_client(server), max_tokens=2).usage.output_tokens <= 2


def test_a_whole_message(server, tokens):
    client = _client(server)
    m = _create(client)
    assert m.id.startswith("msg_") and m.type == "message" and m.role == "assistant" and m.model == MODEL
    [block] = m.content
    assert block.type == "text" and block.text
    assert m.stop_reason in ("end_turn", "max_tokens") and m.stop_sequence is None
    u = m.usage
    assert 1 <= u.output_tokens <= 12 and (u.output_tokens == 12) == (m.stop_reason == "max_tokens")
    assert u.cache_read_input_tokens == 0 and u.cache_creation_input_tokens == 0
    assert u.input_tokens == tokens("def add(a, b):\n")
    assert client.messages.count_tokens(model=MODEL, messages=USER).input_tokens == u.input_tokens
    short = _create(client, max_tokens=3)
    assert short.stop_reason == "max_tokens" and short.usage.output_tokens == 3


def test_streamed_equals_whole(server):
    client = _client(server)
    whole = _create(client)
    text, final = _streamed(client)
    assert text == whole.content[0].text and final.content[0].text == text
    assert final.stop_reason == whole.stop_reason and final.stop_sequence is None
    assert _prompt_tokens(final.usage) == _prompt_tokens(whole.usage)
    assert final.usage.cache_read_input_tokens == _prompt_tokens(whole.usage) - 1  # all but the last token reused
    assert final.usage.output_tokens == whole.usage.output_tokens


def test_the_stream_is_the_anthropic_event_sequence(server):
    whole = _create(_client(server), max_tokens=4)
    body = {"model": MODEL, "messages": USER, "max_tokens": 4, "temperature": 0, "stream": True}
    with httpx.stream("POST", server.url + "/v1/messages", json=body, headers={"x-api-key": KEY},
                      timeout=300) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line.startswith(("event:", "data:"))]
    names = [line.split(":", 1)[1].strip() for line in lines if line.startswith("event:")]
    data = [json.loads(line.split(":", 1)[1]) for line in lines if line.startswith("data:")]
    assert [d["type"] for d in data] == names
    deltas = names.count("content_block_delta")
    assert deltas >= 1 and names == ["message_start", "content_block_start", "ping", *["content_block_delta"] * deltas,
                                     "content_block_stop", "message_delta", "message_stop"]
    start = data[0]["message"]
    assert start["content"] == [] and start["stop_reason"] is None and start["usage"]["input_tokens"] > 0
    assert "".join(d["delta"]["text"] for d in data if d["type"] == "content_block_delta") == whole.content[0].text
    assert data[-2]["delta"] == {"stop_reason": whole.stop_reason, "stop_sequence": None}
    # the usage, with the cached tokens (message_start cannot know them yet: its input_tokens is the whole prompt)
    assert data[-2]["usage"] == {"output_tokens": whole.usage.output_tokens, "input_tokens": 1,
                                 "cache_read_input_tokens": start["usage"]["input_tokens"] - 1,
                                 "cache_creation_input_tokens": 0}


def test_stop_sequences(server):
    client = _client(server)
    prompt = [{"role": "user", "content": "def main(argv):"}]
    full = _create(client, prompt).content[0].text
    assert len(full) >= 8, full
    stop = full[4:7]
    cut = full[:full.index(stop)]
    m = _create(client, prompt, stop_sequences=["\x00never", stop])
    assert m.content[0].text == cut and m.stop_reason == "stop_sequence" and m.stop_sequence == stop
    text, final = _streamed(client, prompt, stop_sequences=[stop])
    assert text == cut and final.stop_reason == "stop_sequence" and final.stop_sequence == stop


def test_system_as_a_string_and_as_blocks(server, tokens):
    client = _client(server)
    a = _create(client, system="# a module\n")
    b = _create(client, system=[{"type": "text", "text": "# a "}, {"type": "text", "text": "module\n"}])
    assert a.content[0].text == b.content[0].text
    assert _prompt_tokens(a.usage) == _prompt_tokens(b.usage) == tokens("# a module\n\ndef add(a, b):\n")
    assert b.usage.cache_read_input_tokens == _prompt_tokens(b.usage) - 1 and b.usage.input_tokens == 1


def test_claude_codes_requests_as_it_sends_them(server, tokens):
    """Claude Code puts system entries among the messages, sends its history's thinking blocks back, marks blocks
    with cache_control, sends metadata and beta headers (``?beta=true`` through the client's beta namespace), and
    probes ``HEAD /``: all accepted; the system entries render where they stand (the bundled template allows it),
    the thinking is not rendered (its template has no reasoning), and count_tokens counts what is rendered."""
    cc = {"type": "ephemeral"}
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "x = 1", "cache_control": cc}]},
        {"role": "system", "content": "# a reminder"},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "they want y", "signature": "c2ln"},
            {"type": "redacted_thinking", "data": "ZW5j"},
            {"type": "text", "text": "y = 2"}]},
        {"role": "system", "content": [{"type": "text", "text": "# more", "cache_control": cc}]},
        {"role": "user", "content": "z ="},
    ]
    client = _client(server)
    extra = {"temperature": 0}
    m = client.beta.messages.create(model=MODEL, max_tokens=3, messages=messages, extra_body=extra,
                                    system=[{"type": "text", "text": "# sys", "cache_control": cc}],
                                    metadata={"user_id": "u1"}, betas=["claude-code-20250219",
                                                                       "interleaved-thinking-2025-05-14"])
    rendered = "# sys\nx = 1\n# a reminder\ny = 2\n# more\nz =\n"
    assert _prompt_tokens(m.usage) == tokens(rendered), m.usage
    counted = client.beta.messages.count_tokens(model=MODEL, messages=messages, system="# sys",
                                                betas=["claude-code-20250219"])
    assert counted.input_tokens == tokens(rendered)
    streamed = client.messages.create(model=MODEL, max_tokens=3, messages=messages, system="# sys", stream=True,
                                      extra_body=extra, extra_headers={"anthropic-beta": "claude-code-20250219"})
    assert [e.type for e in streamed][-1] == "message_stop"
    for method in ("HEAD", "GET"):
        assert httpx.request(method, server.url + "/").status_code == 200


def test_system_entries_fold_into_the_system_prompt_where_the_template_refuses_them():
    from freetoken.engine.generation.chat import ChatTemplate
    from freetoken.serve.anthropic_api import template_messages
    from freetoken.serve.anthropic_schemas import CountTokensRequest

    strict = ChatTemplate("{% for m in messages %}{% if m.role == 'system' and not loop.first %}"
                          "{{ raise_exception('System message must be at the beginning.') }}{% endif %}"
                          "<{{ m.role }}>{{ m.content }}{% endfor %}")
    body = CountTokensRequest.model_validate({"model": MODEL, "system": "S", "messages": [
        {"role": "user", "content": "u"}, {"role": "system", "content": "R1"}, {"role": "assistant", "content": "a"},
        {"role": "system", "content": [{"type": "text", "text": "R2"}]}, {"role": "user", "content": "v"}]})
    folded = template_messages(body, strict)
    assert folded == [{"role": "system", "content": "S\n\nR1\n\nR2"}, {"role": "user", "content": "u"},
                      {"role": "assistant", "content": "a"}, {"role": "user", "content": "v"}]
    lenient = ChatTemplate("{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}")
    assert [m["role"] for m in template_messages(body, lenient)] == ["system", "user", "system", "assistant",
                                                                     "system", "user"]
    # no system prompt and the only system entry first: nothing to fold, it is the system prompt already
    first = CountTokensRequest.model_validate({"model": MODEL, "messages": [
        {"role": "system", "content": "R"}, {"role": "user", "content": "u"}]})
    assert template_messages(first, strict) == [{"role": "system", "content": "R"}, {"role": "user", "content": "u"}]


def test_thinking_reaches_a_template_that_renders_reasoning():
    from freetoken.engine.generation.chat import ChatTemplate
    from freetoken.serve.anthropic_api import template_messages
    from freetoken.serve.anthropic_schemas import CountTokensRequest

    body = CountTokensRequest.model_validate({"model": MODEL, "messages": [
        {"role": "user", "content": "u"},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "hm", "signature": "s"},
                                          {"type": "redacted_thinking", "data": "x"}, {"type": "text", "text": "a"}]},
        {"role": "user", "content": [{"type": "text", "text": "v"}]}]})
    reasoning = ChatTemplate("{% for m in messages %}{% if m.reasoning_content %}<think>{{ m.reasoning_content }}"
                             "</think>{% endif %}{{ m.content }}|{% endfor %}")
    rendered = reasoning.render(template_messages(body, reasoning), add_generation_prompt=False)
    assert rendered == "u|<think>hm</think>a|v|"


def test_a_tool_use_conversation(server, tokens):
    """tool_use blocks render as the assistant's calls, tool_result blocks as tool messages in their place (the
    bundled template writes contents only: the prompt shows the order)."""
    client = _client(server)
    messages = [
        {"role": "user", "content": "What does a.py print?"},
        {"role": "assistant", "content": [
            {"type": "text", "text": "Let me look."},
            {"type": "tool_use", "id": "toolu_1", "name": "read_file", "input": {"path": "a.py"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": "print(1)"},
            {"type": "tool_result", "tool_use_id": "toolu_2", "is_error": True,
             "content": [{"type": "text", "text": "no such file"}]},
            {"type": "text", "text": "So?"}]},
    ]
    expected = "What does a.py print?\nLet me look.\nprint(1)\nError: no such file\nSo?\n"
    assert client.messages.count_tokens(model=MODEL, messages=messages).input_tokens == tokens(expected)
    m = _create(client, messages, max_tokens=4)
    assert _prompt_tokens(m.usage) == tokens(expected) and m.content[0].type == "text" and m.usage.output_tokens <= 4


def test_a_final_assistant_message_is_continued(server, tokens):
    client = _client(server)
    messages = [{"role": "user", "content": "x = 1"}, {"role": "assistant", "content": "def add("}]
    assert client.messages.count_tokens(model=MODEL, messages=messages).input_tokens == tokens("x = 1\ndef add(")
    assert _create(client, messages, max_tokens=3).usage.output_tokens <= 3


def test_a_forced_tool_call_with_the_bundled_model(server):
    """``tool_choice`` tool and any: a grammar holds the sampled reply to one call whose input follows the tool's
    schema (bounded strings, so that it ends), whole and streamed."""
    client = _client(server)
    tools = [{"name": "read_file", "description": "Read a file", "input_schema": {
        "type": "object", "properties": {"path": {"type": "string", "maxLength": 24}}, "required": ["path"],
        "additionalProperties": False}},
             {"name": "list_dir", "input_schema": {"type": "object", "properties": {}, "additionalProperties": False}}]
    messages = [{"role": "user", "content": "Open the setup file."}]
    m = _create(client, messages, tools=tools, tool_choice={"type": "tool", "name": "read_file"}, max_tokens=120,
                extra_body={"temperature": 1.0})
    assert m.stop_reason == "tool_use", m
    [call] = m.content
    assert call.type == "tool_use" and call.name == "read_file" and call.id.startswith("toolu_")
    assert set(call.input) == {"path"} and isinstance(call.input["path"], str) and len(call.input["path"]) <= 24
    _, final = _streamed(client, messages, tools=tools, tool_choice={"type": "any"}, max_tokens=120,
                         extra_body={"temperature": 1.0})
    assert final.stop_reason == "tool_use", final
    [call] = final.content
    assert call.type == "tool_use" and call.name in ("read_file", "list_dir")
    assert set(call.input) == ({"path"} if call.name == "read_file" else set()), call.input


def _user(content):
    return {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": content}]}


@pytest.mark.parametrize("path, body, status, kind, says", [
    ("/v1/messages", '{"model": ', 400, "invalid_request_error", "not valid JSON"),
    ("/v1/messages", "[1]", 400, "invalid_request_error", "JSON object"),
    ("/v1/messages", {"model": MODEL, "messages": USER}, 400, "invalid_request_error", "max_tokens"),
    ("/v1/messages", {"max_tokens": 4, "messages": USER}, 400, "invalid_request_error", "model"),
    ("/v1/messages", {**_user("hi"), "max_tokens": 0}, 400, "invalid_request_error", "max_tokens"),
    ("/v1/messages", {**_user("hi"), "temperature": 1.5}, 400, "invalid_request_error", "temperature"),
    ("/v1/messages", {**_user("hi"), "messages": [{"role": "tool", "content": "hi"}]}, 400,
     "invalid_request_error", "messages.0.role"),
    ("/v1/messages", _user([{"type": "text"}]), 400, "invalid_request_error", "messages.0.content.0.text"),
    ("/v1/messages", _user([{"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": ""}}]),
     400, "invalid_request_error", "text only"),
    ("/v1/messages", _user([{"type": "tool_use", "id": "t", "name": "f", "input": {}}]), 400,
     "invalid_request_error", "belongs in an assistant message"),
    ("/v1/messages", {**_user("hi"), "tools": [{"type": "web_search_20250305", "name": "web_search"}]}, 400,
     "invalid_request_error", "server tools"),
    ("/v1/messages", {**_user("hi"), "model": "claude-opus-4"}, 404, "not_found_error", "does not exist"),
    ("/v1/messages/count_tokens", {"model": MODEL}, 400, "invalid_request_error", "messages"),
    ("/v1/messages/count_tokens", {"model": "claude-opus-4", "messages": USER}, 404, "not_found_error",
     "does not exist"),
    ("/v1/messages/nowhere", {}, 404, "not_found_error", "Not Found"),
])
def test_bad_requests_get_anthropic_errors(server, path, body, status, kind, says):
    r = _post(server, path, body)
    assert r.status_code == status, r.text
    assert r.json()["type"] == "error" and r.json()["error"]["type"] == kind and says in r.json()["error"]["message"]
    _still_serving(server)


def test_errors_through_the_client(server):
    client = _client(server)
    with pytest.raises(anthropic.NotFoundError, match="does not exist"):
        client.messages.create(model="claude-opus-4", max_tokens=4, messages=USER)
    with pytest.raises(anthropic.BadRequestError, match=f"holds {CTX} tokens"):
        _create(client, [{"role": "user", "content": "x y " * 400}])
    with pytest.raises(anthropic.AuthenticationError):
        _create(_client(server, key="wrong"))
    r = _post(server, "/v1/messages", {"model": MODEL, "max_tokens": 4, "messages": USER}, key=None)
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert r.json()["error"]["message"].startswith("Incorrect or missing API key")
    _still_serving(server)
    assert server.metric("freetoken_requests_total", '{endpoint="/v1/messages",status="200"}') >= 1
    assert server.metric("freetoken_requests_total", '{endpoint="/v1/messages/count_tokens",status="404"}') >= 1


def test_a_killed_streaming_client_frees_the_engine(server):
    script = (f"import anthropic\n"
              f"c = anthropic.Anthropic(base_url='{server.url}', api_key='{KEY}', max_retries=0)\n"
              f"with c.messages.stream(model='{MODEL}', max_tokens=4000, extra_body={{'temperature': 1.0}},\n"
              f"        messages=[{{'role': 'user', 'content': 'import os'}}]) as s:\n"
              f"    for text in s.text_stream:\n"
              f"        print('text', flush=True)\n")
    kill_mid_stream(server, script, "text")
    _still_serving(server)


# ---- in process: a fake model ---------------------------------------------------------------------------------
class _FakeModel:
    """Enough of a Model for the routes and the worker: a word per token; its generation says one word, then
    fails (``fail``) or ends."""

    def __init__(self, fail: bool):
        from freetoken.engine.generation.chat import ChatTemplate

        self.fail = fail
        self.chat_template = ChatTemplate.chatml()
        self.decoder = type("Decoder", (), {"ctx": 4096, "length": 0})()
        self.experts = type("Experts", (), {"counters": staticmethod(dict)})()

    def encode(self, text, add_special_tokens=True):
        return list(range(len(text.split())))

    def generate_text(self, ids, max_tokens, sampling, **options):
        from freetoken.engine.decoding.stats import Generation, GenerationStats

        return Generation(self._words(), GenerationStats(generated_tokens=1, finish_reason="stop"))

    def _words(self):
        yield "Hello"
        if self.fail:
            raise RuntimeError("the device fell off the bus")


def _in_process(model_ready: threading.Event, fail: bool = False):
    from starlette.testclient import TestClient

    from freetoken.serve.app import create_app

    def load():
        model_ready.wait(30)
        return _FakeModel(fail)

    return TestClient(create_app(load, MODEL, api_key=None))


def _wait_ready(client):
    for _ in range(1000):
        if client.get("/health").status_code == 200:
            return
        time.sleep(0.01)
    raise AssertionError("the fake model did not load")


def test_a_loading_model_is_a_503_overloaded_error():
    go = threading.Event()
    with _in_process(go) as client:
        for path in ("/v1/messages", "/v1/messages/count_tokens"):
            r = client.post(path, json={"model": MODEL, "max_tokens": 4, "messages": USER})
            assert r.status_code == 503 and r.json()["error"]["type"] == "overloaded_error", r.text
            assert "still loading" in r.json()["error"]["message"]
        go.set()
        _wait_ready(client)
        r = client.post("/v1/messages/count_tokens", json={"model": MODEL, "messages": USER})
        assert r.status_code == 200 and r.json()["input_tokens"] > 0


def test_an_engine_failure_mid_stream_is_an_error_event():
    go = threading.Event()
    go.set()
    with _in_process(go, fail=True) as client:
        _wait_ready(client)
        body = {"model": MODEL, "max_tokens": 4, "messages": USER, "stream": True}
        with client.stream("POST", "/v1/messages", json=body) as r:
            assert r.status_code == 200
            lines = [line for line in r.iter_lines() if line.startswith(("event:", "data:"))]
        assert lines[-2] == "event: error"
        error = json.loads(lines[-1].split(":", 1)[1])
        assert error["type"] == "error" and error["error"]["type"] == "api_error"
        assert "fell off the bus" in error["error"]["message"]
        assert "event: content_block_delta" in lines  # the word before the failure came through
        r = client.post("/v1/messages", json={"model": MODEL, "max_tokens": 4, "messages": USER})
        assert r.status_code == 500 and r.json()["error"]["type"] == "api_error"
