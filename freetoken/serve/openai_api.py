"""The OpenAI endpoints: ``GET /v1/models``, ``POST /v1/chat/completions``, ``POST /v1/completions``.

A request becomes a :class:`freetoken.serve.worker.Job` (prompt token ids, sampling, stop strings); its text
comes back as one response, or as server-sent events in the OpenAI chunk format ending with ``data: [DONE]``.

A chat request may name an ``anchor`` to resume from; each makes anchors at its message boundaries. The response
says what came of it in the extra field ``anchor`` (``{"restored", "refused", "made"}``:
:func:`freetoken.serve.jobs.anchor_report`), in the last chunk of a stream (the one with the finish reason): a
refused or unknown anchor is recomputed, not an error.
"""

from __future__ import annotations

import json
import time
import uuid
from contextlib import aclosing

from fastapi import APIRouter, Request
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
    reply_extras,
    template_tool_call,
    with_anchors,
)
from freetoken.serve.schemas import ChatCompletionRequest, CompletionRequest, NamedToolChoice, refuse_unsupported
from freetoken.serve.tool_calls import CallStart, Content
from freetoken.serve.tool_use import ToolUse, tool_use
from freetoken.serve.worker import Job

router = APIRouter()
ENDPOINTS = ("/v1/models", "/v1/chat/completions", "/v1/completions")


@router.get("/v1/models")
async def list_models(request: Request):
    state = request.app.state.server
    return {"object": "list", "data": [{"id": state.model_name, "object": "model", "created": state.created,
                                        "owned_by": "freetoken"}]}


@router.post("/v1/chat/completions")
async def chat_completions(request: Request):
    state, body, worker = await begin(request, ChatCompletionRequest)
    refuse_unsupported(body)
    template = worker.template
    use = chat_tool_use(template, body)
    ids = worker.model.encode(use.render(template), add_special_tokens=False)
    job = _job(state, body, ids, worker.end_of_turn + body.stop_list())
    job.constraint = await _constraint(worker, body, use)
    await with_anchors(worker, job, use, body.anchor)
    reply = Reply("chat.completion", state.model_name, chat=True, parser=use.parser)
    if body.stream:
        return EventSourceResponse(_stream(worker, job, reply, body.include_usage()), ping=15)
    text, outcome = await collect(worker, job, request)
    return JSONResponse(reply.whole(text, outcome))


@router.post("/v1/completions")
async def completions(request: Request):
    state, body, worker = await begin(request, CompletionRequest)
    refuse_unsupported(body)
    model = worker.model
    prompt = body.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    ids = prompt_ids(model, prompt)
    job = _job(state, body, ids, body.stop_list(), default_max=16)
    reply = Reply("text_completion", state.model_name, chat=False,
                  echo=(prompt if isinstance(prompt, str) else model.decode(ids)) if body.echo else "")
    if body.stream:
        return EventSourceResponse(_stream(worker, job, reply, body.include_usage()), ping=15)
    text, outcome = await collect(worker, job, request)
    return JSONResponse(reply.whole(text, outcome))


# ---- requests -> jobs -------------------------------------------------------------------------------------------
def chat_tool_use(template, body) -> ToolUse:
    """The conversation of a chat request (or of ``POST /v1/anchors``) as the template renders it, with its tools
    (``tool_choice`` none: the model is not told of them)."""
    messages = [_template_message(m) for m in body.messages]
    tools = [t.model_dump(exclude_none=True) for t in body.tools or ()]
    return tool_use(template, messages, tools if getattr(body, "tool_choice", None) != "none" else [])


def prompt_ids(model, prompt: str | list[int]) -> list[int]:
    """A completion prompt's token ids: text encoded (with the tokenizer's special tokens), or ids checked against
    the vocabulary (a 400 naming ``prompt``)."""
    if isinstance(prompt, str):
        return model.encode(prompt)
    vocab = model.config.vocab_size
    bad = [t for t in prompt if not 0 <= t < vocab]
    if bad:
        raise APIError(400, f"prompt: token id {bad[0]} is outside the vocabulary (0..{vocab - 1})",
                       param="prompt", code="invalid_value")
    return list(prompt)


