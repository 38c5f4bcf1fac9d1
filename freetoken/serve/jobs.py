"""What the OpenAI and the Anthropic routes share on the way from a request to its text: the body parsed, the model
name checked, a conversation rendered with the chat template, a :class:`freetoken.serve.worker.Job` built with the
server's defaults (and the grammar its reply must follow), and the job's text collected whole or taken as it comes.
Each API module only reads its own request shape and writes its own response shape (their tools:
:mod:`freetoken.serve.tool_use`).

Anchors (:mod:`freetoken.engine.reuse.anchors`): a chat job makes one at each message boundary of its prompt as rendered
(and resumes from the longest one there), or resumes from the one its request names (``anchor``). What came of
that is the response's extra field ``anchor`` (:func:`anchor_report`): a refused or unknown anchor is not an
error, the prompt is recomputed and the field says why.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

from fastapi import Request
from pydantic import ValidationError

from freetoken.engine.decoding.grammar import GrammarError
from freetoken.engine.decoding.sampling import SamplingParams
from freetoken.serve.errors import APIError, validation_error
from freetoken.serve.request_body import decode_json, read_body
from freetoken.serve.worker import Job

#: How often a non-streaming request looks whether its client is still there while it waits for text.
DISCONNECT_POLL_SECONDS = 0.25


# ---- requests -> jobs -------------------------------------------------------------------------------------------
async def parse_body(request: Request, schema):
    """The request's JSON body as ``schema``. The body is read as JSON whatever its Content-Type says (curl's
    ``-d`` sends form encoding; llama-server accepts that too); bad JSON and bad fields are 400s naming the spot,
    an oversized body a 413."""
    data = decode_json(await read_body(request))  # size, depth and text checked (serve/request_body.py)
    if not isinstance(data, dict):
        raise APIError(400, f"the request body must be a JSON object, not {type(data).__name__}", code="invalid_json")
    try:
        return schema.model_validate(data)
    except ValidationError as e:
        raise validation_error(e.errors(include_url=False)) from None


async def begin(request: Request, schema):
    """What every model route does first: (server state, the body as ``schema``, the worker) -- a 400 for a bad
    body, a 503 while the model loads, a 404 for another model's name."""
    state = request.app.state.server
    body = await parse_body(request, schema)
    worker = state.ready()
    check_model(state, body.model)
    return state, body, worker


def check_model(state, name: str | None) -> None:
    """A 404 for a model name that is not the served one or an alias (no name: the served one)."""
    if name and name != state.model_name and name not in state.aliases:
        raise APIError(404, f"The model {name!r} does not exist: this server serves {state.model_name!r} "
                       "(GET /v1/models)", param="model", code="model_not_found")


def template_tool_call(call_id: str | None, name: str, arguments) -> dict:
    """A tool call of an assistant message as chat templates expect it (HF's convention: ``arguments`` an object
    where it is one)."""
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def render_chat(template, messages: list[dict], add_generation_prompt: bool = True, **context) -> str:
    """The conversation as prompt text (``context``: more template variables, ``tools``...); a conversation the
    template refuses (roles out of order, say) is a 400."""
    try:
        return template.render(messages, add_generation_prompt=add_generation_prompt, **context)
    except ValueError as e:
        raise APIError(400, f"messages: the chat template refused them: {e}", param="messages") from None


def place_system_messages(template, messages: list[dict]) -> list[dict]:
    """``messages`` with their system messages after the first where they stand, if ``template`` (None: no check)
    renders them there; a template that refuses them (most allow a system message only first) gets them all folded
    into one leading system message, in their order. Claude Code and Codex send system and developer entries
    mid-conversation."""
    if template is None or not any(m["role"] == "system" for m in messages[1:]):
        return messages
    try:
        template.render(messages, add_generation_prompt=True)
        return messages
    except ValueError:
        pass
    system = "\n\n".join(m["content"] for m in messages if m["role"] == "system" and m["content"])
    return [{"role": "system", "content": system}] + [m for m in messages if m["role"] != "system"]


def make_job(state, ids: list[int], stop: list[str], *, max_tokens: int | None, prompt_param: str,
             temperature: float | None = None, top_p: float | None = None, top_k: int | None = None,
             repetition_penalty: float | None = None, seed: int | None = None,
             logit_bias: dict[str, float] | None = None) -> Job:
    """A job for prompt ``ids``: what the request leaves out (None) is the server's default (``state.defaults``);
    a prompt the context cannot hold is a 400 naming ``prompt_param``, and the completion is cut to what fits (and to
    the server's ``--max-tokens-limit``)."""
    ctx = check_prompt(state, ids, prompt_param)
    d = state.defaults
    sampling = SamplingParams(
        temperature=d.temperature if temperature is None else temperature,
        top_p=d.top_p if top_p is None else top_p,
        top_k=d.top_k if top_k is None else top_k,
        repetition_penalty=d.repetition_penalty if repetition_penalty is None else repetition_penalty,
        seed=seed, logit_bias=logit_bias_pairs(state, logit_bias))
    granted = min(max_tokens or d.max_tokens, ctx - len(ids), d.max_tokens_limit or ctx)
    return Job(ids=ids, max_tokens=granted, sampling=sampling, stop=stop, loop=asyncio.get_running_loop(),
               requested_max_tokens=max_tokens if max_tokens and max_tokens > granted else None)


