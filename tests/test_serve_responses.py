"""The OpenAI Responses API (`POST /v1/responses`, `GET /v1/responses/{id}`) of `freetoken serve`, with the real
`openai` client and the OpenAI Agents SDK: two live servers, the bundled model generating (`server`) and one that
gives a scripted reply instead (`scripted`: every request gets the same text, a message and three calls, so that
the parsing into output items is checked on exact text whatever order the tests run in).

Every response object and stream event is validated with the `openai` package's own pydantic types (the SDK's
client does not validate what it receives): the raw JSON is read with httpx. The bundled model's prose is poor;
the tests check the protocol.
"""

from __future__ import annotations

import asyncio
import json
import types
from typing import Literal

import httpx
import openai
import pytest
from live_server import CTX, KEY, MODEL, kill_mid_stream, running_server
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from freetoken.testing.oracles import need

EVENT = TypeAdapter(ResponseStreamEvent)
HEADERS = {"Authorization": f"Bearer {KEY}"}

READ_FILE = {"type": "function", "name": "read_file", "description": "Read a file of the project",
             "parameters": {"type": "object", "properties": {"path": {"type": "string", "maxLength": 24}},
                            "required": ["path"], "additionalProperties": False}}
APPLY_PATCH = {"type": "custom", "name": "apply_patch", "description": "Edit files with a patch",
               "format": {"type": "grammar", "syntax": "lark", "definition": 'start: "*** Begin Patch" /(.|\\n)*/'}}
LIST_DIR = {"type": "namespace", "name": "fs", "description": "The file system",
            "tools": [{"type": "function", "name": "list_dir", "parameters": {"type": "object", "properties": {}}}]}
#: What Codex CLI sends besides its own tools: the API's hosted web search (left out, not an error)
TOOLS = [READ_FILE, APPLY_PATCH, LIST_DIR, {"type": "web_search", "external_web_access": False}]

PATCH = "*** Begin Patch\n*** Add File: b.py\n+print(2)\n*** End Patch"
#: The scripted server's reply to every request: text, then a function call, a custom tool call, a namespaced call
REPLY = ('Let me look.\n<tool_call>\n{"name": "read_file", "arguments": {"path": "a.py"}}\n</tool_call>\n'
         '<tool_call>\n' + json.dumps({"name": "apply_patch", "arguments": {"input": PATCH}}) + '\n</tool_call>\n'
         '<tool_call>\n{"name": "fs.list_dir", "arguments": {}}\n</tool_call>')
SCRIPTED_REQUESTS = 16  # more than the tests below send to the scripted server


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    yield from running_server(tmp_path_factory)


@pytest.fixture(scope="module")
def scripted(tmp_path_factory):
    path = tmp_path_factory.mktemp("script") / "replies.json"
    path.write_text(json.dumps([REPLY] * SCRIPTED_REQUESTS))
    # (a larger context: the tools' descriptions and a round trip's history take more than the default 512 tokens)
    yield from running_server(tmp_path_factory, "--ctx", "2048", env={"FREETOKEN_SERVE_SCRIPT": str(path)})


# ---- helpers ----------------------------------------------------------------------------------------------------
def _create(server, **body) -> dict:
    """A whole response, validated with the SDK's type."""
    r = httpx.post(server.url + "/v1/responses", json={"model": MODEL, **body}, headers=HEADERS, timeout=300)
    assert r.status_code == 200, r.text
    Response.model_validate(r.json())
    return r.json()


