"""The Anthropic Messages endpoints: ``POST /v1/messages`` and ``POST /v1/messages/count_tokens``, so that agents
built on the Anthropic API (its SDKs, and clients that speak it) run on the served model.

A request's conversation becomes the chat-template messages the OpenAI route builds: the system prompt a leading
system message, an assistant's ``tool_use`` blocks its ``tool_calls``, a user's ``tool_result`` blocks ``tool``
messages (in their order). It is rendered with the model's template and run as a
:class:`freetoken.serve.worker.Job` (:mod:`freetoken.serve.jobs`, shared with the OpenAI route); the reply comes
back as one message, or as the Anthropic API's named server-sent events. A final assistant message is a prefill:
the reply continues its text. Errors on these paths take the Anthropic shape (:mod:`freetoken.serve.errors`).

``tools`` are OpenAI function definitions to the rest of the server: rendered, parsed back out of the reply and
forced (``tool_choice`` any / tool) as the OpenAI route does it (:mod:`freetoken.serve.tool_use`); the calls come
back as ``tool_use`` blocks (:mod:`freetoken.serve.anthropic_content`).

Reused prompt tokens (the prefix cache, an anchor) are ``usage.cache_read_input_tokens``, and ``input_tokens`` the
rest, as the Anthropic API counts them (their sum is the prompt); a stream's ``message_start`` cannot know the split
yet (all its prompt is ``input_tokens``), its ``message_delta`` gives it. A request may name an ``anchor`` to resume
from, as on the OpenAI route; what came of it is the extra field ``anchor`` of the message, or of a stream's
``message_delta`` (:func:`freetoken.serve.jobs.anchor_report`).
"""

from __future__ import annotations

import json
import uuid
from contextlib import aclosing

from fastapi import APIRouter, Request
from sse_starlette import EventSourceResponse
from starlette.responses import JSONResponse

from freetoken.serve.anthropic_content import ContentBlocks, whole_content
from freetoken.serve.anthropic_schemas import (
    CountTokensRequest,
    Message,
    MessagesRequest,
    OtherBlock,
    TextBlock,
    ThinkingBlock,
    ToolResultBlock,
    ToolUseBlock,
    check_tool_choice,
)
from freetoken.serve.errors import APIError
from freetoken.serve.jobs import (
    begin,
    collect,
    job_events,
    make_job,
    place_system_messages,
    reply_extras,
    template_tool_call,
    with_anchors,
)
from freetoken.serve.tool_use import ToolUse, tool_use
from freetoken.serve.worker import Job

router = APIRouter()
ENDPOINTS = ("/v1/messages", "/v1/messages/count_tokens")

#: Block types a text-only model cannot read (the others it does not know are refused as unsupported).
_MEDIA_BLOCKS = ("image", "document", "search_result")


@router.post("/v1/messages")
async def messages(request: Request):
    state, body, worker = await begin(request, MessagesRequest)
    check_tool_choice(body)
    ids, use = _prompt(worker, body)
    end_of_turn = worker.end_of_turn
    stop_sequences = body.stop_sequences or []
    # the client's stop sequences first: of two that match at one place, the one it sent is reported
    job = make_job(state, ids, stop_sequences + end_of_turn, max_tokens=body.max_tokens, prompt_param="messages",
                   temperature=body.temperature, top_p=body.top_p, top_k=body.top_k)
    choice = body.tool_choice
    if use.tools and choice is not None and choice.forced():
        job.constraint = await use.forced_call(worker, choice.name if choice.type == "tool" else None)
    await with_anchors(worker, job, use, body.anchor)
    reply = Reply(state.model_name, stop_sequences, use.parser)
    if body.stream:
        return EventSourceResponse(_stream(worker, job, reply), ping=15)
    text, outcome = await collect(worker, job, request)
    return JSONResponse(reply.whole(text, outcome))


@router.post("/v1/messages/count_tokens")
async def count_tokens(request: Request):
    state, body, worker = await begin(request, CountTokensRequest)
    check_tool_choice(body)
    ids, _ = _prompt(worker, body)
    return {"input_tokens": len(ids)}


