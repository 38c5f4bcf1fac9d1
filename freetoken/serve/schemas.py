"""Request bodies of the OpenAI endpoints, as pydantic models: a malformed request is a 400 naming its field.

Fields the OpenAI API defines and this server does not act on are accepted and ignored (``presence_penalty``,
``frequency_penalty``, ``user``, ``metadata``, ``store``, ``service_tier``, ``parallel_tool_calls``...), as are
fields no API defines; a field whose meaning we cannot honour is refused with a 400 by :func:`refuse_unsupported`
(``n`` > 1, ``logprobs``, image content) rather than
silently giving the client something else than it asked for. The README lists both kinds.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator, model_validator

from freetoken.serve.errors import APIError

MAX_STOP_STRINGS = 16


def _anchor_id(v: str) -> str:
    if len(v) != 64 or any(c not in "0123456789abcdefABCDEF" for c in v):
        raise ValueError("an anchor id is 64 hexadecimal digits (as POST /v1/anchors or GET /v1/anchors gives it)")
    return v.lower()


#: The ``anchor`` field of the chat requests: an anchor's id, to resume from (:mod:`freetoken.serve.jobs`)
AnchorId = Annotated[str, AfterValidator(_anchor_id)]


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Body):
    include_usage: bool = False


class TextPart(_Body):
    type: Literal["text", "input_text"]
    text: str


class OtherPart(_Body):
    """A content part of another kind (an image, audio, a file): refused with a clear error."""

    type: str

    @field_validator("type")
    @classmethod
    def _not_text(cls, v):
        if v in ("text", "input_text"):
            raise ValueError("a text part needs its text")
        return v


class FunctionCall(_Body):
    name: str
    arguments: str = ""


class ToolCall(_Body):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart | OtherPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

    @model_validator(mode="after")
    def _content_needed(self):
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError(f"a {self.role} message needs content")
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message needs tool_call_id")
        return self

    def text(self) -> str:
        """The message's text: a string, or its text parts joined."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        bad = [p.type for p in self.content if not isinstance(p, TextPart)]
        if bad:
            raise APIError(400, f"content parts of type {bad[0]!r} are not supported: this model reads text only",
                           param="messages.content", code="unsupported_content")
        return "".join(p.text for p in self.content)


Stop = str | Annotated[list[str], Field(max_length=MAX_STOP_STRINGS)] | None


class _Sampling(_Body):
    """What both generation endpoints take."""

    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0, allow_inf_nan=False)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0, allow_inf_nan=False)] | None = None
    top_k: Annotated[int, Field(ge=0)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0.0, allow_inf_nan=False)] | None = None
    seed: Annotated[int, Field(ge=0, lt=2**63)] | None = None
    stop: Stop = None
    n: Annotated[int, Field(ge=1)] = 1
    logprobs: bool | int | None = None
    #: token id (as a string, OpenAI's form) -> bias added to its logit; ids are checked against the vocabulary
    #: when the job is made (:func:`freetoken.serve.jobs.logit_bias_pairs`)
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0, allow_inf_nan=False)]] | None = None

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class FunctionDef(_Body):
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_.\-]{1,64}$")]
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class ToolDef(_Body):
    type: Literal["function"] = "function"
    function: FunctionDef


class FunctionName(_Body):
    name: str


class NamedToolChoice(_Body):
    type: Literal["function"] = "function"
    function: FunctionName


class JsonSchemaFormat(_Body):
    name: str | None = None
    description: str | None = None
    json_schema: dict = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"] = "text"
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self):
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("type 'json_schema' needs json_schema.schema")
        return self

    def schema(self) -> dict | None:
        """The JSON schema the reply must follow (None: free text)."""
        if self.type == "json_object":
            return {"type": "object"}
        if self.type == "json_schema":
            return self.json_schema.json_schema
        return None


class ChatCompletionRequest(_Sampling):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    tools: list[ToolDef] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    response_format: ResponseFormat | None = None
    top_logprobs: int | None = None
    anchor: AnchorId | None = None  # not in the OpenAI API: resume from this anchor (freetoken.serve.jobs)

    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CompletionRequest(_Sampling):
    prompt: str | Annotated[list[str], Field(min_length=1, max_length=1)] | Annotated[list[int], Field(min_length=1)] \
        | Annotated[list[list[int]], Field(min_length=1, max_length=1)]
    echo: bool = False
    suffix: str | None = None
    best_of: Annotated[int, Field(ge=1)] | None = None

    @field_validator("prompt")
    @classmethod
    def _not_empty(cls, v):
        if v == "" or v == [""]:
            raise ValueError("the prompt is empty")
        return v

    def token_limit(self) -> int | None:
        return self.max_tokens


class AnchorRequest(_Body):
    """``POST /v1/anchors``: a conversation (rendered as the start of a later chat request: no generation prompt)
    or a prompt (text, or token ids), to prefill and anchor."""

    model: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    tools: list[ToolDef] | None = None
    prompt: Annotated[str, Field(min_length=1)] | Annotated[list[int], Field(min_length=1)] | None = None

    @model_validator(mode="after")
    def _one_of(self):
        if (self.messages is None) == (self.prompt is None):
            raise ValueError("give either messages or prompt")
        if self.tools and self.messages is None:
            raise ValueError("tools go with messages")
        return self


def refuse_unsupported(req: _Sampling) -> None:
    """A 400 for a field whose meaning the server cannot honour (see the module docstring)."""

    def no(param: str, why: str):
        raise APIError(400, f"{param}: {why}", param=param, code="unsupported_parameter")

    if req.n != 1:
        no("n", "one choice per request only")
    if req.logprobs:
        no("logprobs", "log probabilities are not returned by this server")
    if isinstance(req, ChatCompletionRequest):
        names = [t.function.name for t in req.tools or ()]
        if isinstance(req.tool_choice, NamedToolChoice) and req.tool_choice.function.name not in names:
            no("tool_choice", f"names the function {req.tool_choice.function.name!r}, which is not among the tools")
        if req.tool_choice == "required" and not names:
            no("tool_choice", "'required' needs tools")
        forced = req.tool_choice == "required" or isinstance(req.tool_choice, NamedToolChoice)
        if forced and req.response_format is not None and req.response_format.schema() is not None:
            no("response_format", "a JSON reply and a forced tool call exclude each other")
    if isinstance(req, CompletionRequest):
        if req.suffix:
            no("suffix", "fill-in-the-middle is not supported")
        if req.best_of not in (None, 1):
            no("best_of", "one completion per request only")