def _stream(server, **body) -> list[dict]:
    """The events of a streamed response, each validated with the SDK's types and checked for the API's order:
    numbered from 0, created and in_progress first, each output item's events between its added and done."""
    events = []
    with httpx.stream("POST", server.url + "/v1/responses", json={"model": MODEL, "stream": True, **body},
                      headers=HEADERS, timeout=300) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        name = None
        for line in r.iter_lines():
            if line.startswith("event:"):
                name = line[len("event:"):].strip()
            elif line.startswith("data:"):
                event = json.loads(line[len("data:"):])
                assert event["type"] == name  # the SSE event's name is the event's type, as OpenAI sends them
                events.append(event)
    for event in events:
        assert type(EVENT.validate_python(event)).model_fields["type"].annotation.__args__ == (event["type"],)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    kinds = [e["type"] for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert events[0]["response"]["status"] == "in_progress" and events[0]["response"]["output"] == []
    assert kinds[-1] in ("response.completed", "response.incomplete", "response.failed")
    items = [e for e in events if "output_index" in e]
    assert [e["output_index"] for e in items] == sorted(e["output_index"] for e in items)
    for index in {e["output_index"] for e in items}:
        mine = [e for e in items if e["output_index"] == index]
        assert mine[0]["type"] == "response.output_item.added" and mine[-1]["type"] == "response.output_item.done"
        assert all(e.get("item_id", mine[0]["item"]["id"]) == mine[0]["item"]["id"] for e in mine)
    done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    assert events[-1]["response"]["output"] == done
    return events


def _shape(response: dict) -> dict:
    """A response without what differs between two requests for the same reply (ids, times, the cache's share)."""
    out = {k: v for k, v in response.items() if k not in ("id", "created_at", "completed_at", "anchor")}
    out["output"] = [{k: v for k, v in item.items() if k not in ("id", "call_id")} for item in response["output"]]
    out["usage"] = {k: v for k, v in response["usage"].items() if k != "input_tokens_details"}
    return out


def _error(server, body: dict, status: int = 400) -> dict:
    r = httpx.post(server.url + "/v1/responses", json={"model": MODEL, **body}, headers=HEADERS, timeout=300)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    return error


def _tokens(text: str) -> int:
    from tokenizers import Tokenizer

    from freetoken.engine.loading.load import DEFAULT_MODEL

    return len(Tokenizer.from_file(str(DEFAULT_MODEL / "tokenizer.json")).encode(text, add_special_tokens=False).ids)


# ---- the bundled model ------------------------------------------------------------------------------------------
def test_whole_and_streamed_are_one_response(server):
    """A string input, cut by max_output_tokens: status incomplete, whole and streamed alike; the same prompt again
    comes from the KV cache."""
    whole = _create(server, input="def add(a, b):", max_output_tokens=6, temperature=0)
    assert whole["id"].startswith("resp_") and whole["object"] == "response" and whole["model"] == MODEL
    assert whole["status"] == "incomplete" and whole["incomplete_details"] == {"reason": "max_output_tokens"}
    [message] = whole["output"]
    assert message["type"] == "message" and message["id"].startswith("msg_") and message["role"] == "assistant"
    assert message["status"] == "incomplete" and message["content"][0]["type"] == "output_text"
    usage = whole["usage"]
    assert usage["input_tokens"] == _tokens("def add(a, b):\n") and usage["output_tokens"] == 6
    assert usage["total_tokens"] == usage["input_tokens"] + 6
    assert usage["output_tokens_details"]["reasoning_tokens"] == 0
    assert set(whole["anchor"]) == {"restored", "refused", "made"} and "max_tokens_capped" not in whole

    events = _stream(server, input="def add(a, b):", max_output_tokens=6, temperature=0)
    assert [e["type"] for e in events] == (
        ["response.created", "response.in_progress", "response.output_item.added", "response.content_part.added"]
        + ["response.output_text.delta"] * (len(events) - 8)
        + ["response.output_text.done", "response.content_part.done", "response.output_item.done",
           "response.incomplete"])
    final = events[-1]["response"]
    assert _shape(final) == _shape(whole)
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert text == message["content"][0]["text"] == events[-4]["text"]
    # the same prompt again: all but its last token come from the KV cache
    assert final["usage"]["input_tokens_details"]["cached_tokens"] == usage["input_tokens"] - 1


def test_item_list_input_and_instructions(server):
    """Messages as items (text parts, developer and assistant roles): instructions and the leading developer
    message are one system message; the prompt is exactly what the template writes of them."""
    r = server.client().responses.create(
        model=MODEL, instructions="Be brief.", max_output_tokens=3, temperature=0,
        input=[{"role": "developer", "content": "You write Python."},
               {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "def add(a, b):"}]},
               {"role": "assistant", "content": [{"type": "output_text", "text": "    return a + b"}]},
               {"role": "user", "content": "x = add(1, 2)"},
               {"type": "reasoning", "id": "rs_1", "summary": []}])
    assert r.instructions == "Be brief." and r.output[0].type == "message"
    assert r.usage.input_tokens == _tokens("Be brief.\n\nYou write Python.\ndef add(a, b):\n    return a + b\n"
                                           "x = add(1, 2)\n")


