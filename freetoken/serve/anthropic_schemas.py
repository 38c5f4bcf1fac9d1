"""Request bodies of the Anthropic Messages endpoints, as pydantic models: a malformed request is a 400 naming its
field.

Fields the Anthropic API defines and this server does not act on are accepted and ignored (``metadata``,
``thinking``, ``service_tier``, ``cache_control`` on blocks...), as are fields no API defines. What it cannot
honour is refused with a 400 rather than silently answered otherwise: ``tools`` and a ``tool_choice`` that forces
a call (:func:`refuse_unsupported`: not built for this endpoint yet), and content blocks other than text, tool_use
and tool_result (images, documents: refused when the conversation is rendered, :mod:`freetoken.serve.anthropic_api`).
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag

from freetoken.serve.errors import APIError
from freetoken.serve.schemas import MAX_STOP_STRINGS


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class TextBlock(_Body):
    type: Literal["text"]
    text: str


class OtherBlock(_Body):
    """A block of another kind (an image, a document, a thinking block): refused with a clear error."""

    type: str


def _block_kind(value) -> str | None:
    """Which model a content block is read as, by its ``type``: a text block missing its text is then reported as
    that, not as a mismatch with every kind. The tags are class names, which error locations leave out."""
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    if not isinstance(kind, str):
        return None
    return {"text": "TextBlock", "tool_use": "ToolUseBlock", "tool_result": "ToolResultBlock"}.get(kind, "OtherBlock")


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
                  | Annotated[ToolResultBlock, Tag("ToolResultBlock")] | Annotated[OtherBlock, Tag("OtherBlock")],
                  Discriminator(_block_kind)]


class Message(_Body):
    role: Literal["user", "assistant"]
    content: str | list[Block]


class ToolChoice(_Body):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None


class CountTokensRequest(_Body):
    """``POST /v1/messages/count_tokens``: the conversation, without what only generation needs."""

    model: Annotated[str, Field(min_length=1)]
    messages: Annotated[list[Message], Field(min_length=1)]
    system: str | list[TextBlock] | None = None
    tools: list[dict] | None = None
    tool_choice: ToolChoice | None = None

    def system_text(self) -> str:
        """The system prompt: a string, or its text blocks joined (as the OpenAI route joins text parts)."""
        if self.system is None or isinstance(self.system, str):
            return self.system or ""
        return "".join(b.text for b in self.system)


class MessagesRequest(CountTokensRequest):
    """``POST /v1/messages``. ``temperature`` is 0..1 as the Anthropic API has it (0: greedy)."""

    max_tokens: Annotated[int, Field(ge=1)]
    stop_sequences: Annotated[list[str], Field(max_length=MAX_STOP_STRINGS)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=1.0, allow_inf_nan=False)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0, allow_inf_nan=False)] | None = None
    top_k: Annotated[int, Field(ge=0)] | None = None
    stream: bool = False


def refuse_unsupported(req: CountTokensRequest) -> None:
    """A 400 for tool use, which this endpoint does not do yet (earlier calls and results in the conversation are
    fine: they are rendered)."""
    if req.tools:
        raise APIError(400, "tools: tool use is not supported by this server yet", param="tools",
                       code="unsupported_parameter")
    if req.tool_choice is not None and req.tool_choice.type in ("any", "tool"):
        raise APIError(400, "tool_choice: tool use is not supported by this server yet", param="tool_choice",
                       code="unsupported_parameter")
