"""The OpenAI endpoints: ``GET /v1/models``, ``POST /v1/chat/completions``, ``POST /v1/completions``.

A request becomes a :class:`freetoken.serve.worker.Job` (prompt token ids, sampling, stop strings); its text
comes back as one response, or as server-sent events in the OpenAI chunk format ending with ``data: [DONE]``.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid

from fastapi import APIRouter, Request
from pydantic import ValidationError
from sse_starlette import EventSourceResponse
from starlette.responses import JSONResponse

from freetoken.engine.chat import model_template
from freetoken.engine.sampling import SamplingParams
from freetoken.serve.errors import APIError, validation_error
from freetoken.serve.schemas import ChatCompletionRequest, CompletionRequest, refuse_unsupported
from freetoken.serve.worker import Job

router = APIRouter()
ENDPOINTS = ("/v1/models", "/v1/chat/completions", "/v1/completions")

#: How often a non-streaming request looks whether its client is still there while it waits for text.
DISCONNECT_POLL_SECONDS = 0.25


@router.get("/v1/models")
async def list_models(request: Request):
    state = request.app.state.server
    return {"object": "list", "data": [{"id": state.model_name, "object": "model", "created": state.created,
                                        "owned_by": "freetoken"}]}


@router.post("/v1/chat/completions")
async def chat_completions(request: Request):
    state = request.app.state.server
    body = await parse_body(request, ChatCompletionRequest)
    worker = state.ready()
    _check_model(state, body.model)
    refuse_unsupported(body)
    model = worker.model
    template = model_template(model)
    messages = [_template_message(m) for m in body.messages]
    try:
        text = template.render(messages, add_generation_prompt=True)
    except ValueError as e:  # the template refused the conversation (roles out of order, say)
        raise APIError(400, f"messages: the chat template refused them: {e}", param="messages") from None
    ids = model.encode(text, add_special_tokens=False)
    job = _job(state, body, ids, template.stop_strings() + body.stop_list())
    reply = Reply("chat.completion", state.model_name, chat=True)
    if body.stream:
        return EventSourceResponse(_stream(worker, job, reply, body.include_usage()), ping=15)
    text, outcome = await _collect(worker, job, request)
    return JSONResponse(reply.whole(text, outcome))


@router.post("/v1/completions")
async def completions(request: Request):
    state = request.app.state.server
    body = await parse_body(request, CompletionRequest)
    worker = state.ready()
    _check_model(state, body.model)
    refuse_unsupported(body)
    model = worker.model
    prompt = body.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        ids = model.encode(prompt)
    else:
        vocab = model.config.vocab_size
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"prompt: token id {bad[0]} is outside the vocabulary (0..{vocab - 1})",
                           param="prompt", code="invalid_value")
        ids = list(prompt)
    job = _job(state, body, ids, body.stop_list(), default_max=16)
    reply = Reply("text_completion", state.model_name, chat=False,
                  echo=(prompt if isinstance(prompt, str) else model.decode(ids)) if body.echo else "")
    if body.stream:
        return EventSourceResponse(_stream(worker, job, reply, body.include_usage()), ping=15)
    text, outcome = await _collect(worker, job, request)
    return JSONResponse(reply.whole(text, outcome))


# ---- requests -> jobs -------------------------------------------------------------------------------------------
async def parse_body(request: Request, schema):
    """The request's JSON body as ``schema``. The body is read as JSON whatever its Content-Type says (curl's
    ``-d`` sends form encoding; llama-server accepts that too); bad JSON and bad fields are 400s naming the spot."""
    raw = await request.body()
    try:
        data = json.loads(raw)
    except ValueError as e:
        where = f" (line {e.lineno}, column {e.colno})" if isinstance(e, json.JSONDecodeError) else ""
        raise APIError(400, f"the request body is not valid JSON{where}: {getattr(e, 'msg', e)}",
                       code="invalid_json") from None
    if not isinstance(data, dict):
        raise APIError(400, f"the request body must be a JSON object, not {type(data).__name__}", code="invalid_json")
    try:
        return schema.model_validate(data)
    except ValidationError as e:
        raise validation_error(e.errors(include_url=False)) from None


def _check_model(state, name: str | None) -> None:
    if name and name != state.model_name:
        raise APIError(404, f"The model {name!r} does not exist: this server serves {state.model_name!r} "
                       "(GET /v1/models)", param="model", code="model_not_found")


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
            calls.append({"id": c.id, "type": "function",
                          "function": {"name": c.function.name, "arguments": args}})
        out["tool_calls"] = calls
    return out


def _job(state, body, ids: list[int], stop: list[str], default_max: int | None = None) -> Job:
    ctx = state.ready().model.decoder.ctx
    if not ids:
        raise APIError(400, "the prompt is empty", param="prompt")
    if len(ids) >= ctx:
        raise APIError(400, f"This model's context holds {ctx} tokens; the prompt is {len(ids)} tokens (prompt and "
                       "completion together must fit: start the server with a larger --ctx or --kv-memory, or "
                       "send less)", param="messages" if isinstance(body, ChatCompletionRequest) else "prompt",
                       code="context_length_exceeded")
    d = state.defaults
    limit = body.token_limit() or default_max or d.max_tokens
    sampling = SamplingParams(
        temperature=d.temperature if body.temperature is None else body.temperature,
        top_p=d.top_p if body.top_p is None else body.top_p,
        top_k=d.top_k if body.top_k is None else body.top_k,
        repetition_penalty=d.repetition_penalty if body.repetition_penalty is None else body.repetition_penalty,
        seed=body.seed)
    return Job(ids=ids, max_tokens=min(limit, ctx - len(ids)), sampling=sampling, stop=stop,
               loop=asyncio.get_running_loop())


# ---- jobs -> responses ------------------------------------------------------------------------------------------
class Reply:
    """The response objects of one request, whole or as chunks (``chat``: chat.completion, else text_completion)."""

    def __init__(self, kind: str, model_name: str, chat: bool, echo: str = ""):
        self.kind = kind
        self.chat = chat
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self.model = model_name
        self.echo = echo

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

    def whole(self, text: str, outcome) -> dict:
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text, "refusal": None},
                      "logprobs": None, "finish_reason": outcome.finish_reason}
        else:
            choice = {"index": 0, "text": self.echo + text, "logprobs": None, "finish_reason": outcome.finish_reason}
        return {**self._head(self.kind), "choices": [choice], "usage": self.usage(outcome),
                "timings": self.timings(outcome)}

    def chunk(self, piece: str | None = None, first: bool = False, outcome=None, usage_field: bool = False) -> dict:
        """A chunk with text ``piece``, or (``outcome``) the last one with the finish reason."""
        if self.chat:
            delta = {} if outcome is not None else {"content": piece}
            if first:
                delta = {"role": "assistant", "content": piece or ""}
            choice = {"index": 0, "delta": delta, "logprobs": None,
                      "finish_reason": None if outcome is None else outcome.finish_reason}
            out = {**self._head("chat.completion.chunk"), "choices": [choice]}
        else:
            choice = {"index": 0, "text": "" if outcome is not None else piece, "logprobs": None,
                      "finish_reason": None if outcome is None else outcome.finish_reason}
            out = {**self._head("text_completion"), "choices": [choice]}
        if outcome is not None:
            out["timings"] = self.timings(outcome)
        if usage_field:
            out["usage"] = None
        return out

    def usage_chunk(self, outcome) -> dict:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return {**self._head(obj), "choices": [], "usage": self.usage(outcome)}


def _error_of(e: BaseException) -> APIError:
    if isinstance(e, APIError):
        return e
    if isinstance(e, ValueError):
        return APIError(400, str(e))
    return APIError(500, f"the engine failed: {type(e).__name__}: {e}")


async def _collect(worker, job: Job, request: Request):
    """The whole text and the outcome of ``job``; the job is cancelled if the client disconnects meanwhile (or the
    request's task is cancelled: the server shuts down)."""
    worker.submit(job)
    pieces = []
    finished = False
    try:
        while True:
            try:
                kind, value = await asyncio.wait_for(job.events.get(), DISCONNECT_POLL_SECONDS)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    raise APIError(499, "the client closed the connection") from None
                continue
            if kind == "text":
                pieces.append(value)
            elif kind == "done":
                finished = True
                return "".join(pieces), value
            else:
                finished = True
                raise _error_of(value)
    finally:
        if not finished:
            worker.cancel(job)


async def _stream(worker, job: Job, reply: Reply, include_usage: bool):
    """The server-sent events of ``job``: a first chunk with the role, a chunk per text piece, the finish chunk,
    the usage chunk (``stream_options.include_usage``), ``[DONE]``. Closing the stream early (the client went away:
    sse-starlette cancels this generator) cancels the job."""
    worker.submit(job)
    done = False
    try:
        first = True
        while True:
            kind, value = await job.events.get()
            if kind == "text":
                yield json.dumps(reply.chunk(value, first=first and reply.chat, usage_field=include_usage))
                first = False
            elif kind == "done":
                if first and reply.chat:  # no text at all: the role chunk still comes first
                    yield json.dumps(reply.chunk("", first=True, usage_field=include_usage))
                yield json.dumps(reply.chunk(outcome=value, usage_field=include_usage))
                if include_usage:
                    yield json.dumps(reply.usage_chunk(value))
                done = True
                yield "[DONE]"
                return
            else:  # the stream has started (status 200): the error goes in the stream, as the OpenAI API does
                yield json.dumps(_error_of(value).body())
                done = True
                return
    finally:
        if not done:
            worker.cancel(job)
