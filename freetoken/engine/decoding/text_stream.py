"""Token ids in, text out: one generation's text as it may be shown while tokens come, with stop strings.

A piece is held back while the text ends in an incomplete character (a byte-level token that starts a multi-byte
one), and while its end could be the start of a stop string. A stop string that is a single token of the vocabulary
stops at that token; any of them stops where it shows up in the decoded text (not included). Used by
``Model.generate_text`` (one sequence) and by each request of the step loop.
"""

from __future__ import annotations

from collections.abc import Sequence


class TextStream:
    """The text of one generation on ``model`` (its ``decode``, ``eos_ids`` and tokenizer), ending at an
    end-of-sequence token or one of ``stop``. Feed tokens to :meth:`push` until :attr:`done`, then :meth:`flush`."""

    def __init__(self, model, stop: Sequence[str] = ()):
        self.model = model
        self.stop = [s for s in stop if s]
        to_id = getattr(model.tokenizer, "token_to_id", None)
        self.stop_tokens: dict[int, str] = {}  # single-token stop strings, by id (the first string of an id wins)
        for s in self.stop:
            tid = to_id(s) if to_id is not None else None
            if tid is not None:
                self.stop_tokens.setdefault(int(tid), s)
        self.tokens: list[int] = []  # the tokens of the text (a stop token not among them)
        self.shown = ""
        self.done = False
        #: "stop" once a stop string or an end-of-sequence token ended the text (None otherwise)
        self.finish_reason: str | None = None
        #: the stop string that ended the text (None: none did, or an end-of-sequence token did)
        self.stop_sequence: str | None = None

    def push(self, token: int) -> str:
        """Take the next token; the text that may be shown now beyond what was ("" for none). After a stop, does
        nothing (:attr:`done`)."""
        if self.done:
            return ""
        if token in self.model.eos_ids or token in self.stop_tokens:
            self.done, self.finish_reason = True, "stop"
            self.stop_sequence = None if token in self.model.eos_ids else self.stop_tokens[token]
            return ""
        self.tokens.append(token)
        text = self.model.decode(self.tokens)
        if text.endswith("\ufffd"):
            return ""
        text, matched = cut_at_stop(text, self.stop)
        if matched is not None:
            self.done, self.finish_reason, self.stop_sequence = True, "stop", matched
        return self._show(text)

    def flush(self) -> str:
        """The text held back so far, once no token is coming (a stop string found only now ends it there; after
        one found earlier this adds nothing)."""
        self.done = True
        if not self.tokens:
            return ""
        text, matched = cut_at_stop(self.model.decode(self.tokens), self.stop, final=True)
        if matched is not None:  # (found only now: the text before ended inside a character)
            self.finish_reason, self.stop_sequence = "stop", matched
        return self._show(text)

    def _show(self, text: str) -> str:
        if len(text) <= len(self.shown):
            return ""
        piece, self.shown = text[len(self.shown):], text
        return piece


def cut_at_stop(text: str, stop: Sequence[str], final: bool = False) -> tuple[str, str | None]:
    """(the text that may be shown, the stop string found or None): the text before the first stop string (of two
    at one place, the one listed first), or (unless ``final``) the text without a tail that a stop string could
    start with."""
    if not stop:
        return text, None
    found = [(i, n, s) for n, s in enumerate(stop) if (i := text.find(s)) >= 0]
    if found:
        cut, _, matched = min(found)
        return text[:cut], matched
    if final:
        return text, None
    hold = 0
    for s in stop:
        for n in range(min(len(s) - 1, len(text)), hold, -1):
            if text.endswith(s[:n]):
                hold = n
                break
    return text[:len(text) - hold], None