def test_a_forced_function_call_and_its_result(server):
    """tool_choice named, then required (streamed): a grammar holds the reply to one call; its output sent back,
    by previous_response_id or with the whole history, gives the same prompt and a message."""
    first = _create(server, input="Open the setup file.", tools=[READ_FILE], max_output_tokens=60, temperature=0,
                    tool_choice={"type": "function", "name": "read_file"})
    assert first["status"] == "completed" and first["tool_choice"] == {"type": "function", "name": "read_file"}
    [call] = first["output"]
    assert call["type"] == "function_call" and call["name"] == "read_file" and call["status"] == "completed"
    assert call["id"].startswith("fc_") and call["call_id"].startswith("call_")
    args = json.loads(call["arguments"])
    assert set(args) == {"path"} and len(args["path"]) <= 24

    events = _stream(server, input="Open the setup file.", tools=[READ_FILE], max_output_tokens=60, temperature=0,
                     tool_choice="required")
    fragments = [e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta"]
    [done] = [e for e in events if e["type"] == "response.function_call_arguments.done"]
    assert len(fragments) > 1 and "".join(fragments) == done["arguments"]
    assert set(json.loads(done["arguments"])) == {"path"}
    assert events[-1]["type"] == "response.completed"

    result = {"type": "function_call_output", "call_id": call["call_id"], "output": "from setuptools import setup"}
    chained = _create(server, input=[result], previous_response_id=first["id"], tools=[READ_FILE],
                      max_output_tokens=4, temperature=0)
    history = [{"role": "user", "content": "Open the setup file."}, call,
               {**result, "output": [{"type": "input_text", "text": "from setuptools import setup"}]}]
    whole = _create(server, input=history, tools=[READ_FILE], max_output_tokens=4, temperature=0, store=False)
    assert chained["previous_response_id"] == first["id"]
    for r in (chained, whole):
        assert [item["type"] for item in r["output"]] == ["message"], r["output"]
        assert r["usage"]["input_tokens"] == chained["usage"]["input_tokens"] > first["usage"]["input_tokens"]
    assert whole["output"][0]["content"] == chained["output"][0]["content"]  # greedy, from the same prompt


def test_tool_choice_none_does_not_tell_the_model(server):
    plain = _create(server, input="import os", max_output_tokens=2, temperature=0)
    none = _create(server, input="import os", tools=[READ_FILE], tool_choice="none", max_output_tokens=2,
                   temperature=0)
    assert none["usage"]["input_tokens"] == plain["usage"]["input_tokens"]
    assert none["tool_choice"] == "none" and none["tools"][0]["name"] == "read_file"
    assert [item["type"] for item in none["output"]] == ["message"]


SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "kind": {"enum": ["file", "dir"]},
                                           "size": {"type": "integer", "minimum": 0, "maximum": 999}},
          "required": ["name", "kind", "size"], "additionalProperties": False}


def test_text_format_json_schema(server):
    fmt = {"type": "json_schema", "name": "entry", "schema": SCHEMA, "strict": True}
    r = _create(server, input="Describe setup.py as JSON.", text={"format": fmt}, max_output_tokens=64000,
                temperature=0)
    assert r["status"] == "completed" and r["text"]["format"] == fmt
    # more than the context leaves: granted what fits, and said so (the bounded schema ends the reply long before)
    assert r["max_tokens_capped"] == {"requested": 64000, "granted": CTX - r["usage"]["input_tokens"]}
    value = json.loads(r["output"][0]["content"][0]["text"])
    assert set(value) == {"name", "kind", "size"} and len(value["name"]) <= 12 and value["kind"] in ("file", "dir")
    assert isinstance(value["size"], int) and 0 <= value["size"] <= 999


