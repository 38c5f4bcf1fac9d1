"""Chat: a conversation rendered with the model's chat template, the KV cache reused from turn to turn.

:class:`ChatTemplate` renders a list of ``{"role", "content"}`` messages the way HF ``transformers``'
``apply_chat_template`` does (a sandboxed Jinja2 environment with ``trim_blocks``/``lstrip_blocks``, the
``raise_exception`` and ``strftime_now`` helpers, ``bos_token``/``eos_token``...). The template of a model directory
comes from ``chat_template.jinja`` or else from ``tokenizer_config.json``'s ``"chat_template"`` (a string, or a list
of ``{"name", "template"}`` of which the one named ``"default"`` is used), as ``transformers`` loads it. A model
without one falls back to ChatML (:data:`CHATML_TEMPLATE`: ``<|im_start|>role\\n...<|im_end|>\\n``).

:class:`Chat` holds the messages; each :meth:`Chat.send` renders the whole conversation and generates with
``reuse_cache=True``, so only what the previous turn did not already run (the new user message, and the template's
wrapping of the previous reply) is prefilled.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Iterator, Sequence
from datetime import datetime
from pathlib import Path

import numpy as np

from freetoken.engine.decoding.sampling import SamplingParams
from freetoken.engine.decoding.stats import Generation, GenerationStats

# Used when a model has no chat template (documented in the module docstring; the CLI warns).
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# End-of-turn markers of common template families; those a template mentions become stop strings.
END_OF_TURN_MARKERS = (
    "<|im_end|>",  # ChatML: Qwen, SmolLM, OLMoE-instruct, ...
    "<|eot_id|>",  # Llama 3
    "<|eom_id|>",  # Llama 3.1 tool calls
    "<end_of_turn>",  # Gemma
    "<|end|>",  # Phi-3
    "<|END_OF_TURN_TOKEN|>",  # Command-R
    "<|endofturn|>",
    "<|end_of_turn|>",
    "<｜end▁of▁sentence｜>",  # DeepSeek
)

#: Tokens at the end of a message that may merge with the next message's start (see :func:`message_boundaries`).
BOUNDARY_SLACK = 4

_SPECIAL_TOKEN_RE = re.compile(r"<[^<>\s]{1,48}>|\[[A-Z_/]{1,32}\]")


def _token_text(value) -> str | None:
    """A special token entry of tokenizer_config.json (a string or an AddedToken dict) -> its text."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _pick_template(value) -> str | None:
    """``chat_template`` of tokenizer_config.json: a string, or a list of ``{name, template}`` ("default" wins)."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict):  # {name: template}
        value = [{"name": k, "template": v} for k, v in value.items()]
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        chosen = named.get("default")
        if chosen is None and value and isinstance(value[0], dict):
            chosen = value[0].get("template")  # no "default": the first one
        return chosen if isinstance(chosen, str) else None
    return None


class ChatTemplate:
    """A Jinja2 chat template, compiled on first use; ``special_tokens``: ``bos_token``, ``eos_token``... values."""

    def __init__(self, source: str, special_tokens: dict[str, str] | None = None, name: str = "chat template"):
        if not isinstance(source, str) or not source:
            raise ValueError("a chat template must be a non-empty string")
        self.source = source
        self.special_tokens = {k: v for k, v in (special_tokens or {}).items() if isinstance(v, str)}
        self.name = name
        self._compiled = None

    def __repr__(self) -> str:
        return f"ChatTemplate({self.name!r}, {len(self.source)} chars)"

    @classmethod
    def chatml(cls, special_tokens: dict[str, str] | None = None) -> ChatTemplate:
        return cls(CHATML_TEMPLATE, special_tokens, name="ChatML fallback")

    @classmethod
    def from_dir(cls, path: str | Path) -> ChatTemplate | None:
        """The template of a model directory (``chat_template.jinja``, else tokenizer_config.json), or None."""
        p = Path(path)
        config: dict = {}
        tc = p / "tokenizer_config.json"
        if tc.is_file():
            try:
                config = json.loads(tc.read_text(encoding="utf-8"))
            except (OSError, ValueError):
                config = {}
        special = {k: _token_text(config.get(k)) for k in ("bos_token", "eos_token", "unk_token", "pad_token")}
        if (p / "chat_template.jinja").is_file():
            return cls((p / "chat_template.jinja").read_text(encoding="utf-8"), special, name="chat_template.jinja")
        source = _pick_template(config.get("chat_template"))
        if source is None and (p / "chat_template.json").is_file():  # the processor format
            try:
                source = _pick_template(json.loads((p / "chat_template.json").read_text()).get("chat_template"))
            except (OSError, ValueError, AttributeError):
                source = None
        return cls(source, special, name="tokenizer_config.json") if source else None

    # ---- rendering --------------------------------------------------------------------------------------------
    def _template(self):
        if self._compiled is None:
            self._compiled = _environment().from_string(self.source)
        return self._compiled

    def render(self, messages: Sequence[dict], add_generation_prompt: bool = True, **kwargs) -> str:
        """The conversation as the model's prompt text. Template errors become ValueError."""
        import jinja2

        # bos/eos text the model does not name renders empty (transformers would leave them undefined and fail)
        context = {"bos_token": "", "eos_token": "", **self.special_tokens, "tools": None, "documents": None,
                   **kwargs}
        msgs = [dict(m) for m in messages]
        try:
            return self._template().render(messages=msgs, add_generation_prompt=add_generation_prompt, **context)
        except jinja2.TemplateError as e:
            raise ValueError(f"{self.name}: {e}") from e

    def stop_strings(self) -> list[str]:
        """Text that ends an assistant turn: the known end-of-turn markers the template mentions, and what the
        template writes right after an assistant message when it looks like a special token (``</s>``...)."""
        if "<|channel|>" in self.source and "<|return|>" in self.source:
            # harmony (gpt-oss): <|end|> closes one message of a turn (the reasoning, say); the turn ends at a
            # tool call or at the final answer's return
            return ["<|return|>", "<|call|>"]
        stops = [m for m in END_OF_TURN_MARKERS if m in self.source]
        marker = "\x00reply\x00"
        try:
            text = self.render([{"role": "user", "content": "hi"}, {"role": "assistant", "content": marker}],
                               add_generation_prompt=False)
        except ValueError:  # a template that refuses the probe just gives no extra stop string
            text = ""
        if marker in text:
            after = text[text.index(marker) + len(marker):].strip()
            m = _SPECIAL_TOKEN_RE.match(after)
            if m and m.group(0) not in stops:
                stops.append(m.group(0))
        return stops