def logit_bias_pairs(state, logit_bias: dict[str, float] | None) -> tuple[tuple[int, float], ...]:
    """A request's ``logit_bias`` as (token id, bias) pairs; a key that is not a token id of the model's vocabulary
    is a 400 naming ``logit_bias``."""
    if not logit_bias:
        return ()
    vocab = state.ready().model.config.vocab_size
    pairs = []
    for key, bias in logit_bias.items():
        tok = int(key) if key.strip().isdigit() else -1
        if not 0 <= tok < vocab:
            raise APIError(400, f"logit_bias: {key!r} is not a token id of this model's vocabulary (0..{vocab - 1})",
                           param="logit_bias", code="invalid_value")
        pairs.append((tok, float(bias)))
    return tuple(pairs)


def check_prompt(state, ids: list[int], param: str) -> int:
    """The context's size; a 400 naming ``param`` for an empty prompt or one that leaves no room for a token."""
    ctx = state.ready().model.decoder.ctx
    if not ids:
        raise APIError(400, "the prompt is empty", param=param)
    if len(ids) >= ctx:
        raise APIError(400, f"This model's context holds {ctx} tokens; the prompt is {len(ids)} tokens (prompt and "
                       "completion together must fit: start the server with a larger --ctx or --kv-memory, or "
                       "send less)", param=param, code="context_length_exceeded")
    return ctx


async def with_anchors(worker, job: Job, use, anchor: str | None = None) -> Job:
    """``job`` (of the conversation ``use``, a :class:`freetoken.serve.tool_use.ToolUse`) resuming from ``anchor``
    (an id, or None), with anchors made and looked up at its message boundaries. The boundaries render each
    leading part of the conversation once more: off the event loop."""
    job.anchor = anchor
    job.boundaries = await asyncio.to_thread(use.boundaries, worker.template, worker.model, job.ids)
    return job


def reply_extras(outcome) -> dict:
    """The fields every route adds to its reply, outside the APIs: ``anchor`` (:func:`anchor_report`) and, when the
    request asked for more tokens than the context leaves after its prompt (or ``--max-tokens-limit``),
    ``max_tokens_capped`` (``{"requested", "granted"}``: agents send 8,000-64,000 whatever the model's context)."""
    out = {"anchor": anchor_report(outcome)}
    if outcome.requested_max_tokens is not None:
        out["max_tokens_capped"] = {"requested": outcome.requested_max_tokens, "granted": outcome.max_tokens}
    return out


def anchor_report(outcome) -> dict:
    """The responses' extra field ``anchor``: the id the prompt's start was restored from (or None), why an anchor
    was refused (None: none was), and the ids of the anchors at the prompt's message boundaries."""
    return {"restored": outcome.anchor, "refused": outcome.anchor_refused,
            "made": [a["id"] for a in outcome.anchors_made]}


async def run_task(worker, task: Callable):
    """``task(model)`` run on the worker thread, in the queue's order; its result (what it raises: an APIError)."""
    job = Job(ids=[], max_tokens=0, sampling=SamplingParams(), stop=[], loop=asyncio.get_running_loop(), task=task)
    worker.submit(job)
    kind, value = await job.events.get()
    if kind == "error":
        raise error_of(value)
    return value


async def grammar_constraint(worker, grammar: Callable[[], str], param: str):
    """The constraint a job's reply must follow, of the grammar ``grammar()`` makes (built off the event loop: it
    compiles against the vocabulary); a grammar llguidance refuses is a 400 naming ``param``."""
    try:
        return await asyncio.to_thread(worker.constraint, grammar())
    except GrammarError as e:
        raise APIError(400, f"{param}: {e}", param=param, code="invalid_value") from None


# ---- jobs -> text -----------------------------------------------------------------------------------------------
def error_of(e: BaseException) -> APIError:
    """What the engine raised, as the error the client gets."""
    if isinstance(e, APIError):
        return e
    if isinstance(e, ValueError):
        return APIError(400, str(e))
    return APIError(500, f"the engine failed: {type(e).__name__}: {e}")


async def collect(worker, job: Job, request: Request):
    """The whole text and the outcome of ``job``; the job is cancelled if the client disconnects meanwhile (or the
    request's task is cancelled: the server shuts down). The connection is looked at every
    :data:`DISCONNECT_POLL_SECONDS` whether text is coming or not: a running job's pieces come faster than that, so
    a check only between pieces would never run while it generates."""
    worker.submit(job)
    pieces = []
    finished = False
    loop = asyncio.get_running_loop()
    next_check = loop.time() + DISCONNECT_POLL_SECONDS
    getter = None  # one pending get at a time, kept across timeouts (cancelling a get could lose its event)
    try:
        while True:
            if getter is None:
                getter = asyncio.ensure_future(job.events.get())
            done, _ = await asyncio.wait({getter}, timeout=max(0.0, next_check - loop.time()))
            if loop.time() >= next_check:
                if await request.is_disconnected():
                    raise APIError(499, "the client closed the connection")
                next_check = loop.time() + DISCONNECT_POLL_SECONDS
            if not done:
                continue
            kind, value = getter.result()
            getter = None
            if kind == "text":
                pieces.append(value)
            elif kind == "done":
                finished = True
                return "".join(pieces), value
            else:
                finished = True
                raise error_of(value)
    finally:
        if getter is not None:
            getter.cancel()
        if not finished:
            worker.cancel(job)


async def job_events(worker, job: Job) -> AsyncIterator[tuple[str, object]]:
    """``job``'s events as they come, for a streamed response: ``("text", piece)``..., then ``("done", Outcome)``
    or ``("error", APIError)``. The job is submitted on the first step; closing the iterator before its end (the
    client went away: sse-starlette cancels the response's generator) cancels the job. Use it inside
    ``contextlib.aclosing`` so that closing the response's generator closes this one at once."""
    worker.submit(job)
    finished = False
    try:
        while not finished:
            kind, value = await job.events.get()
            finished = kind != "text"
            yield kind, error_of(value) if kind == "error" else value
    finally:
        if not finished:
            worker.cancel(job)