def _template_message(m) -> dict:
    """A validated message as chat templates expect it (HF's conventions): text content, tool-call arguments as
    objects where they parse as JSON."""
    out = {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
    if m.name:
        out["name"] = m.name
    if m.tool_call_id:
        out["tool_call_id"] = m.tool_call_id
    if m.tool_calls:
        calls = []
        for c in m.tool_calls:
            try:
                args = json.loads(c.function.arguments) if c.function.arguments else {}
            except ValueError:
                args = c.function.arguments
            calls.append(template_tool_call(c.id, c.function.name, args))
        out["tool_calls"] = calls
    return out


def _job(state, body, ids: list[int], stop: list[str], default_max: int | None = None) -> Job:
    return make_job(state, ids, stop, max_tokens=body.token_limit() or default_max,
                    prompt_param="messages" if isinstance(body, ChatCompletionRequest) else "prompt",
                    temperature=body.temperature, top_p=body.top_p, top_k=body.top_k,
                    repetition_penalty=body.repetition_penalty, seed=body.seed, logit_bias=body.logit_bias)


async def _constraint(worker, body: ChatCompletionRequest, use: ToolUse):
    """The grammar the reply must follow: a call that ``tool_choice`` forces, or a JSON ``response_format`` (the
    two exclude each other: :func:`refuse_unsupported`)."""
    if use.tools and body.tool_choice == "required":
        return await use.forced_call(worker)
    if use.tools and isinstance(body.tool_choice, NamedToolChoice):
        return await use.forced_call(worker, body.tool_choice.function.name)
    schema = body.response_format.schema() if body.response_format is not None else None
    if schema is None:
        return None
    return await grammar_constraint(worker, lambda: json_schema_grammar(schema), "response_format")


# ---- jobs -> responses ------------------------------------------------------------------------------------------
class Reply:
    """The response objects of one request, whole or as chunks (``chat``: chat.completion, else text_completion).

    ``parser`` (chat with tools): a :mod:`freetoken.serve.tool_calls` parser the text goes through, so that calls
    come out as ``tool_calls`` (in streamed deltas: the id and name first, then argument fragments)."""

    def __init__(self, kind: str, model_name: str, chat: bool, echo: str = "", parser=None):
        self.kind = kind
        self.chat = chat
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self.model = model_name
        self.echo = echo
        self.parser = parser

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "system_fingerprint": "freetoken"}

    @staticmethod
    def usage(outcome) -> dict:
        return {"prompt_tokens": outcome.prompt_tokens, "completion_tokens": outcome.completion_tokens,
                "total_tokens": outcome.prompt_tokens + outcome.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": outcome.cached_tokens}}

    @staticmethod
    def timings(outcome) -> dict:
        """Not in the OpenAI API (clients ignore it): speeds and the expert-cache hit rate, for the chat page."""
        return {"prompt_per_second": round(outcome.prefill_tps, 2),
                "predicted_per_second": round(outcome.decode_tps, 2),
                "time_to_first_token_s": round(outcome.seconds_to_first_token, 4),
                "expert_cache_hit_rate": None if outcome.hit_rate is None else round(outcome.hit_rate, 4)}

    def extras(self, outcome) -> dict:
        """:func:`freetoken.serve.jobs.reply_extras` (a completion has no anchors: the prompt is not a chat)."""
        extras = reply_extras(outcome)
        if not self.chat:
            del extras["anchor"]
        return extras

    def finish_reason(self, outcome) -> str:
        if self.parser is not None and self.parser.calls and outcome.finish_reason == "stop":
            return "tool_calls"
        return outcome.finish_reason

    # ---- deltas: what a piece of text adds to the message -----------------------------------------------------
    def deltas(self, piece: str | None, final: bool = False) -> list[dict]:
        """The deltas ``piece`` makes (``final``: and what the parser still held)."""
        if self.parser is None:
            if not piece:
                return []
            return [{"content": piece} if self.chat else {"text": piece}]
        events = (self.parser.feed(piece) if piece else []) + (self.parser.finish() if final else [])
        out = []
        for e in events:
            if isinstance(e, Content):
                if e.text:
                    out.append({"content": e.text})
            elif isinstance(e, CallStart):
                out.append({"tool_calls": [{"index": e.index, "id": e.id, "type": "function",
                                            "function": {"name": e.name, "arguments": ""}}]})
            elif e.fragment:
                out.append({"tool_calls": [{"index": e.index, "function": {"arguments": e.fragment}}]})
        return out

    def whole(self, text: str, outcome) -> dict:
        if self.chat:
            content, calls = [], []
            for d in self.deltas(text, final=True):
                if "content" in d:
                    content.append(d["content"])
                for c in d.get("tool_calls", ()):
                    if "id" in c:
                        calls.append({"id": c["id"], "type": "function",
                                      "function": {"name": c["function"]["name"], "arguments": ""}})
                    else:
                        calls[c["index"]]["function"]["arguments"] += c["function"]["arguments"]
            message = {"role": "assistant", "content": "".join(content), "refusal": None}
            if calls:
                message["tool_calls"] = calls
                message["content"] = message["content"].strip() or None
            choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": self.finish_reason(outcome)}
        else:
            choice = {"index": 0, "text": self.echo + text, "logprobs": None, "finish_reason": outcome.finish_reason}
        out = {**self._head(self.kind), "choices": [choice], "usage": self.usage(outcome),
               "timings": self.timings(outcome)}
        return {**out, **self.extras(outcome)}

    def chunk(self, delta: dict | None = None, outcome=None, usage_field: bool = False) -> dict:
        """A chunk carrying ``delta``, or (``outcome``) the last one with the finish reason."""
        reason = None if outcome is None else self.finish_reason(outcome)
        if self.chat:
            choice = {"index": 0, "delta": delta or {}, "logprobs": None, "finish_reason": reason}
            out = {**self._head("chat.completion.chunk"), "choices": [choice]}
        else:
            choice = {"index": 0, "text": (delta or {}).get("text", ""), "logprobs": None, "finish_reason": reason}
            out = {**self._head("text_completion"), "choices": [choice]}
        if outcome is not None:
            out["timings"] = self.timings(outcome)
            out.update(self.extras(outcome))
        if usage_field:
            out["usage"] = None
        return out

    def usage_chunk(self, outcome) -> dict:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return {**self._head(obj), "choices": [], "usage": self.usage(outcome)}


async def _stream(worker, job: Job, reply: Reply, include_usage: bool):
    """The server-sent events of ``job``: the chat's first chunk carries the role, then a chunk per delta, the finish
    chunk, the usage chunk (``stream_options.include_usage``), ``[DONE]``. Closing the stream early (the client
    went away) cancels the job (:func:`freetoken.serve.jobs.job_events`)."""
    first = reply.chat

    def chunks(deltas):
        nonlocal first
        for d in deltas:
            if first:
                d = {"role": "assistant", **d}
                first = False
            yield json.dumps(reply.chunk(d, usage_field=include_usage))

    async with aclosing(job_events(worker, job)) as events:
        async for kind, value in events:
            if kind == "text":
                for c in chunks(reply.deltas(value)):
                    yield c
            elif kind == "done":
                for c in chunks(reply.deltas(None, final=True)):
                    yield c
                if first:  # no text at all: the role chunk still comes first
                    for c in chunks([{"content": ""}]):
                        yield c
                yield json.dumps(reply.chunk(outcome=value, usage_field=include_usage))
                if include_usage:
                    yield json.dumps(reply.usage_chunk(value))
                yield "[DONE]"
            else:  # the stream has started (status 200): the error goes in the stream, as the OpenAI API does
                yield json.dumps(value.body())
