"""The OpenAI Responses API: ``POST /v1/responses``, ``GET /v1/responses/{id}`` and ``DELETE /v1/responses/{id}``,
so that agents built on it (Codex CLI, the OpenAI Agents SDK) run on the served model.

One engine, three API skins: a request's ``instructions`` and ``input`` items become the chat-template messages the
chat route builds (:func:`template_messages`), rendered with the model's template, its tools told to the model, its
reply parsed and its forced calls and JSON formats held to a grammar as on the chat route
(:mod:`freetoken.serve.tool_use`, :mod:`freetoken.serve.jobs`); the prefix cache and the anchors work the same. What
differs is the shape: items in, items out (:mod:`freetoken.serve.responses_output`), the whole response object or
its named server-sent events.

- ``instructions`` and the leading system and developer messages are one system message; later ones stay system
  messages where they stand, or are folded into the first where the template refuses them there.
- An assistant's ``function_call`` items become its message's ``tool_calls`` (the calls that follow an assistant
  message join it; consecutive calls are one message), ``function_call_output`` items ``tool`` messages;
  ``reasoning`` items are dropped (the model here writes none).
- ``tools``: a ``function`` tool is a function definition; a ``custom`` (freeform) tool, whose input is free text,
  is told to the model as a function of one string argument ``input`` (its grammar, if any, in that argument's
  description) and its call comes back as a ``custom_tool_call`` item; the tools of a ``namespace`` are told as
  ``NAMESPACE.NAME`` and their calls carry ``namespace``. The API's hosted tools (``web_search``, ``file_search``,
  ``image_generation``, ``code_interpreter``, ``mcp``, ``tool_search``... which OpenAI's servers run) are left out:
  the model is not told of them, and the agent works with the tools it runs itself (Codex sends ``web_search`` by
  default). The built-in tools the client runs on items of their own (:data:`CLIENT_TOOLS`) are a 400: without
  them such an agent cannot act, and a function tool does the same.
- ``store`` (default true) keeps the response, with its conversation, for ``previous_response_id`` and ``GET``
  (:mod:`freetoken.serve.responses_store`); ``instructions`` are not carried over, as the API has it.

Reused prompt tokens (the prefix cache, an anchor) are ``usage.input_tokens_details.cached_tokens``. A request may
name an ``anchor`` to resume from, as on the other routes; what came of it is the response's extra field ``anchor``
(and ``max_tokens_capped`` where the context left less than ``max_output_tokens``:
:func:`freetoken.serve.jobs.reply_extras`). Errors are the OpenAI error body, naming the field (``input.3.type``).
"""

from __future__ import annotations

import itertools
import json
import time
from contextlib import aclosing

from fastapi import APIRouter, Request
from pydantic import TypeAdapter
from sse_starlette import EventSourceResponse
from starlette.responses import JSONResponse

from freetoken.engine.decoding.grammar import json_schema_grammar
from freetoken.serve.errors import APIError
from freetoken.serve.jobs import (
    begin,
    collect,
    grammar_constraint,
    job_events,
    make_job,
    place_system_messages,
    reply_extras,
    template_tool_call,
    with_anchors,
)
from freetoken.serve.responses_output import OutputItems, ToolRef, done_items, new_id
from freetoken.serve.responses_schemas import (
    CustomTool,
    CustomToolCallItem,
    CustomToolCallOutputItem,
    FunctionCallItem,
    FunctionCallOutputItem,
    FunctionTool,
    InputItem,
    Message,
    NamedToolChoice,
    NamespaceTool,
    ReasoningItem,
    ResponsesRequest,
    parts_text,
    refuse_unsupported,
)
from freetoken.serve.responses_store import Stored, store_of
from freetoken.serve.tool_use import ToolUse, tool_use
from freetoken.serve.worker import Job

router = APIRouter()
ENDPOINTS = ("/v1/responses",)
#: The path of one stored response (for the request metrics' endpoint label)
ONE_RESPONSE = "/v1/responses/{id}"

