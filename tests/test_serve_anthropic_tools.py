"""Tool use through `freetoken serve`'s /v1/messages with the real `anthropic` client, on scripted replies: the
server gives the replies of $FREETOKEN_SERVE_SCRIPT in order instead of generating, so what the server makes of the
hermes text (tool_use blocks, whole and streamed) is checked on exact text. The bundled model's template knows no
tools: the server describes them itself. (A forced call on the real model: tests/test_serve_anthropic.py.)"""

from __future__ import annotations

import json

import anthropic
import httpx
import pytest
from live_server import KEY, MODEL, running_server

CALL = 'Let me look.\n<tool_call>\n{"name": "read_file", "arguments": {"path": "a.py", "lines": [1, 2]}}\n</tool_call>'
TWO_CALLS = ('Reading and searching.\n'
             '<tool_call>\n{"name": "read_file", "arguments": {"path": "a.py"}}\n</tool_call>\n'
             '<tool_call>\n{"name": "grep", "arguments": {"pattern": "def "}}\n</tool_call>\n')
ANSWER = "The file prints 1."
#: one reply per request that reaches the engine, in the order the tests below send them
SCRIPT = [CALL, TWO_CALLS, TWO_CALLS, TWO_CALLS, ANSWER, CALL, CALL]
TOOLS = [{"name": "read_file", "description": "Read a file",
          "input_schema": {"type": "object", "properties": {"path": {"type": "string"},
                                                            "lines": {"type": "array", "items": {"type": "integer"}}},
                           "required": ["path"]}},
         {"name": "grep", "input_schema": {"type": "object"}}]
