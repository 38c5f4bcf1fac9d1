"""Constrained decoding: a grammar that decides which tokens may come next (llguidance), applied as a mask on the
logits in the sampler. Sampling runs on the host for every device, so the mask applies on gpu, cpu and emu alike.

llguidance (a Rust core, no PyTorch, bitmasks as bytes) was chosen over xgrammar, whose package requires torch and
transformers, and outlines-core, which takes regexes and JSON schemas only and builds an index per vocabulary and
schema before the first token: llguidance takes JSON schemas, Lark grammars with embedded ``%json {...}`` (what a
forced tool call needs: fixed text around a schema) and regexes, builds a grammar lazily as tokens come, and on the
bundled model's 4096-token vocabulary computes a mask in about 0.1 ms.
"""

from __future__ import annotations

import json

import numpy as np

#: Compact JSON: no free whitespace between tokens (a sampled model otherwise pads its output with it).
JSON_OPTIONS = {"whitespace_flexible": False}


class GrammarError(ValueError):
    """A grammar or JSON schema llguidance refuses (the message says where)."""


def grammar_tokenizer(tokenizer, eos_ids, vocab_size: int):
    """The llguidance view of a ``tokenizers.Tokenizer`` (about 0.1 s: build it once per model)."""
    from llguidance import LLTokenizer

    if not hasattr(tokenizer, "to_str"):
        raise GrammarError("constrained output needs a tokenizers.Tokenizer")
    return LLTokenizer(tokenizer.to_str(), n_vocab=vocab_size, eos_token=sorted(int(i) for i in eos_ids) or None)


def json_schema_grammar(schema: dict) -> str:
    """The grammar of JSON text that follows ``schema``."""
    from llguidance import LLMatcher

    try:
        return LLMatcher.grammar_from_json_schema(schema, overrides=JSON_OPTIONS)
    except ValueError as e:
        raise GrammarError(f"the JSON schema: {e}") from None


def lark_grammar(text: str) -> str:
    from llguidance import LLMatcher

    return LLMatcher.grammar_from_lark(text)


def lark_literal(text: str) -> str:
    """``text`` as a Lark string literal."""
    return json.dumps(text)


def lark_json(schema: dict) -> str:
    """A Lark rule body matching compact JSON that follows ``schema``."""
    return "%json " + json.dumps({**schema, "x-guidance": {**JSON_OPTIONS, **schema.get("x-guidance", {})}})


class TokenConstraint:
    """One generation's grammar state: :meth:`allowed` masks the next token, :meth:`consume` advances."""

    def __init__(self, lltokenizer, grammar: str, vocab_size: int):
        from llguidance import LLMatcher

        self.vocab_size = vocab_size
        self.matcher = LLMatcher(lltokenizer, grammar, log_level=0)
        if self.matcher.is_error():
            raise GrammarError(self.matcher.get_error())

    def allowed(self) -> np.ndarray:
        """bool [vocab]: the tokens the grammar allows next (the end-of-sequence tokens once it may end)."""
        bits = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8)
        mask = np.unpackbits(bits, bitorder="little")[:self.vocab_size].astype(bool)
        if self.matcher.is_error():
            raise GrammarError(self.matcher.get_error())
        return mask

    def consume(self, token: int) -> None:
        if not self.matcher.consume_token(int(token)):
            raise GrammarError(f"token {token} is not allowed here: {self.matcher.get_error()}")

    @property
    def finished(self) -> bool:
        """No token can follow (the grammar's text is complete and only the end could come)."""
        return self.matcher.is_stopped()