#: Built-in tools the client runs on output items of their own (``local_shell_call``...), which this server does not
#: write: refused (a function tool does the same job). Every other type that is not a function, custom or namespace
#: tool is one the API runs on its side (web search...): left out.
CLIENT_TOOLS = ("local_shell", "shell", "apply_patch", "computer", "computer_use", "computer_use_preview")

_ITEMS = TypeAdapter(InputItem)


@router.post("/v1/responses")
async def create_response(request: Request):
    state, body, worker = await begin(request, ResponsesRequest)
    refuse_unsupported(body)
    store = store_of(request.app)
    history = _history(store, body.previous_response_id)
    items = [(item, "previous_response_id") for item in history] + _input_items(body)
    tools = ToolSet(body.tools)
    _check_choice(body, tools)
    template = worker.template
    functions = tools.functions if body.tool_choice != "none" else []
    use = tool_use(template, template_messages(body.instructions, items, tools, template), functions)
    ids = worker.model.encode(_render(use, template), add_special_tokens=False)
    job = make_job(state, ids, worker.end_of_turn, max_tokens=body.max_output_tokens, prompt_param="input",
                   temperature=body.temperature, top_p=body.top_p)
    job.constraint = await _constraint(worker, body, use, tools)
    await with_anchors(worker, job, use, body.anchor)
    reply = Reply(state, body, OutputItems(use.parser, tools.lookup))

    def keep(response: dict) -> None:
        """Store ``response`` with its conversation (unless the request said ``store: false``)."""
        if body.store is not False:
            outputs = [_ITEMS.validate_python(item) for item in response["output"]]
            store.put(response["id"], Stored(response, (*history, *(i for i, _ in _input_items(body)), *outputs)))

    if body.stream:
        return EventSourceResponse(_stream(worker, job, reply, keep), ping=15)
    text, outcome = await collect(worker, job, request)
    response = reply.whole(text, outcome)
    keep(response)
    return JSONResponse(response)


@router.get("/v1/responses/{response_id}")
async def get_response(request: Request, response_id: str):
    stored = store_of(request.app).get(response_id)
    if stored is None:
        raise _not_found(response_id)
    return JSONResponse(stored.response)


@router.delete("/v1/responses/{response_id}")
async def delete_response(request: Request, response_id: str):
    if not store_of(request.app).delete(response_id):
        raise _not_found(response_id)
    return {"id": response_id, "object": "response", "deleted": True}


def _not_found(response_id: str) -> APIError:
    return APIError(404, f"Response with id {response_id!r} not found (this server keeps the last responses made "
                    "with store: true, in memory)", param="response_id", code="not_found")


# ---- requests -> conversations ----------------------------------------------------------------------------------
def _history(store, previous_id: str | None) -> tuple:
    """The conversation of the response ``previous_id`` names (none: empty), or a 404 naming the field."""
    if previous_id is None:
        return ()
    stored = store.get(previous_id)
    if stored is None:
        raise APIError(404, f"Previous response with id {previous_id!r} not found (this server keeps the last "
                       "responses made with store: true, in memory)", param="previous_response_id",
                       code="previous_response_not_found")
    return stored.items


def _input_items(body: ResponsesRequest) -> list[tuple[object, str]]:
    """The request's input items, each with its field for errors (a string is one user message)."""
    if isinstance(body.input, str):
        return [(Message(role="user", content=body.input), "input")]
    return [(item, f"input.{i}") for i, item in enumerate(body.input)]