USER = [{"role": "user", "content": "What does a.py print?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = tmp_path_factory.mktemp("script") / "replies.json"
    path.write_text(json.dumps(SCRIPT))
    yield from running_server(tmp_path_factory, env={"FREETOKEN_SERVE_SCRIPT": str(path)})


def _client(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0, timeout=300)


def _create(server, messages=USER, **kw):
    return _client(server).messages.create(model=MODEL, max_tokens=64, messages=messages, **{"tools": TOOLS, **kw})


def test_text_and_a_call_in_a_whole_message(server):
    m = _create(server)
    assert m.stop_reason == "tool_use" and m.stop_sequence is None
    text, call = m.content
    assert text.type == "text" and text.text == "Let me look."  # the newline before the call is dropped
    assert call.type == "tool_use" and call.id.startswith("toolu_") and call.name == "read_file"
    assert call.input == {"path": "a.py", "lines": [1, 2]}


def _sse(server, body: dict) -> list[dict]:
    with httpx.stream("POST", server.url + "/v1/messages", json=body, headers={"x-api-key": KEY}, timeout=300) as r:
        assert r.status_code == 200, r.read()
        lines = [line for line in r.iter_lines() if line.startswith(("event:", "data:"))]
    names = [line.split(":", 1)[1].strip() for line in lines if line.startswith("event:")]
    data = [json.loads(line.split(":", 1)[1]) for line in lines if line.startswith("data:")]
    assert [d["type"] for d in data] == names
    return data


def test_two_calls_streamed_as_tool_use_blocks(server):
    events = _sse(server, {"model": MODEL, "max_tokens": 64, "messages": USER, "tools": TOOLS, "stream": True})
    kinds = [e["type"] for e in events]
    assert kinds[:2] == ["message_start", "ping"] and kinds[-2:] == ["message_delta", "message_stop"]
    starts = [e for e in events if e["type"] == "content_block_start"]
    assert [e["index"] for e in starts] == [0, 1, 2]
    assert starts[0]["content_block"] == {"type": "text", "text": ""}
    for start, name in zip(starts[1:], ["read_file", "grep"], strict=True):
        block = start["content_block"]
        assert block["type"] == "tool_use" and block["id"].startswith("toolu_") and block["name"] == name
        assert block["input"] == {}
    assert len({s["content_block"].get("id") for s in starts}) == 3
    # each block: its start, its deltas, its stop, before the next one starts
    blocks = [e for e in events if e["type"].startswith("content_block")]
    for index in range(3):
        mine = [e for e in blocks if e["index"] == index]
        assert mine[0]["type"] == "content_block_start" and mine[-1]["type"] == "content_block_stop"
        assert {e["type"] for e in mine[1:-1]} == {"content_block_delta"}
        at = blocks.index(mine[0])
        assert blocks[at:at + len(mine)] == mine
    deltas = {i: [e["delta"] for e in blocks if e["index"] == i and e["type"] == "content_block_delta"]
              for i in range(3)}
    assert "".join(d["text"] for d in deltas[0]) == "Reading and searching."
    assert {d["type"] for d in deltas[1] + deltas[2]} == {"input_json_delta"}
    assert len(deltas[1]) > 1  # the arguments come in fragments, as they are generated
    assert json.loads("".join(d["partial_json"] for d in deltas[1])) == {"path": "a.py"}
    assert json.loads("".join(d["partial_json"] for d in deltas[2])) == {"pattern": "def "}
    assert events[-2]["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}

    with _client(server).messages.stream(model=MODEL, max_tokens=64, messages=USER, tools=TOOLS) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == "Reading and searching." and final.stop_reason == "tool_use"
    assert [b.type for b in final.content] == ["text", "tool_use", "tool_use"]
    assert [(b.name, b.input) for b in final.content[1:]] == [("read_file", {"path": "a.py"}),
                                                               ("grep", {"pattern": "def "})]


def test_the_round_trip(server):
    """The calls go back as the assistant's tool_use blocks and their results as the user's tool_result blocks;
    the scripted answer after them is plain text."""
    first = _create(server)  # TWO_CALLS
    calls = [b for b in first.content if b.type == "tool_use"]
    assert [c.name for c in calls] == ["read_file", "grep"]
    history = USER + [
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": calls[0].id, "content": "print(1)"},
            {"type": "tool_result", "tool_use_id": calls[1].id, "content": [{"type": "text", "text": "a.py:1: x"}]}]}]
    answer = _create(server, history)
    assert [(b.type, b.text) for b in answer.content] == [("text", ANSWER)]
    assert answer.stop_reason == "end_turn"
    assert answer.usage.input_tokens > first.usage.input_tokens  # the calls and their results are in the prompt
    counted = _client(server).messages.count_tokens(model=MODEL, messages=history, tools=TOOLS)
    assert counted.input_tokens == answer.usage.input_tokens


def test_tool_choice_none_leaves_the_hermes_text_alone(server):
    m = _create(server, tool_choice={"type": "none"})
    assert [(b.type, b.text) for b in m.content] == [("text", CALL)] and m.stop_reason == "end_turn"
    client = _client(server)
    with_tools = client.messages.count_tokens(model=MODEL, messages=USER, tools=TOOLS).input_tokens
    without = client.messages.count_tokens(model=MODEL, messages=USER, tools=TOOLS, tool_choice={"type": "none"})
    assert without.input_tokens == m.usage.input_tokens < with_tools  # none: the tools are not described


def test_a_named_tool_choice(server):
    """Forced, the call is constrained by a grammar (not applied to a scripted reply: the wiring is what counts)."""
    m = _create(server, tool_choice={"type": "tool", "name": "read_file", "disable_parallel_tool_use": True})
    assert m.stop_reason == "tool_use" and m.content[-1].name == "read_file"


@pytest.mark.parametrize("fields, says", [
    ({"tools": [{"name": "bad name!", "input_schema": {"type": "object"}}]}, "tools.0.name"),
    ({"tools": [{"name": "f"}]}, "input_schema"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "server tools"),
    ({"tool_choice": {"type": "tool", "name": "nope"}}, "'nope', which is not among the tools"),
    ({"tool_choice": {"type": "tool"}}, "needs the tool's name"),
    ({"tools": [], "tool_choice": {"type": "any"}}, "no tools"),
    ({"tool_choice": {"type": "sometimes"}}, "tool_choice.type"),
])
def test_bad_tools_get_anthropic_errors(server, fields, says):
    body = {"model": MODEL, "max_tokens": 8, "messages": USER, "tools": TOOLS, **fields}
    for path in ("/v1/messages", "/v1/messages/count_tokens"):
        r = httpx.post(server.url + path, json=body, headers={"x-api-key": KEY}, timeout=300)
        assert r.status_code == 400, r.text
        error = r.json()
        assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
        assert says in error["error"]["message"], error
    with pytest.raises(anthropic.BadRequestError, match="not among the tools"):
        _create(server, tool_choice={"type": "tool", "name": "nope"})
