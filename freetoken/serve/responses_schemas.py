"""Request bodies of the OpenAI Responses endpoint (``POST /v1/responses``), as pydantic models: a malformed request is
a 400 naming its field (``input.3.call_id``).

``input`` is a string (one user message) or a list of items, each read as the model its ``type`` names (a message
when it has a ``role`` and no type), so that an item missing a field is reported as that item, not as a mismatch
with every kind: messages (text parts), ``function_call`` / ``function_call_output``, ``custom_tool_call`` /
``custom_tool_call_output`` and ``reasoning`` items. An item or content part of another type parses as
:class:`OtherItem` / :class:`OtherPart` and is refused where the conversation is built
(:mod:`freetoken.serve.responses_api`), naming it.

``tools``: ``function`` tools, ``custom`` (freeform) tools and ``namespace`` groups of them are what the model is
told of; a tool of another type parses as :class:`OtherTool` and the route decides (the API's hosted tools are left
out, the client-run built-ins refused). Tool models keep the fields they do not know (``extra="allow"``): the
response echoes the tools as they were sent.

Fields the Responses API defines and this server does not act on are accepted and ignored (``include``,
``metadata``, ``user``, ``prompt_cache_key``, ``reasoning``, ``truncation``, ``service_tier``, ``stream_options``,
``parallel_tool_calls``, ``text.verbosity``...), as are fields no API defines; what cannot be honoured is refused by
:func:`refuse_unsupported` (``background``, ``conversation``, ``prompt``, ``top_logprobs``) rather than silently
answered otherwise.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, model_validator

from freetoken.serve.errors import APIError
from freetoken.serve.schemas import AnchorId

#: The names a function (and a custom tool) may have, as the chat route takes them
TOOL_NAME = r"^[A-Za-z0-9_.\-]{1,64}$"


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


def _tagged(kinds: dict[str, str], default: str, what: str, untyped: str | None = None):
    """A discriminator that reads a value as the model its ``type`` names (``kinds``: type -> tag), any other type
    as ``default``, and one with no type as ``untyped`` (None: ``default``); a value that is no object is an error
    saying what ``what`` is. The tags are class names, which error locations leave out
    (:func:`freetoken.serve.errors.validation_error`)."""

    def kind(value) -> str | None:
        t = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
        if t is None:
            return untyped or default if isinstance(value, dict) or hasattr(value, "type") else None
        return kinds.get(t, default) if isinstance(t, str) else None

    return Discriminator(kind, custom_error_type="not_an_object", custom_error_message=what)


# ---- content parts ----------------------------------------------------------------------------------------------
class TextPart(_Body):
    """``input_text`` (what the user and the system say), ``output_text`` (what the assistant said)."""

    type: Literal["input_text", "output_text", "text"]
    text: str


class RefusalPart(_Body):
    """An assistant's refusal, as an earlier response may hold it: read as its text."""

    type: Literal["refusal"]
    refusal: str


class OtherPart(_Body):
    """A part of another kind (an image, a file, audio): refused with a clear error."""

    type: str


Part = Annotated[Annotated[TextPart, Tag("TextPart")] | Annotated[RefusalPart, Tag("RefusalPart")]
                 | Annotated[OtherPart, Tag("OtherPart")],
                 _tagged({"input_text": "TextPart", "output_text": "TextPart", "text": "TextPart",
                          "refusal": "RefusalPart"}, "OtherPart", "a content part is an object with a type")]


def parts_text(parts: list, where: str) -> str:
    """The text of a list of content parts (``where``: their field, for the error an unreadable one gets)."""
    out = []
    for j, p in enumerate(parts):
        if isinstance(p, TextPart):
            out.append(p.text)
        elif isinstance(p, RefusalPart):
            out.append(p.refusal)
        else:
            raise APIError(400, f"{where}.{j}.type: content parts of type {p.type!r} are not supported: this model "
                           "reads text only", param=f"{where}.{j}.type", code="unsupported_content")
    return "".join(out)


# ---- input items ------------------------------------------------------------------------------------------------
class Message(_Body):
    """A message: ``{"role", "content"}``, with ``"type": "message"`` or without a type."""

    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[Part]


class FunctionCallItem(_Body):
    """A function call the assistant made (an earlier response's output item)."""

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str = ""
    namespace: str | None = None


class FunctionCallOutputItem(_Body):
    """What a function call returned."""

    type: Literal["function_call_output"]
    call_id: str
    output: str | list[Part]


class CustomToolCallItem(_Body):
    """A custom (freeform) tool call the assistant made: its ``input`` is free text."""

    type: Literal["custom_tool_call"]
    call_id: str
    name: str
    input: str = ""


class CustomToolCallOutputItem(_Body):
    """What a custom tool call returned."""

    type: Literal["custom_tool_call_output"]
    call_id: str
    output: str | list[Part]


class ReasoningItem(_Body):
    """A reasoning item of an earlier response (another server's: this one writes none): accepted and dropped."""

    type: Literal["reasoning"]


class OtherItem(_Body):
    """An item of another type (an image generation call, a web search call, an item reference...): refused."""

    type: str


_ITEM_KINDS = {"message": "Message", "function_call": "FunctionCallItem",
               "function_call_output": "FunctionCallOutputItem", "custom_tool_call": "CustomToolCallItem",
               "custom_tool_call_output": "CustomToolCallOutputItem", "reasoning": "ReasoningItem"}