class ToolSet:
    """A request's tools as the model is told of them: :attr:`functions` (OpenAI/HF function definitions, the shape
    chat templates and the tool-call code read) and what each name the model may call stands for
    (:meth:`lookup`)."""

    def __init__(self, tools):
        self.functions: list[dict] = []
        self.refs: dict[str, ToolRef] = {}
        for i, tool in enumerate(tools or ()):
            where = f"tools.{i}"
            if isinstance(tool, NamespaceTool):
                for j, inner in enumerate(tool.tools):
                    self._add(inner, f"{where}.tools.{j}", tool.name, tool.description)
            elif isinstance(tool, (FunctionTool, CustomTool)):
                self._add(tool, where)
            elif tool.type in CLIENT_TOOLS:
                raise APIError(400, f"{where}.type: the built-in tool {tool.type!r} is not supported by this server "
                               "(declare the tool as a function tool instead)", param=f"{where}.type",
                               code="unsupported_parameter")
            # else: a tool the API itself runs (web search...): the model is not told of it

    def _add(self, tool, where: str, namespace: str | None = None, about: str | None = None) -> None:
        """``tool`` (a function or custom tool; of ``namespace``, which ``about`` describes) told to the model."""
        name = self.model_name(tool.name, namespace)
        if name in self.refs:
            raise APIError(400, f"{where}.name: a tool named {name!r} is declared twice", param=f"{where}.name",
                           code="invalid_value")
        self.refs[name] = ToolRef(tool.type, tool.name, namespace)
        fn = {"name": name}
        description = " ".join(d for d in (about and f"({namespace}: {about})", tool.description) if d)
        if description:
            fn["description"] = description
        if isinstance(tool, CustomTool):
            fn["parameters"] = _custom_parameters(tool)
        else:
            fn["parameters"] = tool.parameters or {"type": "object", "properties": {}}
        self.functions.append({"type": "function", "function": fn})

    @staticmethod
    def model_name(name: str, namespace: str | None = None) -> str:
        """The name the model knows a tool by (a namespace's tool: ``NAMESPACE.NAME``)."""
        return name if namespace is None else f"{namespace}.{name}"

    def lookup(self, name: str) -> ToolRef:
        """The tool a name the model called stands for (a name it made up: a function of that name, which the
        agent then reports as unknown)."""
        return self.refs.get(name) or ToolRef("function", name)


def _custom_parameters(tool: CustomTool) -> dict:
    """A custom tool's input as a function's parameters: one string, ``input``, that the grammar (if any)
    describes."""
    what = "The tool's input, as free text."
    fmt = tool.format
    if fmt is not None and fmt.type == "grammar" and fmt.definition:
        what = f"The tool's input, as text that follows this {fmt.syntax or ''} grammar:\n{fmt.definition}"
    return {"type": "object", "properties": {"input": {"type": "string", "description": what}},
            "required": ["input"], "additionalProperties": False}


def template_messages(instructions: str | None, items: list[tuple[object, str]], tools: ToolSet,
                      template=None) -> list[dict]:
    """``instructions`` and the input items (each with its field, for errors) as chat templates expect a
    conversation (HF's conventions; see the module docstring). System messages after the first stay where they
    stand if ``template`` renders them there; a template that refuses them (most allow a system message only
    first) gets them folded into the first, in their order, as the Anthropic route does."""
    out: list[dict] = [{"role": "system", "content": instructions}] if instructions else []
    names: dict[str, str] = {}  # call_id -> the called tool's name, for its output's tool message
    for item, where in items:
        if isinstance(item, Message):
            text = item.content if isinstance(item.content, str) else parts_text(item.content, f"{where}.content")
            role = "system" if item.role in ("system", "developer") else item.role
            if role == "system" and len(out) == 1 and out[0]["role"] == "system":  # one leading system message
                out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + text}
            else:
                out.append({"role": role, "content": text})
        elif isinstance(item, (FunctionCallItem, CustomToolCallItem)):
            call = _template_call(item, tools)
            names[item.call_id] = call["function"]["name"]
            if out and out[-1]["role"] == "assistant":
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif isinstance(item, (FunctionCallOutputItem, CustomToolCallOutputItem)):
            text = item.output if isinstance(item.output, str) else parts_text(item.output, f"{where}.output")
            message = {"role": "tool", "tool_call_id": item.call_id, "content": text}
            if item.call_id in names:
                message["name"] = names[item.call_id]
            out.append(message)
        elif not isinstance(item, ReasoningItem):
            raise _unsupported_item(item.type, where)
    return place_system_messages(template, out)


def _template_call(item, tools: ToolSet) -> dict:
    """A call item as a tool call of an assistant message: a function's arguments as an object where they parse as
    JSON, a custom tool's input as the one argument it was told to the model with."""
    if isinstance(item, CustomToolCallItem):
        return template_tool_call(item.call_id, item.name, {"input": item.input})
    try:
        args = json.loads(item.arguments) if item.arguments else {}
    except ValueError:
        args = item.arguments
    return template_tool_call(item.call_id, tools.model_name(item.name, item.namespace), args)