# ---- requests -> prompts ----------------------------------------------------------------------------------------
def _prompt(worker, body: CountTokensRequest) -> tuple[list[int], ToolUse]:
    """The prompt's token ids, and what the tools make of the conversation and the reply."""
    template = worker.template
    use = tool_use(template, template_messages(body, template), body.functions())
    prefill = _prefill(body.messages[-1])
    if prefill:  # the conversation as it stands, cut after the prefill's text: the reply goes on from there
        text = use.render(template, add_generation_prompt=False)
        at = text.rfind(prefill)
        if at < 0:
            raise APIError(400, "messages: the final assistant message is a prefill, but the chat template does not "
                           "write its text as it is, so the reply cannot continue it", param="messages")
        text = text[:at + len(prefill)]
    else:
        text = use.render(template)
    return worker.model.encode(text, add_special_tokens=False), use


def template_messages(body: CountTokensRequest, template=None) -> list[dict]:
    """The request's system prompt and messages as chat templates expect them (HF's conventions). System entries
    among the messages stay where they stand if ``template`` renders them there; a template that refuses them
    (most allow a system message only first) gets them folded into the system prompt, in their order."""
    system = body.system_text()
    out = [{"role": "system", "content": system}] if system else []
    for i, m in enumerate(body.messages):
        out.extend(_template_message(m, f"messages.{i}"))
    return place_system_messages(template, out)


def _template_message(m: Message, where: str) -> list[dict]:
    """One Anthropic message -> one template message, or (a user message with tool results) several: each run of
    text a user message, each result a ``tool`` message, in the order of the blocks."""
    if isinstance(m.content, str):
        return [{"role": m.role, "content": m.content}]
    # thinking blocks: an assistant's reach the template as ``reasoning_content`` (templates that render reasoning
    # read it, the others ignore it); redacted ones, and any elsewhere, have nothing to render and are dropped
    blocks = [(b, f"{where}.content.{j}") for j, b in enumerate(m.content) if not isinstance(b, ThinkingBlock)]
    if m.role == "system":
        return [{"role": "system", "content": "".join(_text(b, at) for b, at in blocks)}]
    if m.role == "assistant":
        out = {"role": "assistant", "content": "".join(_text(b, at) for b, at in blocks
                                                       if not isinstance(b, ToolUseBlock))}
        reasoning = "".join(b.thinking for b in m.content if isinstance(b, ThinkingBlock))
        if reasoning:
            out["reasoning_content"] = reasoning
        calls = [template_tool_call(b.id, b.name, b.input) for b, _ in blocks if isinstance(b, ToolUseBlock)]
        if calls:
            out["tool_calls"] = calls
        return [out]
    out, text = [], []
    for b, at in blocks:
        if isinstance(b, ToolResultBlock):
            if text:
                out.append({"role": "user", "content": "".join(text)})
                text = []
            out.append({"role": "tool", "tool_call_id": b.tool_use_id, "content": _result_text(b, at)})
        else:
            text.append(_text(b, at))
    if text or not out:
        out.append({"role": "user", "content": "".join(text)})
    return out


def _text(block, where: str) -> str:
    """A text block's text; a 400 naming the block for anything that cannot be read as text where it stands."""
    if isinstance(block, TextBlock):
        return block.text
    if isinstance(block, ToolUseBlock):
        why = "a tool_use block belongs in an assistant message"
    elif isinstance(block, ToolResultBlock):
        why = "a tool_result block belongs in a user message"
    elif isinstance(block, OtherBlock) and block.type in _MEDIA_BLOCKS:
        why = f"content blocks of type {block.type!r} are not supported: this model reads text only"
    else:
        why = f"content blocks of type {block.type!r} are not supported"
    raise APIError(400, f"{where}: {why}", param=where, code="unsupported_content")


def _result_text(block: ToolResultBlock, where: str) -> str:
    """A tool result as text; a failed call's (``is_error``) says so, as templates have no field for it."""
    content = block.content or ""
    if not isinstance(content, str):
        content = "".join(_text(b, f"{where}.content.{j}") for j, b in enumerate(content))
    return f"Error: {content}" if block.is_error else content