def test_stored_responses(server):
    client = server.client()
    r = client.responses.create(model=MODEL, input="x = 1", max_output_tokens=2, temperature=0)
    got = httpx.get(f"{server.url}/v1/responses/{r.id}", headers=HEADERS)
    assert got.status_code == 200 and got.json()["id"] == r.id and Response.model_validate(got.json())
    assert client.responses.retrieve(r.id).output[0].content[0].text == r.output[0].content[0].text
    # store=false: not kept, so neither retrievable nor a previous response
    gone = client.responses.create(model=MODEL, input="x = 1", max_output_tokens=2, temperature=0, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(gone.id)
    error = _error(server, {"input": "y", "previous_response_id": gone.id}, 404)
    assert error["param"] == "previous_response_id" and error["code"] == "previous_response_not_found"
    client.responses.delete(r.id)
    missing = httpx.get(f"{server.url}/v1/responses/{r.id}", headers=HEADERS)
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"
    assert server.metric("freetoken_requests_total", '{endpoint="/v1/responses/{id}",status="404"}') >= 1


@pytest.mark.parametrize("body, param", [
    ({}, "input"),
    ({"input": [{"role": "user", "content": "hi"}, {"type": "input_image", "image_url": "x"}]}, "input.1.type"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input.0.call_id"),
    ({"input": [{"role": "tool", "content": "hi"}]}, "input.0.role"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input.0.content.0.type"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input.0.type"),
    ({"input": ["hi"]}, "input.0"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": [{"type": "input_file"}]}]},
     "input.0.output.0.type"),
    ({"input": "hi", "tools": [{"type": "local_shell"}]}, "tools.0.type"),
    ({"input": "hi", "tools": [{"type": "function", "name": "bad name!"}]}, "tools.0.name"),
    ({"input": "hi", "tools": [READ_FILE], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
    ({"input": "hi", "tool_choice": "required"}, "tool_choice"),
    ({"input": "hi", "tools": [READ_FILE], "tool_choice": {"type": "allowed_tools", "mode": "auto"}},
     "tool_choice.type"),
    ({"input": "hi", "tools": [READ_FILE], "tool_choice": {"type": "custom", "name": "read_file"}}, "tool_choice"),
    ({"input": "hi", "tools": [READ_FILE], "tool_choice": "required", "text": {"format": {"type": "json_object"}}},
     "text.format"),
    ({"input": "hi", "tools": [READ_FILE, READ_FILE]}, "tools.1.name"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format"),
    ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "hi", "background": True}, "background"),
])
def test_bad_requests_name_the_field(server, body, param):
    assert _error(server, body)["param"] == param


def test_unknown_previous_response_is_a_404(server):
    with pytest.raises(openai.NotFoundError) as e:
        server.client().responses.create(model=MODEL, input="hi", previous_response_id="resp_unknown")
    assert e.value.body["param"] == "previous_response_id" and e.value.body["code"] == "previous_response_not_found"


def test_a_killed_client_cancels_its_response(server):
    script = (f"import openai\n"
              f"c = openai.OpenAI(base_url='{server.url}/v1', api_key='{KEY}', max_retries=0)\n"
              f"for event in c.responses.create(model='{MODEL}', input='import os', stream=True, temperature=1.0,\n"
              f"        max_output_tokens=4000):\n"
              f"    if event.type == 'response.output_text.delta':\n"
              f"        print('delta', flush=True)\n")
    kill_mid_stream(server, script, "delta")


def test_agents_sdk_runs_a_forced_tool(server):
    """An OpenAI Agents SDK agent on OpenAIResponsesModel, run whole and streamed: the model must call the tool
    (tool_choice required), the SDK runs it and stops on its result."""
    agents = need("agents", "the OpenAI Agents SDK, a client of the Responses API")
    agents.set_tracing_disabled(True)
    read = []

    @agents.function_tool
    def read_file(path: Literal["setup.py", "README.md"]) -> str:
        """Read a file of the project."""
        read.append(path)
        return f"the text of {path}"

    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
    agent = agents.Agent(name="reader", instructions="Read the file the user asks for.", tools=[read_file],
                         model=agents.OpenAIResponsesModel(model=MODEL, openai_client=client),
                         model_settings=agents.ModelSettings(tool_choice="required", max_tokens=60, temperature=0),
                         tool_use_behavior="stop_on_first_tool")

    async def run():
        whole = await agents.Runner.run(agent, "Open the setup file.")
        streamed = agents.Runner.run_streamed(agent, "Open the setup file.")
        async for _ in streamed.stream_events():
            pass
        return whole, streamed

    whole, streamed = asyncio.run(run())
    assert len(read) == 2 and whole.final_output == f"the text of {read[0]}"
    assert streamed.final_output == f"the text of {read[1]}"


# ---- scripted replies: the parsing into output items -----------------------------------------------------------
def _check_calls(output: list[dict]) -> None:
    message, read, patch, listing = output
    assert message["type"] == "message" and message["content"][0]["text"] == "Let me look."
    assert read["type"] == "function_call" and read["name"] == "read_file" and "namespace" not in read
    assert json.loads(read["arguments"]) == {"path": "a.py"} and read["status"] == "completed"
    assert patch["type"] == "custom_tool_call" and patch["name"] == "apply_patch" and patch["input"] == PATCH
    assert patch["id"].startswith("ctc_") and patch["call_id"].startswith("call_")
    assert listing["type"] == "function_call" and listing["name"] == "list_dir" and listing["namespace"] == "fs"
    assert json.loads(listing["arguments"]) == {}
    assert len({item["id"] for item in output}) == 4 and len({item.get("call_id") for item in output}) == 4


def test_calls_whole_and_streamed(scripted):
    whole = _create(scripted, input="What does a.py print?", tools=TOOLS)
    _check_calls(whole["output"])
    assert whole["status"] == "completed" and whole["tools"] == TOOLS  # echoed as sent, web_search included

    events = _stream(scripted, input="What does a.py print?", tools=TOOLS)
    final = events[-1]["response"]
    _check_calls(final["output"])
    assert _shape(final) == _shape(whole)
    kinds = [e["type"] for e in events]
    assert kinds.count("response.output_item.added") == 4 and kinds[-1] == "response.completed"
    [patch_delta] = [e for e in events if e["type"] == "response.custom_tool_call_input.delta"]
    assert patch_delta["delta"] == PATCH and patch_delta["output_index"] == 2
    args = [e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta"
            and e["output_index"] == 1]
    assert len(args) > 1 and json.loads("".join(args)) == {"path": "a.py"}


def test_call_outputs_by_previous_response_id_or_history(scripted):
    """The calls' results sent back by previous_response_id or with the whole history (the SDK's items as it got
    them) make the same prompt; a response not stored cannot be continued."""
    client = scripted.client()
    first = client.responses.create(model=MODEL, input="What does a.py print?", tools=TOOLS)
    calls = first.output[1:]
    results = [{"type": "function_call_output", "call_id": calls[0].call_id, "output": "print(1)"},
               {"type": "custom_tool_call_output", "call_id": calls[1].call_id, "output": "Done!"},
               {"type": "function_call_output", "call_id": calls[2].call_id,
                "output": [{"type": "input_text", "text": "a.py"}]}]
    chained = client.responses.create(model=MODEL, input=results, tools=TOOLS, previous_response_id=first.id)
    history = [{"role": "user", "content": "What does a.py print?"}]
    history += [item.model_dump(exclude_none=True) for item in first.output] + results
    whole = client.responses.create(model=MODEL, input=history, tools=TOOLS, store=False)
    assert chained.usage.input_tokens == whole.usage.input_tokens > first.usage.input_tokens
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model=MODEL, input=results, tools=TOOLS, previous_response_id=whole.id)


# ---- in process -------------------------------------------------------------------------------------------------
def test_an_error_after_the_stream_began():
    """The engine fails after the first text: an ``error`` event, then ``response.failed`` with the items done so
    far (none: the message was still open)."""
    from freetoken.serve.app import Defaults
    from freetoken.serve.responses_api import Reply, _stream
    from freetoken.serve.responses_output import OutputItems
    from freetoken.serve.responses_schemas import ResponsesRequest
    from freetoken.serve.worker import Job

    class BrokenWorker:
        def submit(self, job):
            job.events.put_nowait(("text", "Hello"))
            job.events.put_nowait(("error", RuntimeError("the device fell off")))

        def cancel(self, job):
            pass

    kept = []

    async def run():
        job = Job(ids=[1], max_tokens=4, sampling=None, stop=[], loop=asyncio.get_running_loop())
        reply = Reply(types.SimpleNamespace(model_name=MODEL, defaults=Defaults()),
                      ResponsesRequest.model_validate({"input": "hi", "stream": True}), OutputItems())
        return [json.loads(e["data"]) async for e in _stream(BrokenWorker(), job, reply, kept.append)]

    events = asyncio.run(run())
    for e in events:
        EVENT.validate_python(e)
    assert [e["type"] for e in events] == ["response.created", "response.in_progress", "response.output_item.added",
                                           "response.content_part.added", "response.output_text.delta", "error",
                                           "response.failed"]
    assert [e["sequence_number"] for e in events] == list(range(7))
    assert events[-2]["message"].startswith("the engine failed: RuntimeError")
    failed = events[-1]["response"]
    assert failed["status"] == "failed" and failed["error"]["code"] == "server_error" and kept == [failed]