def _unsupported_item(kind: str, where: str) -> APIError:
    if kind in ("input_image", "input_file", "input_audio", "image_generation_call"):
        why = f"input items of type {kind!r} are not supported: this model reads text only"
    elif kind == "item_reference":
        why = "item references are not supported: send the item itself, or name its response in previous_response_id"
    else:
        why = f"input items of type {kind!r} are not supported (this server takes messages, function_call, " \
              "function_call_output, custom_tool_call, custom_tool_call_output and reasoning items)"
    return APIError(400, f"{where}.type: {why}", param=f"{where}.type", code="unsupported_content")


def _render(use: ToolUse, template) -> str:
    """The conversation as prompt text; a conversation the template refuses is a 400 naming ``input``."""
    try:
        return use.render(template)
    except APIError as e:
        if e.param != "messages":
            raise
        raise APIError(e.status, "input" + e.message.removeprefix("messages"), param="input", code=e.code) from None


def _check_choice(body: ResponsesRequest, tools: ToolSet) -> None:
    """A 400 for a ``tool_choice`` the tools cannot meet, or one that a JSON ``text.format`` excludes."""
    choice = body.tool_choice

    def no(why: str, param: str = "tool_choice"):
        raise APIError(400, f"{param}: {why}", param=param, code="invalid_value")

    if isinstance(choice, NamedToolChoice):
        if choice.type not in ("function", "custom"):
            no(f"a tool_choice of type {choice.type!r} is not supported (none, auto, required, or a function or "
               "custom tool by name)", "tool_choice.type")
        if not choice.name:
            no(f"type {choice.type!r} needs the tool's name", "tool_choice.name")
        ref = tools.refs.get(choice.name)
        if ref is None:
            no(f"names the tool {choice.name!r}, which is not among the tools")
        if ref.kind != choice.type:
            no(f"names {choice.name!r} as a {choice.type} tool, but it is a {ref.kind} tool")
    if choice == "required" and not tools.functions:
        no("'required' needs tools (function or custom ones)")
    forced = choice == "required" or isinstance(choice, NamedToolChoice)
    if forced and body.text_format().json_schema_of() is not None:
        no("a JSON reply and a forced tool call exclude each other", "text.format")


async def _constraint(worker, body: ResponsesRequest, use: ToolUse, tools: ToolSet):
    """The grammar the reply must follow: a call that ``tool_choice`` forces, or a JSON ``text.format``."""
    choice = body.tool_choice
    if use.tools and choice == "required":
        return await use.forced_call(worker)
    if use.tools and isinstance(choice, NamedToolChoice):
        return await use.forced_call(worker, tools.model_name(choice.name))
    schema = body.text_format().json_schema_of()
    if schema is None:
        return None
    return await grammar_constraint(worker, lambda: json_schema_grammar(schema), "text.format")


