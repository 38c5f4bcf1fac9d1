"""A reply's text as the Anthropic API's content blocks: ``text`` blocks, and a ``tool_use`` block per call the
tool-call parser finds (:mod:`freetoken.serve.tool_calls`), indexed in the order they begin.

:class:`ContentBlocks` turns the text, as it streams, into the stream's block events (``content_block_start``,
``content_block_delta`` with a ``text_delta`` or, a call's argument fragments, an ``input_json_delta``,
``content_block_stop``); :func:`whole_content` assembles those events into the whole message's content, so that the
streamed and the whole reply are one and the same.

Whitespace next to a call (the newline before ``<tool_call>``, between two calls, after the last) is dropped, so
that it makes no text block of its own; text with no calls around it is kept as the model wrote it. A call's
``input`` is its arguments' JSON object; arguments that are not one (a model that wrote a call badly, or a reply cut
by max_tokens inside a call) come as ``{"raw": TEXT}``, so that the call still reaches the agent, whose tool then
reports what is wrong to the model. Streamed, the fragments go out as the model wrote them, as the Anthropic API
sends them.
"""

from __future__ import annotations

import json
import uuid

from freetoken.serve.tool_calls import CallStart, Content


def new_tool_use_id() -> str:
    return "toolu_" + uuid.uuid4().hex[:24]


class ContentBlocks:
    """The block events of one reply: :meth:`start` once, :meth:`feed` per text piece, :meth:`finish` at the end;
    each returns a list of ``(event name, data)``. ``parser``: the tool-call parser (None: no tools, one text
    block)."""

    def __init__(self, parser=None):
        self.parser = parser
        self.index = -1  # the open block's (-1: none yet)
        self.kind = None  # the open block's type: "text", "tool_use" or None
        self.pending = ""  # whitespace held back: dropped if a call comes next
        self.call_blocks: dict[int, int] = {}  # a call's index -> its block's

    @property
    def calls(self) -> int:
        return self.parser.calls if self.parser is not None else 0

    def start(self) -> list[tuple[str, dict]]:
        """Without tools the one text block opens at once (the stream starts as the Anthropic API's does); with
        tools, blocks open when their content comes (a reply that is a call has no text block)."""
        return self._open({"type": "text", "text": ""}) if self.parser is None else []

    def feed(self, piece: str) -> list[tuple[str, dict]]:
        if self.parser is None:
            return self._text(piece) if piece else []
        return self._events(self.parser.feed(piece))

    def finish(self) -> list[tuple[str, dict]]:
        out = self._events(self.parser.finish()) if self.parser is not None else []
        if self.pending:  # the tail of the last text, or a reply that is whitespace only: no call follows it
            out += self._text(self.pending)
            self.pending = ""
        if self.index < 0:  # nothing at all: one empty text block, as without tools
            out += self._open({"type": "text", "text": ""})
        out.append(("content_block_stop", {"index": self.index}))
        self.kind = None
        return out

    # ---- parser events -> block events ----------------------------------------------------------------------
    def _events(self, events) -> list[tuple[str, dict]]:
        out = []
        for e in events:
            if isinstance(e, Content):
                out += self._content(e.text)
            elif isinstance(e, CallStart):
                self.pending = ""
                out += self._open({"type": "tool_use", "id": new_tool_use_id(), "name": e.name, "input": {}})
                self.call_blocks[e.index] = self.index
            elif e.fragment:
                out.append(("content_block_delta", {"index": self.call_blocks[e.index],
                                                    "delta": {"type": "input_json_delta", "partial_json": e.fragment}}))
        return out

    def _content(self, text: str) -> list[tuple[str, dict]]:
        """Text between calls: the whitespace after a call dropped, the trailing whitespace held back (a call may
        come next)."""
        text = self.pending + text
        if self.kind == "tool_use":
            text = text.lstrip()
        body = text.rstrip()
        self.pending = text[len(body):]
        return self._text(body) if body else []

    def _text(self, text: str) -> list[tuple[str, dict]]:
        out = [] if self.kind == "text" else self._open({"type": "text", "text": ""})
        return out + [("content_block_delta", {"index": self.index, "delta": {"type": "text_delta", "text": text}})]

    def _open(self, block: dict) -> list[tuple[str, dict]]:
        out = [("content_block_stop", {"index": self.index})] if self.kind is not None else []
        self.index += 1
        self.kind = block["type"]
        return out + [("content_block_start", {"index": self.index, "content_block": block})]


def whole_content(events: list[tuple[str, dict]]) -> list[dict]:
    """The content blocks that block events make (a tool_use block's ``input`` parsed from its fragments)."""
    blocks, arguments = [], {}
    for name, data in events:
        if name == "content_block_start":
            blocks.append(dict(data["content_block"]))
        elif name == "content_block_delta":
            delta = data["delta"]
            if delta["type"] == "text_delta":
                blocks[data["index"]]["text"] += delta["text"]
            else:
                arguments[data["index"]] = arguments.get(data["index"], "") + delta["partial_json"]
    for index, text in arguments.items():
        blocks[index]["input"] = tool_input(text)
    return blocks


def tool_input(arguments: str) -> dict:
    """A call's arguments as the ``input`` object (``{"raw": TEXT}`` when they are not a JSON object)."""
    try:
        value = json.loads(arguments)
    except ValueError:
        return {"raw": arguments}
    return value if isinstance(value, dict) else {"raw": arguments}
