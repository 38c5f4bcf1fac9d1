"""Tool calls in generated text: which form a chat template's family writes, and an incremental parser for each.

Forms (``tool_format(template_source)``):

- ``hermes``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (Qwen2.5, Qwen3, Hermes, many more);
- ``qwen3_coder``: ``<tool_call><function=NAME><parameter=P>VALUE</parameter>...</function></tool_call>``;
- ``glm45`` (GLM-4.5/4.6): ``<tool_call>NAME\n<arg_key>K</arg_key>\n<arg_value>V</arg_value>\n...</tool_call>``, a
  string value as its text, others as JSON (the template writes ``v | tojson`` unless ``v`` is a string);
- ``deepseek``: ``<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>ARGS<｜tool▁call▁end｜>`` (V3.1) and
  ``<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME`` + a ```json block (V3), inside
  ``<｜tool▁calls▁begin｜>...<｜tool▁calls▁end｜>``;
- ``kimi_k2``: ``<|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>ARGS
  <|tool_call_end|>...<|tool_calls_section_end|>``;
- ``minimax`` (MiniMax-M2): ``<minimax:tool_call><invoke name="NAME"><parameter name="P">V</parameter>...</invoke>
  ...</minimax:tool_call>``, several calls in one block, a value as ``qwen3_coder``'s;
- ``harmony`` (gpt-oss): messages ``<|channel|>CH [to=functions.NAME] [<|constrain|>json]<|message|>BODY`` ended by
  ``<|end|>`` (more follow), ``<|call|>`` or ``<|return|>``: the ``final`` channel is the reply's content, a message
  to ``functions.NAME`` is a call, the ``analysis`` channel (reasoning) is not shown;
- ``injected``: the template knows no tools (the bundled model's): the server describes the tools in a system
  message of its own and asks for the hermes form (:func:`tools_system_prompt`), and renders earlier calls and
  results as hermes text (:func:`inject_history`).

A parser takes text pieces as they stream (``feed``) and returns events: ``Content(text)``, ``CallStart(index, id,
name)`` and ``CallArgs(index, fragment)``; the fragments of one call join into its arguments' JSON text. Text that
could be the start of a marker is held back until it is clear; ``finish()`` flushes the rest (an unterminated call
is closed as it stands, so a reply cut by max_tokens still reports what it began).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass


@dataclass(frozen=True)
class Content:
    text: str


@dataclass(frozen=True)
class CallStart:
    index: int
    id: str
    name: str


@dataclass(frozen=True)
class CallArgs:
    index: int
    fragment: str


def tool_format(source: str) -> str:
    """The tool-call form a chat template's model writes (``injected`` when the template has none)."""
    if "tool▁call▁begin" in source:
        return "deepseek"
    if "<|tool_calls_section_begin|>" in source:
        return "kimi_k2"
    if "<minimax:tool_call>" in source:
        return "minimax"
    if "<tool_call>" in source and "<function=" in source:
        return "qwen3_coder"
    if "<tool_call>" in source and "<arg_key>" in source:
        return "glm45"
    if "<tool_call>" in source:
        return "hermes"
    if "<|channel|>" in source or "<|call|>" in source:
        return "harmony"
    return "injected"