def _prefill(last: Message) -> str:
    """The text a final assistant message asks the reply to continue ("" when the last message is not one)."""
    if last.role != "assistant":
        return ""
    if isinstance(last.content, str):
        return last.content
    if any(isinstance(b, ToolUseBlock) for b in last.content):
        return ""
    return "".join(_text(b, "messages") for b in last.content if not isinstance(b, ThinkingBlock))


# ---- jobs -> responses ------------------------------------------------------------------------------------------
class Reply:
    """The response of one request: the whole message, or the pieces of its stream. ``stop_sequences``: the
    client's, which tell a ``stop_sequence`` stop from the model's ``end_turn``; ``parser``: the tool-call parser
    the text goes through (None: no tools)."""

    def __init__(self, model_name: str, stop_sequences: list[str], parser=None):
        self.id = "msg_" + uuid.uuid4().hex[:24]
        self.model = model_name
        self.stop_sequences = stop_sequences
        self.blocks = ContentBlocks(parser)

    def message(self, content: list[dict], usage: dict, stop=(None, None)) -> dict:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": content,
                "stop_reason": stop[0], "stop_sequence": stop[1], "usage": usage}

    @staticmethod
    def usage(prompt_tokens: int, cached_tokens: int, output_tokens: int) -> dict:
        return {"input_tokens": prompt_tokens - cached_tokens, "output_tokens": output_tokens,
                "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached_tokens}

    def stop(self, outcome) -> tuple[str, str | None]:
        """(``stop_reason``, ``stop_sequence``) of a finished job."""
        if outcome.finish_reason == "length":
            return "max_tokens", None
        if self.blocks.calls:  # the agent is to run the calls, whatever ended the text after them
            return "tool_use", None
        if outcome.stop_sequence is not None and outcome.stop_sequence in self.stop_sequences:
            return "stop_sequence", outcome.stop_sequence
        return "end_turn", None  # an end-of-sequence token or the template's end-of-turn marker

    def whole(self, text: str, outcome) -> dict:
        events = self.blocks.start() + self.blocks.feed(text) + self.blocks.finish()
        usage = self.usage(outcome.prompt_tokens, outcome.cached_tokens, outcome.completion_tokens)
        return {**self.message(whole_content(events), usage, self.stop(outcome)), **reply_extras(outcome)}


def _event(name: str, **data) -> dict:
    """A server-sent event as the Anthropic API sends it: the event's name, and its name again as the data's type."""
    return {"event": name, "data": json.dumps({"type": name, **data})}


async def _stream(worker, job: Job, reply: Reply):
    """The events of ``job``: ``message_start``, ``ping``, the content blocks as their text comes
    (``content_block_start``, ``content_block_delta``..., ``content_block_stop``: :mod:`anthropic_content`),
    ``message_delta`` (the stop reason, the output tokens), ``message_stop``; an error after the start is an
    ``error`` event. Closing the stream early (the client went away) cancels the job
    (:func:`freetoken.serve.jobs.job_events`)."""
    yield _event("message_start", message=reply.message([], reply.usage(len(job.ids), 0, 0)))
    for name, data in reply.blocks.start():
        yield _event(name, **data)
    yield _event("ping")
    async with aclosing(job_events(worker, job)) as events:
        async for kind, value in events:
            if kind == "text":
                for name, data in reply.blocks.feed(value):
                    yield _event(name, **data)
            elif kind == "done":
                for name, data in reply.blocks.finish():
                    yield _event(name, **data)
                reason, sequence = reply.stop(value)
                yield _event("message_delta", delta={"stop_reason": reason, "stop_sequence": sequence},
                             usage=reply.usage(value.prompt_tokens, value.cached_tokens, value.completion_tokens),
                             **reply_extras(value))
                yield _event("message_stop")
            else:  # the stream has started (status 200): the error goes in the stream, as the Anthropic API does
                yield {"event": "error", "data": json.dumps(value.anthropic_body())}
