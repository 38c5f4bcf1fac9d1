"""A reply's text as the Responses API's output items: a ``message`` item for text, and an item per call the
tool-call parser finds (:mod:`freetoken.serve.tool_calls`), in the order they begin: ``function_call`` for a
function tool, ``custom_tool_call`` for a custom (freeform) one.

:class:`OutputItems` turns the text, as it streams, into the stream's item events (without ``sequence_number``:
the route numbers them):

- a message: ``response.output_item.added``, ``response.content_part.added``, ``response.output_text.delta``...,
  then ``response.output_text.done``, ``response.content_part.done``, ``response.output_item.done``;
- a function call: ``response.output_item.added`` (its name and ``call_id``, no arguments yet),
  ``response.function_call_arguments.delta`` per argument fragment, ``response.function_call_arguments.done``,
  ``response.output_item.done``;
- a custom tool call: the model wrote it as a function of one string argument ``input`` (its JSON text is held
  back, not streamed), so at its end ``response.custom_tool_call_input.delta`` (the whole input) and ``.done``,
  then ``response.output_item.done``.

The whole response's ``output`` is the items of the ``response.output_item.done`` events (:func:`done_items`), so
that the streamed and the whole reply are one and the same. An item still open when the reply is cut by
``max_output_tokens`` ends with status ``incomplete``. Whitespace next to a call (the newline before
``<tool_call>``, between two calls) is dropped, as for the Anthropic content blocks
(:mod:`freetoken.serve.anthropic_content`); a reply with nothing in it is one empty message.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from freetoken.serve.tool_calls import CallStart, Content


@dataclass(frozen=True)
class ToolRef:
    """What a name the model calls stands for: a ``function`` or ``custom`` tool, and its namespace (or None)."""

    kind: str
    name: str
    namespace: str | None = None


def new_id(prefix: str) -> str:
    return prefix + uuid.uuid4().hex[:24]


class OutputItems:
    """The item events of one reply: :meth:`feed` per text piece, :meth:`finish` at the end; each returns a list of
    ``(event type, data)``. ``parser``: the tool-call parser (None: no tools, the text is one message);
    ``lookup(name)``: the tool a called name stands for."""

    def __init__(self, parser=None, lookup: Callable[[str], ToolRef] | None = None):
        self.parser = parser
        self.lookup = lookup or (lambda name: ToolRef("function", name))
        self.index = -1  # the open item's output_index (-1: none yet)
        self.item: dict | None = None  # the open item
        self.text = ""  # the open message's text, or the open call's arguments
        self.pending = ""  # whitespace held back: dropped if a call comes next
        self.call_items: dict[int, int] = {}  # the parser's call index -> its item's output_index

    def feed(self, piece: str) -> list[tuple[str, dict]]:
        if not piece:
            return []
        if self.parser is None:
            return self._text(piece)
        return self._events(self.parser.feed(piece))

    def finish(self, cut: bool = False) -> list[tuple[str, dict]]:
        """The events that end the reply (``cut``: by max_output_tokens, so the open item is incomplete)."""
        out = self._events(self.parser.finish()) if self.parser is not None else []
        if self.pending:  # the tail of the last text, or a reply of whitespace only: no call follows it
            out += self._text(self.pending)
            self.pending = ""
        if self.index < 0:  # nothing at all: one empty message
            out += self._open_message()
        return out + self._close("incomplete" if cut else "completed")

    # ---- parser events -> item events ----------------------------------------------------------------------
    def _events(self, events) -> list[tuple[str, dict]]:
        out = []
        for e in events:
            if isinstance(e, Content):
                out += self._content(e.text)
            elif isinstance(e, CallStart):
                self.pending = ""
                out += self._open_call(e)
            elif e.fragment and self.call_items.get(e.index) == self.index:
                self.text += e.fragment
                if self.item["type"] == "function_call":
                    out.append(("response.function_call_arguments.delta",
                                {**self._where(), "delta": e.fragment}))
        return out

    def _content(self, text: str) -> list[tuple[str, dict]]:
        """Text between calls: the whitespace after a call dropped, the trailing whitespace held back (a call may
        come next)."""
        text = self.pending + text
        if self.item is not None and self.item["type"] != "message":
            text = text.lstrip()
        body = text.rstrip()
        self.pending = text[len(body):]
        return self._text(body) if body else []

    def _text(self, text: str) -> list[tuple[str, dict]]:
        out = [] if self.item is not None and self.item["type"] == "message" else self._open_message()
        self.text += text
        return out + [("response.output_text.delta", {**self._where(), "content_index": 0, "delta": text,
                                                      "logprobs": []})]

    # ---- items ------------------------------------------------------------------------------------------------
    def _where(self) -> dict:
        return {"item_id": self.item["id"], "output_index": self.index}

    def _open(self, item: dict) -> list[tuple[str, dict]]:
        out = self._close("completed")
        self.index += 1
        self.item, self.text = item, ""
        return out + [("response.output_item.added", {"output_index": self.index, "item": dict(item)})]

    def _open_message(self) -> list[tuple[str, dict]]:
        out = self._open({"id": new_id("msg_"), "type": "message", "status": "in_progress", "role": "assistant",
                          "content": []})
        return out + [("response.content_part.added", {**self._where(), "content_index": 0,
                                                        "part": _text_part("")})]

    def _open_call(self, e: CallStart) -> list[tuple[str, dict]]:
        ref = self.lookup(e.name)
        if ref.kind == "custom":
            item = {"id": new_id("ctc_"), "type": "custom_tool_call", "call_id": e.id, "name": ref.name, "input": ""}
        else:
            item = {"id": new_id("fc_"), "type": "function_call", "status": "in_progress", "call_id": e.id,
                    "name": ref.name, "arguments": ""}
        if ref.namespace is not None:
            item["namespace"] = ref.namespace
        out = self._open(item)
        self.call_items[e.index] = self.index
        return out

    def _close(self, status: str) -> list[tuple[str, dict]]:
        """The events that end the open item (none open: none)."""
        item, text = self.item, self.text
        if item is None:
            return []
        where = self._where()
        self.item = None
        if item["type"] == "message":
            part = _text_part(text)
            done = {**item, "status": status, "content": [part]}
            return [("response.output_text.done", {**where, "content_index": 0, "text": text, "logprobs": []}),
                    ("response.content_part.done", {**where, "content_index": 0, "part": part}),
                    ("response.output_item.done", {"output_index": where["output_index"], "item": done})]
        if item["type"] == "function_call":
            done = {**item, "status": status, "arguments": text}
            return [("response.function_call_arguments.done", {**where, "arguments": text}),
                    ("response.output_item.done", {"output_index": where["output_index"], "item": done})]
        value = custom_input(text)
        done = {**item, "input": value}
        out = [("response.custom_tool_call_input.delta", {**where, "delta": value})] if value else []
        return out + [("response.custom_tool_call_input.done", {**where, "input": value}),
                      ("response.output_item.done", {"output_index": where["output_index"], "item": done})]


def _text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": []}


def custom_input(arguments: str) -> str:
    """A custom tool call's input from the arguments the model wrote (``{"input": TEXT}``); arguments that are not
    that (a reply cut inside the call, a model that wrote it badly) are passed on as they are, so that the call
    still reaches the agent, whose tool then reports what is wrong."""
    try:
        value = json.loads(arguments)
    except ValueError:
        return arguments
    if isinstance(value, dict) and isinstance(value.get("input"), str):
        return value["input"]
    return arguments


def done_items(events: list[tuple[str, dict]]) -> list[dict]:
    """The output items that item events make: those their ``response.output_item.done`` events carry."""
    return [data["item"] for name, data in events if name == "response.output_item.done"]
