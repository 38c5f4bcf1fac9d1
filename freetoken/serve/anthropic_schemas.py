"""Request bodies of the Anthropic Messages endpoints, as pydantic models: a malformed request is a 400 naming its
field.

Fields the Anthropic API defines and this server does not act on are accepted and ignored (``metadata``,
``thinking``, ``service_tier``, ``cache_control`` on blocks and tools, ``tool_choice.disable_parallel_tool_use``...),
as are fields no API defines. Claude Code's requests are taken as it sends them: ``system`` entries among the
messages, thinking blocks in the history. What it cannot honour is refused with a 400 rather than silently answered
otherwise: the API's server tools (web search and the like: a ``type`` and no ``input_schema``), a ``tool_choice``
the tools cannot meet (:func:`check_tool_choice`), and content blocks other than text, tool_use, tool_result and
thinking (images, documents: refused when the conversation is rendered, :mod:`freetoken.serve.anthropic_api`).
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, model_validator

from freetoken.serve.errors import APIError
from freetoken.serve.schemas import MAX_STOP_STRINGS, AnchorId


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class TextBlock(_Body):
    type: Literal["text"]
    text: str


class OtherBlock(_Body):
    """A block of another kind (an image, a document, a thinking block): refused with a clear error."""

    type: str


class ThinkingBlock(_Body):
    """A reasoning block of an earlier assistant turn (agents send their history back as they got it)."""

    type: Literal["thinking", "redacted_thinking"]
    thinking: str = ""  # (a redacted block carries ``data`` instead: nothing a template could render)


def _block_kind(value) -> str | None:
    """Which model a content block is read as, by its ``type``: a text block missing its text is then reported as
    that, not as a mismatch with every kind. The tags are class names, which error locations leave out."""
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    if not isinstance(kind, str):
        return None
    return {"text": "TextBlock", "tool_use": "ToolUseBlock", "tool_result": "ToolResultBlock",
            "thinking": "ThinkingBlock", "redacted_thinking": "ThinkingBlock"}.get(kind, "OtherBlock")


ResultBlock = Annotated[Annotated[TextBlock, Tag("TextBlock")] | Annotated[OtherBlock, Tag("OtherBlock")],
                        Discriminator(_block_kind)]


class ToolUseBlock(_Body):
    """A tool call the assistant made (earlier in the conversation)."""

    type: Literal["tool_use"]
    id: str
    name: str
    input: dict = Field(default_factory=dict)


class ToolResultBlock(_Body):
    """What a call returned, in the user message after it."""

    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[ResultBlock] | None = None
    is_error: bool = False


Block = Annotated[Annotated[TextBlock, Tag("TextBlock")] | Annotated[ToolUseBlock, Tag("ToolUseBlock")]
                  | Annotated[ToolResultBlock, Tag("ToolResultBlock")] | Annotated[ThinkingBlock, Tag("ThinkingBlock")]
                  | Annotated[OtherBlock, Tag("OtherBlock")],
                  Discriminator(_block_kind)]


class Message(_Body):
    """A turn of the conversation. ``system`` is not a role of the Anthropic API, but Claude Code sends system
    entries among the messages: they are rendered where they stand where the template allows it, else folded
    into the system prompt (:func:`freetoken.serve.anthropic_api.template_messages`)."""

    role: Literal["user", "assistant", "system"]
    content: str | list[Block]


class ToolDef(_Body):
    """A tool the model may call: one the client runs, its input described by a JSON schema."""

    name: Annotated[str, Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]
    description: str | None = None
    input_schema: dict | None = None
    type: str | None = None  # "custom", or left out; the API's server tools name their kind here

    @model_validator(mode="after")
    def _a_client_tool(self):
        if self.type not in (None, "custom"):
            raise ValueError(f"tools of type {self.type!r} (the Anthropic API's server tools) are not supported: "
                             "only tools the client runs, with an input_schema")
        if self.input_schema is None:
            raise ValueError("a tool needs input_schema")
        return self

    def function(self) -> dict:
        """The tool as an OpenAI/HF function definition, the shape chat templates and the tool-call code read."""
        fn = {"name": self.name}
        if self.description:
            fn["description"] = self.description
        return {"type": "function", "function": {**fn, "parameters": self.input_schema}}


class ToolChoice(_Body):
    """``auto`` (the model decides), ``any`` (a call of one of the tools), ``tool`` (a call of ``name``), ``none``
    (no calls: the tools are not shown to the model)."""

    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None

    @model_validator(mode="after")
    def _a_name_for_tool(self):
        if self.type == "tool" and not self.name:
            raise ValueError("type 'tool' needs the tool's name")
        return self

    def forced(self) -> bool:
        return self.type in ("any", "tool")


class CountTokensRequest(_Body):
    """``POST /v1/messages/count_tokens``: the conversation, without what only generation needs."""

    model: Annotated[str, Field(min_length=1)]
    messages: Annotated[list[Message], Field(min_length=1)]
    system: str | list[TextBlock] | None = None
    tools: list[ToolDef] | None = None
    tool_choice: ToolChoice | None = None

    def system_text(self) -> str:
        """The system prompt: a string, or its text blocks joined (as the OpenAI route joins text parts)."""
        if self.system is None or isinstance(self.system, str):
            return self.system or ""
        return "".join(b.text for b in self.system)

    def functions(self) -> list[dict]:
        """The tools the model is told of, as function definitions (none for ``tool_choice`` none)."""
        if self.tool_choice is not None and self.tool_choice.type == "none":
            return []
        return [t.function() for t in self.tools or ()]


class MessagesRequest(CountTokensRequest):
    """``POST /v1/messages``. ``temperature`` is 0..1 as the Anthropic API has it (0: greedy)."""

    max_tokens: Annotated[int, Field(ge=1)]
    stop_sequences: Annotated[list[str], Field(max_length=MAX_STOP_STRINGS)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=1.0, allow_inf_nan=False)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0, allow_inf_nan=False)] | None = None
    top_k: Annotated[int, Field(ge=0)] | None = None
    stream: bool = False
    anchor: AnchorId | None = None  # not in the Anthropic API: resume from this anchor (freetoken.serve.jobs)


def check_tool_choice(req: CountTokensRequest) -> None:
    """A 400 for a ``tool_choice`` that forces a call the tools cannot make: with no tools, or of a tool not among
    them."""
    choice = req.tool_choice
    if choice is None or not choice.forced():
        return
    names = [t.name for t in req.tools or ()]
    if not names:
        why = f"{choice.type!r} forces a tool call, but the request has no tools"
    elif choice.type == "tool" and choice.name not in names:
        why = f"names the tool {choice.name!r}, which is not among the tools"
    else:
        return
    raise APIError(400, f"tool_choice: {why}", param="tool_choice", code="invalid_value")