def make_parser(form: str):
    if form in ("hermes", "injected"):
        return HermesParser()
    if form == "qwen3_coder":
        return Qwen3CoderParser()
    if form == "glm45":
        return Glm45Parser()
    if form == "deepseek":
        return DeepSeekParser()
    if form == "kimi_k2":
        return KimiK2Parser()
    if form == "minimax":
        return MiniMaxParser()
    if form == "harmony":
        return HarmonyParser()
    raise ValueError(f"tool calls in the {form!r} form are not supported")


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def _held(text: str, marker: str) -> int:
    """How many characters at the end of ``text`` could begin ``marker`` (they wait for the next piece)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


class _Parser:
    """The shared part: content outside calls, a call count, ids."""

    OPEN = ""  # the marker that starts a call (or a block of calls)

    def __init__(self):
        self.buf = ""
        self.inside = False
        self.calls = 0
        self.events: list = []

    def feed(self, text: str) -> list:
        self.buf += text
        self._scan(final=False)
        out, self.events = self.events, []
        return out

    def finish(self) -> list:
        self._scan(final=True)
        if self.inside:
            self._close_call(self.buf, final=True)
            self.buf = ""
            self.inside = False
        elif self.buf:
            self.events.append(Content(self.buf))
            self.buf = ""
        out, self.events = self.events, []
        return out

    def _content_until_open(self, final: bool) -> bool:
        """Emit content up to the open marker; True when the marker was found (consumed)."""
        at = self.buf.find(self.OPEN)
        if at < 0:
            keep = 0 if final else _held(self.buf, self.OPEN)
            if len(self.buf) > keep:
                self.events.append(Content(self.buf[:len(self.buf) - keep]))
                self.buf = self.buf[len(self.buf) - keep:]
            return False
        if at:
            self.events.append(Content(self.buf[:at]))
        self.buf = self.buf[at + len(self.OPEN):]
        return True

    def _start(self, name: str) -> int:
        index = self.calls
        self.calls += 1
        self.events.append(CallStart(index, new_call_id(), name))
        return index

    def _scan(self, final: bool) -> None:
        """Content up to a call's open marker, then the call: until the text runs out."""
        while True:
            if not self.inside:
                if not self._content_until_open(final):
                    return
                self.inside = True
                self._reset_call()
            elif not self._step_inside():
                return

    def _reset_call(self) -> None:  # noqa: B027 - a form that keeps no state per call has nothing to reset
        """A call begins."""

    def _step_inside(self) -> bool:
        """Take what the buffer holds of the call: True when the call (or block of calls) closed."""
        raise NotImplementedError

    def _close_call(self, body: str, final: bool) -> None:
        raise NotImplementedError


# ---- hermes -----------------------------------------------------------------------------------------------------
_HERMES_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*')


class HermesParser(_Parser):
    """``<tool_call>{"name": N, "arguments": A}</tool_call>``: the name as soon as it is complete, then A's text as it
    comes (the object's closing brace and trailing space held back until the call ends)."""

    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def __init__(self):
        super().__init__()
        self._reset_call()

    def _reset_call(self):
        self.index = None  # this call's index once its name is out
        self.sent = ""  # argument text sent so far

    def _step_inside(self) -> bool:
        end = self.buf.find(self.CLOSE)
        if end < 0:
            self._stream_args(self.buf[:len(self.buf) - _held(self.buf, self.CLOSE)])
            return False
        self._close_call(self.buf[:end], final=False)
        self.buf = self.buf[end + len(self.CLOSE):]
        self.inside = False
        return True

    def _stream_args(self, body: str) -> None:
        head = _HERMES_HEAD.match(body)
        if head is None:
            return
        if self.index is None:
            self.index = self._start(json.loads(f'"{head.group(1)}"'))
        args = body[head.end():].rstrip()
        if args.startswith('"'):  # the arguments as a JSON string: decoded when the call ends
            return
        if args.endswith("}"):  # perhaps the object's own closing brace: wait and see
            args = args[:-1].rstrip()
        if len(args) > len(self.sent) and args.startswith(self.sent):
            self.events.append(CallArgs(self.index, args[len(self.sent):]))
            self.sent = args

    def _close_call(self, body: str, final: bool) -> None:
        head = _HERMES_HEAD.match(body)
        if head is not None and self.index is not None:
            args = body[head.end():].rstrip()
            if args.endswith("}"):
                args = args[:-1].rstrip()
            if args.startswith('"') and not self.sent:
                try:
                    args = json.loads(args)
                except ValueError:
                    pass
            rest = args[len(self.sent):] if args.startswith(self.sent) else ""
            if rest:
                self.events.append(CallArgs(self.index, rest))
            self._reset_call()
            return
        try:  # another key order, or arguments given as a JSON string: the whole object decides
            obj = json.loads(body)
            name = obj["name"]
            args = obj.get("arguments", obj.get("parameters", {}))
        except (ValueError, KeyError, TypeError):
            self.events.append(Content(self.OPEN + body + ("" if final else self.CLOSE)))  # not a call after all
            self._reset_call()
            return
        index = self._start(str(name))
        self.events.append(CallArgs(index, args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)))
        self._reset_call()