InputItem = Annotated[
    Annotated[Message, Tag("Message")] | Annotated[FunctionCallItem, Tag("FunctionCallItem")]
    | Annotated[FunctionCallOutputItem, Tag("FunctionCallOutputItem")]
    | Annotated[CustomToolCallItem, Tag("CustomToolCallItem")]
    | Annotated[CustomToolCallOutputItem, Tag("CustomToolCallOutputItem")]
    | Annotated[ReasoningItem, Tag("ReasoningItem")] | Annotated[OtherItem, Tag("OtherItem")],
    _tagged(_ITEM_KINDS, "OtherItem", "an input item is an object with a type (a message: with a role)",
            untyped="Message")]


# ---- tools ------------------------------------------------------------------------------------------------------
class _Tool(BaseModel):
    model_config = ConfigDict(extra="allow")  # echoed in the response as sent


class FunctionTool(_Tool):
    type: Literal["function"]
    name: Annotated[str, Field(pattern=TOOL_NAME)]
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class CustomFormat(_Body):
    """A custom tool's input: free ``text``, or text a ``grammar`` (``lark`` or ``regex``) describes."""

    type: Literal["text", "grammar"]
    syntax: str | None = None
    definition: str | None = None


class CustomTool(_Tool):
    """A freeform tool: the model writes its input as free text (Codex's ``apply_patch``)."""

    type: Literal["custom"]
    name: Annotated[str, Field(pattern=TOOL_NAME)]
    description: str | None = None
    format: CustomFormat | None = None


NamespacedTool = Annotated[Annotated[FunctionTool, Tag("FunctionTool")] | Annotated[CustomTool, Tag("CustomTool")],
                           _tagged({"function": "FunctionTool", "custom": "CustomTool"}, "FunctionTool",
                                   "a tool is an object with a type")]


class NamespaceTool(_Tool):
    """Function and custom tools grouped under a name (their calls carry it as ``namespace``)."""

    type: Literal["namespace"]
    name: Annotated[str, Field(pattern=TOOL_NAME)]
    description: str | None = None
    tools: list[NamespacedTool]


class OtherTool(_Tool):
    """A tool of another type: one the API runs itself (web search...) or a client-run built-in (local shell)."""

    type: str


Tool = Annotated[Annotated[FunctionTool, Tag("FunctionTool")] | Annotated[CustomTool, Tag("CustomTool")]
                 | Annotated[NamespaceTool, Tag("NamespaceTool")] | Annotated[OtherTool, Tag("OtherTool")],
                 _tagged({"function": "FunctionTool", "custom": "CustomTool", "namespace": "NamespaceTool"},
                         "OtherTool", "a tool is an object with a type")]


class NamedToolChoice(_Body):
    """``{"type": "function", "name"}`` or ``{"type": "custom", "name"}``: a call of that tool, forced. Other types
    (``allowed_tools``, the hosted tools') parse, and are refused by name where the tools are known."""

    type: str
    name: str | None = None


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


# ---- text.format ------------------------------------------------------------------------------------------------
class TextFormat(_Body):
    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str | None = None
    description: str | None = None
    json_schema: dict | None = Field(default=None, alias="schema")
    strict: bool | None = None

    @model_validator(mode="after")
    def _schema_given(self):
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("type 'json_schema' needs schema")
        return self

    def json_schema_of(self) -> dict | None:
        """The JSON schema the reply must follow (None: free text)."""
        if self.type == "json_object":
            return {"type": "object"}
        return self.json_schema if self.type == "json_schema" else None

    def echo(self) -> dict:
        """As the response repeats it."""
        if self.type != "json_schema":
            return {"type": self.type}
        out = {"type": "json_schema", "name": self.name or "response", "schema": self.json_schema,
               "strict": self.strict}
        if self.description is not None:
            out["description"] = self.description
        return out


class TextConfig(_Body):
    format: TextFormat | None = None
    verbosity: str | None = None


# ---- the request ------------------------------------------------------------------------------------------------
class ResponsesRequest(_Body):
    """``POST /v1/responses``. ``temperature`` 0..2 and ``top_p`` as the OpenAI API has them."""

    model: str | None = None
    input: str | list[InputItem]
    instructions: str | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0, allow_inf_nan=False)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0, allow_inf_nan=False)] | None = None
    text: TextConfig | None = None
    store: bool | None = True
    previous_response_id: str | None = None
    stream: bool = False
    background: bool | None = None
    conversation: str | dict | None = None
    prompt: dict | None = None
    top_logprobs: int | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    truncation: str | None = None
    anchor: AnchorId | None = None  # not in the OpenAI API: resume from this anchor (freetoken.serve.jobs)

    def text_format(self) -> TextFormat:
        return self.text.format if self.text is not None and self.text.format is not None else TextFormat()


def refuse_unsupported(req: ResponsesRequest) -> None:
    """A 400 for a field whose meaning the server cannot honour (see the module docstring)."""

    def no(param: str, why: str):
        raise APIError(400, f"{param}: {why}", param=param, code="unsupported_parameter")

    if req.background:
        no("background", "background responses are not supported: send the request and wait for it (or stream it)")
    if req.conversation is not None:
        no("conversation", "the Conversations API is not supported: send the history in input, or name an earlier "
           "response in previous_response_id")
    if req.prompt is not None:
        no("prompt", "prompt templates are not supported: send instructions and input")
    if req.top_logprobs:
        no("top_logprobs", "log probabilities are not returned by this server")