# ---- jobs -> responses ------------------------------------------------------------------------------------------
class Reply:
    """The response of one request: its object (in progress, then finished) and its numbered events. The items come
    from :class:`freetoken.serve.responses_output.OutputItems`, whole or as they stream."""

    def __init__(self, state, body: ResponsesRequest, items: OutputItems):
        self.id = new_id("resp_")
        self.created_at = int(time.time())
        self.model = state.model_name
        self.defaults = state.defaults
        self.body = body
        self.items = items
        self.output: list[dict] = []  # the items done so far
        self._numbers = itertools.count()

    def event(self, kind: str, **data) -> dict:
        """An event of the stream: its type, the next ``sequence_number`` (from 0), its data."""
        return {"type": kind, "sequence_number": next(self._numbers), **data}

    def emit(self, events: list[tuple[str, dict]]) -> list[dict]:
        """Item events, numbered; the items they finish join :attr:`output`."""
        self.output += done_items(events)
        return [self.event(kind, **data) for kind, data in events]

    def whole(self, text: str, outcome) -> dict:
        self.emit(self.items.feed(text) + self.items.finish(cut=outcome.finish_reason == "length"))
        return self.finished(outcome)

    def finished(self, outcome) -> dict:
        """The response once its job is done: ``completed``, or ``incomplete`` when max_output_tokens (or the
        context) cut it."""
        status = "incomplete" if outcome.finish_reason == "length" else "completed"
        return {**self.response(status, outcome), **reply_extras(outcome)}

    def failed(self, error: APIError) -> dict:
        """The response of a job that failed after the stream began."""
        code = "server_error" if error.status >= 500 else "invalid_prompt"
        return self.response("failed", error={"code": code, "message": error.message})

    def response(self, status: str, outcome=None, error: dict | None = None) -> dict:
        """The response object (``outcome``: the finished job's, for its usage)."""
        b, d = self.body, self.defaults
        text = {"format": b.text_format().echo()}
        if b.text is not None and b.text.verbosity is not None:
            text["verbosity"] = b.text.verbosity
        choice = b.tool_choice or "auto"
        return {
            "id": self.id, "object": "response", "created_at": self.created_at, "status": status,
            "completed_at": int(time.time()) if status == "completed" else None,
            "background": False, "error": error,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": b.instructions, "max_output_tokens": b.max_output_tokens, "model": self.model,
            "output": list(self.output),
            "parallel_tool_calls": True if b.parallel_tool_calls is None else b.parallel_tool_calls,
            "previous_response_id": b.previous_response_id, "reasoning": {"effort": None, "summary": None},
            "service_tier": "default", "store": b.store is not False,
            "temperature": d.temperature if b.temperature is None else b.temperature, "text": text,
            "tool_choice": choice if isinstance(choice, str) else choice.model_dump(),
            "tools": [t.model_dump(exclude_none=True) for t in b.tools or ()],
            "top_p": d.top_p if b.top_p is None else b.top_p, "truncation": b.truncation or "disabled",
            "usage": None if outcome is None else self.usage(outcome), "user": b.user, "metadata": b.metadata or {},
        }

    @staticmethod
    def usage(outcome) -> dict:
        """The token counts: ``cached_tokens`` the prompt's reused from the KV cache (the prefix cache, an anchor),
        ``cache_write_tokens`` the rest (every prompt's KV blocks stay in the prefix cache)."""
        cached = outcome.cached_tokens
        return {"input_tokens": outcome.prompt_tokens,
                "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": outcome.prompt_tokens - cached},
                "output_tokens": outcome.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": outcome.prompt_tokens + outcome.completion_tokens}


def _sse(event: dict) -> dict:
    """A server-sent event as the OpenAI API sends it: its type as the event's name, and again in its data."""
    return {"event": event["type"], "data": json.dumps(event)}


async def _stream(worker, job: Job, reply: Reply, keep):
    """The events of ``job``: ``response.created``, ``response.in_progress``, the items' events as the text comes,
    then ``response.completed`` (or ``response.incomplete``: cut by max_output_tokens) with the whole response; an
    error after the start is an ``error`` event and ``response.failed``. ``keep(response)`` stores the finished
    response. Closing the stream early (the client went away) cancels the job
    (:func:`freetoken.serve.jobs.job_events`)."""
    started = reply.response("in_progress")
    yield _sse(reply.event("response.created", response=started))
    yield _sse(reply.event("response.in_progress", response=started))
    async with aclosing(job_events(worker, job)) as events:
        async for kind, value in events:
            if kind == "text":
                for event in reply.emit(reply.items.feed(value)):
                    yield _sse(event)
            elif kind == "done":
                for event in reply.emit(reply.items.finish(cut=value.finish_reason == "length")):
                    yield _sse(event)
                response = reply.finished(value)
                keep(response)
                yield _sse(reply.event(f"response.{response['status']}", response=response))
            else:  # the stream has started (status 200): the error goes in the stream, as the OpenAI API does
                yield _sse(reply.event("error", code=value.code, message=value.message, param=value.param))
                response = reply.failed(value)
                keep(response)
                yield _sse(reply.event("response.failed", response=response))