# ---- qwen3-coder ------------------------------------------------------------------------------------------------
_FUNCTION = re.compile(r"\s*<function=([^>\n]+)>")
_PARAMETER = re.compile(r"\s*<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.S)


def _xml_value(text: str):
    """A parameter's text as JSON: a number, a boolean, null, an object or a list where it parses, else the string."""
    try:
        return json.loads(text)
    except ValueError:
        return text


class Qwen3CoderParser(_Parser):
    """``<tool_call><function=NAME><parameter=P>V</parameter>...</function></tool_call>``: the name, then one
    fragment per parameter as it closes (``{"P": V``, ``, "Q": W``, then ``}``)."""

    OPEN, CLOSE = "<tool_call>", "</tool_call>"
    NAME, PAIR = _FUNCTION, _PARAMETER  # the call's name; one argument: groups (key, value text)

    def __init__(self):
        super().__init__()
        self._reset_call()

    def _reset_call(self):
        self.index = None
        self.params = 0
        self.consumed = 0  # characters of the call body already turned into events

    def _step_inside(self) -> bool:
        end = self.buf.find(self.CLOSE)
        body = self.buf if end < 0 else self.buf[:end]
        self._advance(body)
        if end < 0:
            return False
        self._close_call(body, final=False)
        self.buf = self.buf[end + len(self.CLOSE):]
        self.inside = False
        return True

    def _advance(self, body: str) -> None:
        if self.index is None:
            m = self.NAME.match(body)
            if m is None:
                return
            self.index = self._start(m.group(1).strip())
            self.consumed = m.end()
        while True:
            m = self.PAIR.match(body, self.consumed)
            if m is None:
                return
            key = json.dumps(m.group(1).strip(), ensure_ascii=False)
            value = json.dumps(_xml_value(m.group(2)), ensure_ascii=False)
            self.events.append(CallArgs(self.index, ("{" if self.params == 0 else ", ") + f"{key}: {value}"))
            self.params += 1
            self.consumed = m.end()

    def _close_call(self, body: str, final: bool) -> None:
        self._advance(body)
        if self.index is None:
            self.events.append(Content(self.OPEN + body + ("" if final else self.CLOSE)))
        else:
            self.events.append(CallArgs(self.index, "}" if self.params else "{}"))
        self._reset_call()


# ---- minimax-m2 ---------------------------------------------------------------------------------------------------
class MiniMaxParser(Qwen3CoderParser):
    """``<minimax:tool_call>`` then one ``<invoke name="NAME">`` per call, its ``<parameter name="P">V</parameter>``
    (a fragment each as it closes, as :class:`Qwen3CoderParser`), ``</invoke>``; ``</minimax:tool_call>`` ends the
    block. A block without an invoke is text."""

    OPEN, CLOSE = "<minimax:tool_call>", "</minimax:tool_call>"
    INVOKE = re.compile(r'\s*<invoke name="([^"]*)">')
    PAIR = re.compile(r'\s*<parameter name="([^"]*)">\n?(.*?)\n?</parameter>', re.S)
    END = re.compile(r"\s*</invoke>")

    def _reset_call(self):
        super()._reset_call()  # (index: the open invoke's call, if any; consumed: of the whole block)
        self.invokes = 0

    def _advance(self, body: str) -> None:
        while True:
            if self.index is None:
                m = self.INVOKE.match(body, self.consumed)
                if m is None:
                    return
                self.index, self.params, self.consumed = self._start(m.group(1).strip()), 0, m.end()
                self.invokes += 1
            m = self.PAIR.match(body, self.consumed)
            if m is not None:
                key = json.dumps(m.group(1).strip(), ensure_ascii=False)
                value = json.dumps(_xml_value(m.group(2)), ensure_ascii=False)
                self.events.append(CallArgs(self.index, ("{" if self.params == 0 else ", ") + f"{key}: {value}"))
                self.params, self.consumed = self.params + 1, m.end()
                continue
            m = self.END.match(body, self.consumed)
            if m is None:
                return
            self._end_invoke()
            self.consumed = m.end()

    def _end_invoke(self) -> None:
        self.events.append(CallArgs(self.index, "}" if self.params else "{}"))
        self.index = None

    def _close_call(self, body: str, final: bool) -> None:
        self._advance(body)
        if self.index is not None:  # an invoke cut short (or not closed before the block's end)
            self._end_invoke()
        if not self.invokes:
            self.events.append(Content(self.OPEN + body + ("" if final else self.CLOSE)))
        self._reset_call()


# ---- glm-4.5 ----------------------------------------------------------------------------------------------------
_GLM_NAME = re.compile(r"\s*([^\s<]+)(?=[\s<])")  # a name is complete once whitespace or a tag follows it
_GLM_ARG = re.compile(r"\s*<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.S)


class Glm45Parser(Qwen3CoderParser):
    """``<tool_call>NAME\n<arg_key>K</arg_key>\n<arg_value>V</arg_value>\n...</tool_call>``: the name once the
    text after it shows it complete (a newline, the first key or the end), then one fragment per key/value pair
    as it closes, as :class:`Qwen3CoderParser` streams its parameters."""

    NAME, PAIR = _GLM_NAME, _GLM_ARG

    def _close_call(self, body: str, final: bool) -> None:
        if self.index is None and body.strip() and "<" not in body.strip():
            self.index = self._start(body.strip())  # a call without arguments: the name alone
        super()._close_call(body, final)


# ---- deepseek ---------------------------------------------------------------------------------------------------
class DeepSeekParser(_Parser):
    """``<｜tool▁calls▁begin｜>``, then per call ``<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>ARGS<｜tool▁call▁end｜>``
    (V3.1) or ``<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\nARGS\\n```<｜tool▁call▁end｜>`` (V3)."""

    OPEN = "<｜tool▁calls▁begin｜>"
    CALL, SEP, END, CLOSE = "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>", "<｜tool▁calls▁end｜>"

    def _step_inside(self) -> bool:
        stripped = self.buf.lstrip()
        if stripped.startswith(self.CLOSE):  # the block of calls ends
            self.buf = stripped[len(self.CLOSE):]
            self.inside = False
            return True
        end = self.buf.find(self.END)
        if end < 0:
            return False
        self._close_call(self.buf[:end], final=False)
        self.buf = self.buf[end + len(self.END):]
        return True

    def _close_call(self, body: str, final: bool) -> None:
        body = body.strip()
        if body.startswith(self.CALL):
            body = body[len(self.CALL):]
        if self.SEP not in body:
            if body:
                self.events.append(Content(body))
            return
        name, args = self._name_and_args(*body.split(self.SEP, 1))
        index = self._start(name.strip())
        self.events.append(CallArgs(index, args.strip()))

    def _name_and_args(self, first: str, rest: str) -> tuple[str, str]:
        """A call's name and argument text from what comes before and after its separator."""
        if first.strip() == "function" and "\n" in rest:  # V3: the name, then a fenced JSON block
            name, rest = rest.split("\n", 1)
            rest = rest.strip()
            if rest.startswith("```json"):
                rest = rest[len("```json"):]
            if rest.endswith("```"):
                rest = rest[:-3]
            return name, rest
        return first, rest


class KimiK2Parser(DeepSeekParser):
    """Kimi-K2: ``<|tool_calls_section_begin|>``, then per call ``<|tool_call_begin|>functions.NAME:IDX
    <|tool_call_argument_begin|>ARGS<|tool_call_end|>``, then ``<|tool_calls_section_end|>``."""

    OPEN = "<|tool_calls_section_begin|>"
    CALL, SEP, END, CLOSE = ("<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>",
                             "<|tool_calls_section_end|>")

    def _name_and_args(self, first: str, rest: str) -> tuple[str, str]:
        name = first.strip().removeprefix("functions.")
        head, _, idx = name.rpartition(":")
        return (head if head and idx.isdigit() else name), rest


# ---- harmony (gpt-oss) ------------------------------------------------------------------------------------------
_RECIPIENT = re.compile(r"to=functions\.([^\s<]+)")
_CHANNEL = re.compile(r"<\|channel\|>\s*([A-Za-z_]+)")


class HarmonyParser(_Parser):
    """gpt-oss's harmony messages (the generation prompt has written the first ``<|start|>assistant``): each
    header is read whole; a body streams as content (channel ``final``, or none), as a call's argument fragments
    (recipient ``functions.NAME``) or not at all (``analysis``, other commentary)."""

    MESSAGE = "<|message|>"
    ENDS = ("<|end|>", "<|call|>", "<|return|>")
    START = "<|start|>assistant"

    def __init__(self):
        super().__init__()
        self.kind = None  # of the message whose body is being read: "content", a call index, or "hidden"

    def _scan(self, final: bool) -> None:
        while True:
            if not self.inside:
                at = self.buf.find(self.MESSAGE)
                if at < 0:
                    return  # the header is not complete yet (a header is never shown)
                header = self.buf[:at].replace(self.START, "")
                self.buf = self.buf[at + len(self.MESSAGE):]
                self.inside = True
                to, channel = _RECIPIENT.search(header), _CHANNEL.search(header)
                if to is not None:
                    self.kind = self._start(to.group(1))
                elif channel is None or channel.group(1) == "final":
                    self.kind = "content"
                else:
                    self.kind = "hidden"
                continue
            ends = [(i, m) for m in self.ENDS if (i := self.buf.find(m)) >= 0]
            if not ends:
                keep = 0 if final else max(_held(self.buf, m) for m in self.ENDS)
                self._emit(self.buf[:len(self.buf) - keep])
                self.buf = self.buf[len(self.buf) - keep:]
                return
            at, marker = min(ends)
            self._emit(self.buf[:at])
            self.buf = self.buf[at + len(marker):]
            self.inside = False

    def _emit(self, text: str) -> None:
        if not text:
            return
        if self.kind == "content":
            self.events.append(Content(text))
        elif isinstance(self.kind, int):
            self.events.append(CallArgs(self.kind, text))

    def finish(self) -> list:
        self._scan(final=True)
        self.buf = ""  # an unfinished header: nothing to show
        out, self.events = self.events, []
        return out


# ---- forcing a call: a grammar ----------------------------------------------------------------------------------
def forced_call_grammar(tools: list[dict], name: str | None = None, form: str = "hermes") -> str:
    """The grammar of one call in ``form`` (``tool_choice`` "required": of any of ``tools``; named: of that one),
    its arguments following the function's parameter schema. Forms: ``hermes`` (and ``injected``, which asks for
    it); ``deepseek`` (V3.1's ``NAME<｜tool▁sep｜>{...}`` or V3's ``function<｜tool▁sep｜>NAME`` + a ```json block: the
    model writes the one it was trained on); ``qwen3_coder`` and ``minimax`` (one invoke: a parameter per property
    in the schema's order, the required ones present; strings as text without ``</``, other types as JSON);
    ``harmony`` (a
    commentary message to ``functions.NAME`` with JSON arguments: the reasoning message it might write first is
    skipped). Others: ValueError."""
    from freetoken.engine.decoding.grammar import lark_grammar, lark_json

    fns = [t.get("function", t) for t in tools]
    chosen = [f for f in fns if name is None or f["name"] == name]
    if form in ("hermes", "injected"):
        def call_schema(fn: dict) -> dict:
            return {"type": "object", "properties": {"name": {"const": fn["name"]},
                                                     "arguments": fn.get("parameters") or {"type": "object"}},
                    "required": ["name", "arguments"], "additionalProperties": False}

        schema = call_schema(chosen[0]) if len(chosen) == 1 else {"anyOf": [call_schema(f) for f in chosen]}
        return lark_grammar(f'start: "<tool_call>\\n" call "\\n</tool_call>"\ncall: {lark_json(schema)}\n')
    if form == "deepseek":
        rules, names = [], []
        for i, fn in enumerate(chosen):
            args = lark_json(fn.get("parameters") or {"type": "object"})
            n = json.dumps(fn["name"])
            rules.append(f'args{i}: {args}\n'
                         f'v31_{i}: {n} "{DeepSeekParser.SEP}" args{i}\n'
                         f'v3_{i}: "function{DeepSeekParser.SEP}" {n} "\\n```json\\n" args{i} "\\n```"\n')
            names += [f"v31_{i}", f"v3_{i}"]
        return lark_grammar(f'start: "{DeepSeekParser.OPEN}{DeepSeekParser.CALL}" call '
                            f'"{DeepSeekParser.END}{DeepSeekParser.CLOSE}"\ncall: {" | ".join(names)}\n'
                            + "".join(rules))
    if form == "qwen3_coder":
        alternatives, rules = _tagged_calls(chosen, "p", lambda key: f"<parameter={key}>\n", "\n</parameter>\n",
                                            lambda name: name + ">")
        return lark_grammar(f'start: "<tool_call>\\n<function=" fn "</function>\\n</tool_call>"\n'
                            f'fn: {" | ".join(alternatives)}\n' + "".join(rules))
    if form == "kimi_k2":
        calls = [f'{json.dumps("functions." + fn["name"] + ":0")} "{KimiK2Parser.SEP}" '
                 f'{lark_json(fn.get("parameters") or {"type": "object"})}' for fn in chosen]
        return lark_grammar(f'start: "{KimiK2Parser.OPEN}{KimiK2Parser.CALL}" call '
                            f'"{KimiK2Parser.END}{KimiK2Parser.CLOSE}"\ncall: {" | ".join(calls)}\n')
    if form == "minimax":
        alternatives, rules = _tagged_calls(chosen, "m", lambda key: f'<parameter name="{key}">',
                                            "</parameter>\n", lambda name: f'"{name}">')
        return lark_grammar(f'start: "<minimax:tool_call>\\n<invoke name=" fn "</invoke>\\n</minimax:tool_call>"\n'
                            f'fn: {" | ".join(alternatives)}\n' + "".join(rules))
    if form == "glm45":
        alternatives, rules = _tagged_calls(chosen, "a", lambda key: f"<arg_key>{key}</arg_key>\n<arg_value>",
                                            "</arg_value>\n", lambda name: name)
        return lark_grammar(f'start: "<tool_call>" fn "</tool_call>"\nfn: {" | ".join(alternatives)}\n'
                            + "".join(rules))
    if form == "harmony":
        calls = [f'{json.dumps("to=functions." + fn["name"])} " <|constrain|>json<|message|>" '
                 f'{lark_json(fn.get("parameters") or {"type": "object"})}' for fn in chosen]
        return lark_grammar(f'start: "<|channel|>commentary " call\ncall: {" | ".join(calls)}\n')
    raise ValueError(f"forcing a call in the {form!r} tool-call form is not supported")


def _lark_regex_text(text: str) -> str:
    """``text`` matched literally inside a Lark ``/regex/``."""
    return re.escape(text).replace("\\\n", "\\n").replace("/", "\\/")


def _tagged_calls(chosen: list[dict], prefix: str, head, tail: str, name_text) -> tuple[list[str], list[str]]:
    """The Lark alternatives (one per function: ``name_text(name)``, a newline, then its parameters) and rules of
    the forms that write each argument as ``head(key)`` + value + ``tail`` (Qwen3-Coder's, GLM's): the schema's
    properties in order, the required ones present; a string value is its text (one lexeme, which cannot hold
    ``</``), any other JSON."""
    from freetoken.engine.decoding.grammar import lark_json

    alternatives, rules = [], []
    for i, fn in enumerate(chosen):
        params = fn.get("parameters") or {}
        props, required = params.get("properties") or {}, set(params.get("required") or ())
        parts = []
        for j, (key, prop) in enumerate(props.items()):
            rule = f"{prefix}{i}_{j}"
            if (prop or {}).get("type", "string") == "string":
                rules.append(f"{rule}: /{_lark_regex_text(head(key))}([^<]|<[^\\/])*{_lark_regex_text(tail)}/\n")
            else:
                rules.append(f"{rule}: {json.dumps(head(key))} {lark_json(prop)} {json.dumps(tail)}\n")
            parts.append(rule if key in required else rule + "?")
        alternatives.append(f'{json.dumps(name_text(fn["name"]))} "\\n" {" ".join(parts)}'.rstrip())
    return alternatives, rules


# ---- the injected form: tools for a template that knows none ----------------------------------------------------
def tools_system_prompt(tools: list[dict]) -> str:
    """A system message that lists ``tools`` (OpenAI function definitions) and asks for hermes-form calls."""
    lines = ["You can call functions. Their definitions, as JSON Schema, one per line:", "<tools>"]
    lines += [json.dumps(t.get("function", t), ensure_ascii=False) for t in tools]
    lines += ["</tools>", "To call a function, reply with its name and arguments as JSON inside tags:",
              '<tool_call>\n{"name": "FUNCTION", "arguments": {...}}\n</tool_call>']
    return "\n".join(lines)


def inject_history(messages: list[dict], tools: list[dict]) -> list[dict]:
    """``messages`` for a template without tool support: the tools' system prompt first (merged into a leading
    system message), earlier calls as hermes text in the assistant's content, tool results as user messages."""
    out = []
    prompt = tools_system_prompt(tools)
    if messages and messages[0]["role"] == "system":
        out.append({**messages[0], "content": messages[0]["content"] + "\n\n" + prompt})
        messages = messages[1:]
    else:
        out.append({"role": "system", "content": prompt})
    for m in messages:
        m = dict(m)
        calls = m.pop("tool_calls", None)
        if calls:
            text = "".join("<tool_call>\n" + json.dumps({"name": c["function"]["name"],
                                                         "arguments": c["function"]["arguments"]},
                                                        ensure_ascii=False) + "\n</tool_call>" for c in calls)
            m["content"] = (m.get("content") or "") + ("\n" if m.get("content") else "") + text
        if m["role"] == "tool":
            m = {"role": "user", "content": f"<tool_response>\n{m['content']}\n</tool_response>"}
        out.append(m)
    return out