def _environment():
    """The sandboxed environment ``transformers`` renders chat templates in."""
    import jinja2
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationTag(Extension):
        """``{% generation %}...{% endgeneration %}`` (marks assistant text for training masks): rendered as is."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt):
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationTag, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env


class Chat:
    """A conversation with ``model``: :meth:`send` streams the reply to one user message.

    ``template``: a :class:`ChatTemplate` or template text; default the model's ``chat_template`` (either kind),
    else ChatML (``uses_fallback``).
    ``system``: an optional system prompt, kept across :meth:`reset`."""

    def __init__(self, model, system: str | None = None, template: ChatTemplate | str | None = None):
        if model.tokenizer is None:
            raise ValueError("chatting needs a model with a tokenizer")
        self.model = model
        if template is None:
            template = model.chat_template
        if isinstance(template, str):  # template text (a GGUF file's tokenizer.chat_template, say)
            template = ChatTemplate(template, getattr(model.chat_template, "special_tokens", None)
                                    or _special_tokens(model)) if template else None
        self.uses_fallback = template is None
        self.template = template or ChatTemplate.chatml(_special_tokens(model))
        self.system = system
        self.stop = self.template.stop_strings()
        self.messages: list[dict] = []
        self._turns = 0
        self._anchored: dict[str, list[dict]] = {}  # anchor id -> the messages it was made at
        self.reset()
        self.template.render([*self.messages, {"role": "user", "content": "hi"}])  # template errors show up now

    def reset(self) -> None:
        """Forget the conversation (the system prompt stays). The KV cache is left as is: the next turn reuses
        whatever prefix it shares with the new conversation (the system prompt, typically)."""
        self.messages = [{"role": "system", "content": self.system}] if self.system else []

    def prompt(self) -> str:
        """The conversation so far, rendered with the generation prompt."""
        return self.template.render(self.messages, add_generation_prompt=True)

    def _encode(self, text: str) -> list[int]:
        return self.model.encode(text, add_special_tokens=False)

    def anchor(self, label: str | None = None):
        """An anchor of the conversation as it stands (its K/V rows held, see :mod:`freetoken.engine.reuse.anchors`), to
        :meth:`rollback` to. Made from the tokens the model holds of it: the conversation so far, rendered."""
        if not self.messages:
            raise ValueError("nothing to anchor: the conversation is empty")
        ids = self._encode(self.template.render(self.messages, add_generation_prompt=False))
        held = self.model.cached_ids[:self.model.decoder.length]
        n = 0
        while n < min(len(ids), len(held)) and ids[n] == held[n]:
            n += 1
        if getattr(self.model.decoder, "recurrent", False):  # the longest start whose linear states were kept
            n = max((p for p in self.model.decoder.resume_points() if p <= n), default=0)
        if n == 0:
            raise ValueError("the model holds none of this conversation yet: send a message first")
        a = self.model.anchor(n, label=label)
        self._anchored[a.id] = [dict(m) for m in self.messages]
        return a

    def rollback(self, anchor) -> None:
        """Return to the conversation as it was at ``anchor`` (one of this chat's :meth:`anchor` results, or its
        id): its messages, and its K/V rows restored after verification (ValueError when refused)."""
        aid = anchor if isinstance(anchor, str) else anchor.id
        if aid not in self._anchored:
            raise ValueError(f"anchor {aid[:16]} was not made by this chat")
        self.model.rollback(aid)
        self.messages = [dict(m) for m in self._anchored[aid]]

    def send(self, text: str, max_tokens: int = 256, sampling: SamplingParams | None = None) -> Generation:
        """Add the user message ``text``; the reply as a :class:`freetoken.engine.generation.generate.Generation` of
        text pieces (its ``stats``: the turn's), added to the conversation as it ends.

        Stops at an end-of-sequence token, at the template's end-of-turn marker or after ``max_tokens``. A reply
        cut short (the iterator closed early) is kept as far as it went; an error before any reply text (a
        conversation longer than the context, an interrupt) takes the user message back out. With a seed, turn i samples
        with ``seed + i`` so that turns do not repeat one random sequence."""
        stats = GenerationStats()
        return Generation(self._turn(text, max_tokens, sampling, stats), stats)

    def _turn(self, text: str, max_tokens: int, sampling: SamplingParams | None, stats) -> Iterator[str]:
        """:meth:`send`'s work, the turn's stats kept in ``stats``."""
        self.messages.append({"role": "user", "content": text})
        pieces: list[str] = []
        try:
            text = self.prompt()
            ids = self.model.encode(text, add_special_tokens=False)
            if sampling is not None and sampling.seed is not None:
                sampling = dataclasses.replace(sampling, seed=sampling.seed + self._turns)
            self._turns += 1
            ctx = self.model.decoder.ctx
            if len(ids) >= ctx:
                raise ValueError(f"the conversation is {len(ids)} tokens and the context holds {ctx}: "
                                 "reset it to go on")
            bounds = message_boundaries(self.template, self.messages, self._encode, ids, full_text=text,
                                        offsets=self.model.token_offsets(text, ids))
            for piece in self.model.generate_text(ids, max_tokens, sampling, reuse_cache=True, stop=self.stop,
                                                  boundaries=bounds, stats=stats):
                pieces.append(piece)
                yield piece
        except GeneratorExit:  # closed early: keep the reply as far as it went
            self.messages.append({"role": "assistant", "content": "".join(pieces)})
            raise
        except BaseException:  # an error or an interrupt: keep a partial reply, or take the user message back
            if pieces:
                self.messages.append({"role": "assistant", "content": "".join(pieces)})
            else:
                self.messages.pop()
            raise
        else:
            self.messages.append({"role": "assistant", "content": "".join(pieces)})


def message_boundaries(template: ChatTemplate, messages: Sequence[dict], encode, ids: Sequence[int], *,
                       full_text: str | None = None, offsets: Sequence[tuple[int, int]] | None = None,
                       **render_kwargs) -> list[int]:
    """Token positions in ``ids`` (the rendered prompt of ``messages``) where a message ends: after the system
    prompt, after each message, and the whole prompt (before the assistant turn). A template that renders an
    earlier turn otherwise once more follows leaves that boundary out.

    With ``full_text`` (what ``ids`` encode) and ``offsets`` (each token's ``(start, end)`` characters in it, as
    :meth:`freetoken.engine.generation.generate.Model.token_offsets` gives them), each leading part of the conversation
    is rendered and found at the start of ``full_text``, and its boundary is the number of tokens that end within
    it: one encoding of the prompt in all. Otherwise ``encode(text)`` gives each leading part's token ids (no
    special-token post-processing: a pass over the whole prefix each, quadratic in a long conversation), which must
    be a prefix of ``ids`` up to its last :data:`BOUNDARY_SLACK` tokens (text at the end of a message can merge
    into other tokens with what follows, ``"\n\n"`` before ``def``, say): the boundary is where the two part."""
    ends = None
    if full_text is not None and offsets is not None and len(offsets) == len(ids):
        ends = np.maximum.accumulate(np.asarray([e for _, e in offsets], np.int64)) if len(ids) else None
    out = []
    for i in range(1, len(messages)):
        try:
            head_text = template.render(messages[:i], add_generation_prompt=False, **render_kwargs)
        except ValueError:  # a template that refuses a partial conversation (one must end with a user turn, say)
            continue
        if ends is not None:
            if full_text.startswith(head_text):
                n = int(np.searchsorted(ends, len(head_text), side="right"))
                if 0 < n < len(ids):
                    out.append(n)
            continue
        head = encode(head_text)
        n, limit = 0, min(len(head), len(ids) - 1)
        while n < limit and ids[n] == head[n]:
            n += 1
        if n > 0 and n >= len(head) - BOUNDARY_SLACK:
            out.append(n)
    if ids:
        out.append(len(ids))
    return sorted(set(out))


def model_template(model) -> ChatTemplate:
    """The model's chat template, or the ChatML fallback (:data:`CHATML_TEMPLATE`) when it has none."""
    return model.chat_template or ChatTemplate.chatml(_special_tokens(model))


def _special_tokens(model) -> dict[str, str]:
    """bos/eos token text for the fallback template, from the model's end-of-sequence ids."""
    tok = model.tokenizer
    eos = sorted(model.eos_ids)
    if not eos or not hasattr(tok, "id_to_token"):
        return {}
    text = tok.id_to_token(eos[0])
    return {"eos_token": text} if isinstance(text, str) else {}
