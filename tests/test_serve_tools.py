"""Tool calls through `freetoken serve` with the real `openai` client, on scripted replies: the server gives the
replies of $FREETOKEN_SERVE_SCRIPT in order instead of generating, so the parsing (whole and streamed) is checked
on exact text. The bundled model's template knows no tools: the server describes them itself (the hermes form)."""

from __future__ import annotations

import json

import openai
import pytest
from live_server import MODEL, running_server

CALL = 'Let me look.\n<tool_call>\n{"name": "read_file", "arguments": {"path": "a.py", "lines": [1, 2]}}\n</tool_call>'
TWO_CALLS = ('<tool_call>\n{"name": "read_file", "arguments": {"path": "a.py"}}\n</tool_call>\n'
             '<tool_call>\n{"name": "grep", "arguments": {"pattern": "def "}}\n</tool_call>')
#: one reply per request that reaches the engine, in the order the tests below send them
SCRIPT = [CALL, CALL, TWO_CALLS, "The file prints 1.", CALL]
TOOLS = [{"type": "function", "function": {
    "name": "read_file", "description": "Read a file",
    "parameters": {"type": "object", "properties": {"path": {"type": "string"},
                                                    "lines": {"type": "array", "items": {"type": "integer"}}},
                   "required": ["path"]}}},
    {"type": "function", "function": {"name": "grep", "parameters": {"type": "object"}}}]
USER = [{"role": "user", "content": "What does a.py print?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = tmp_path_factory.mktemp("script") / "replies.json"
    path.write_text(json.dumps(SCRIPT))
    yield from running_server(tmp_path_factory, env={"FREETOKEN_SERVE_SCRIPT": str(path)})


def test_a_call_in_a_whole_response(server):
    r = server.client().chat.completions.create(model=MODEL, messages=USER, tools=TOOLS)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me look."
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_") and call.function.name == "read_file"
    assert json.loads(call.function.arguments) == {"path": "a.py", "lines": [1, 2]}


def test_a_call_streamed_name_first_then_argument_fragments(server):
    chunks = list(server.client().chat.completions.create(model=MODEL, messages=USER, tools=TOOLS, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert deltas[0].role == "assistant"
    content = "".join(d.content or "" for d in deltas)
    calls = [tc for d in deltas for tc in d.tool_calls or ()]
    first = calls[0]
    assert first.index == 0 and first.id.startswith("call_") and first.function.name == "read_file"
    assert first.function.arguments == ""
    fragments = [tc.function.arguments for tc in calls[1:]]
    assert len(fragments) > 2 and all(tc.id is None and tc.function.name is None for tc in calls[1:])
    assert json.loads("".join(fragments)) == {"path": "a.py", "lines": [1, 2]}
    assert content.strip() == "Let me look."
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_two_calls_and_the_round_trip(server):
    client = server.client()
    r = client.chat.completions.create(model=MODEL, messages=USER, tools=TOOLS)
    calls = r.choices[0].message.tool_calls
    assert [c.function.name for c in calls] == ["read_file", "grep"] and len({c.id for c in calls}) == 2
    assert r.choices[0].message.content is None
    history = USER + [{"role": "assistant", "content": None, "tool_calls": [c.model_dump() for c in calls]}]
    history += [{"role": "tool", "tool_call_id": calls[0].id, "content": "print(1)"},
                {"role": "tool", "tool_call_id": calls[1].id, "content": "a.py:1: def f():"}]
    answer = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS)
    assert answer.choices[0].message.content == "The file prints 1."
    assert answer.choices[0].finish_reason == "stop" and not answer.choices[0].message.tool_calls
    assert answer.usage.prompt_tokens > r.usage.prompt_tokens  # the calls and their results are in the prompt


def test_tool_choice_none_leaves_the_text_alone(server):
    r = server.client().chat.completions.create(model=MODEL, messages=USER, tools=TOOLS, tool_choice="none")
    assert r.choices[0].message.content == CALL and not r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("kw, match", [
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "not among the tools"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools.0.function.name"),
    ({"tools": [{"type": "retrieval"}]}, "tools.0.type"),
])
def test_bad_tool_fields(server, kw, match):
    with pytest.raises(openai.BadRequestError, match=match):
        server.client().chat.completions.create(model=MODEL, messages=USER, **{"tools": TOOLS, **kw})
