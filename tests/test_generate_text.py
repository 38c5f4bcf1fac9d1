"""Streaming text: pieces are held back while they end inside a multi-byte character."""

import numpy as np

from freetoken.engine.generation.generate import Model
from freetoken.engine.generation.sampling import SamplingParams


class ByteTokenizer:
    """Token i is byte i; decoding replaces incomplete UTF-8 with U+FFFD, like real BPE tokenizers."""

    class _Enc:
        def __init__(self, ids):
            self.ids = ids

    def encode(self, text):
        return self._Enc(list(text.encode()))

    def decode(self, ids):
        return bytes(ids).decode("utf-8", errors="replace")


class ScriptedDecoder:
    """Emits a fixed byte sequence whatever the input (a stand-in for MoeDecoder)."""

    def __init__(self, script: bytes, eos: int):
        self.script, self.eos, self.length, self.ctx, self.i = list(script), eos, 0, 1000, 0
        self.last_routing = []

    def reset(self):
        self.length, self.i = 0, 0

    def forward(self, ids, last_only=False):
        self.length += len(ids)
        tok = self.script[self.i] if self.i < len(self.script) else self.eos
        self.i += 1
        logits = np.full((len(ids), 256), -10.0, np.float32)
        logits[-1, tok] = 10.0
        return logits


def test_pieces_never_split_a_character():
    text = "héllo → wörld"
    model = Model(ScriptedDecoder(text.encode(), eos=0), ByteTokenizer(), eos_ids=[0])
    pieces = list(gen := model.generate_text("x", max_tokens=100, sampling=SamplingParams(temperature=0)))
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)
    assert gen.stats.generated_tokens == len(text.encode()) + 1  # the end-of-sequence token is counted


def test_max_tokens_stops():
    model = Model(ScriptedDecoder(b"abcdef", eos=0), ByteTokenizer(), eos_ids=[0])
    assert "".join(model.generate_text("x", max_tokens=3, sampling=SamplingParams(temperature=0))) == "abc"


class ByteVocabTokenizer(ByteTokenizer):
    """Also knows its vocabulary: a one-byte string is a token, so a one-byte stop string stops at its id."""

    def token_to_id(self, s):
        return s.encode()[0] if len(s.encode()) == 1 else None


def test_the_stop_string_that_ended_the_text_is_reported():
    greedy = SamplingParams(temperature=0)
    model = Model(ScriptedDecoder(b"abcdef", eos=0), ByteTokenizer(), eos_ids=[0])
    assert "".join(gen := model.generate_text("x", max_tokens=10, sampling=greedy, stop=["zz", "de"])) == "abc"
    assert gen.stats.finish_reason == "stop" and gen.stats.stop_sequence == "de"
    assert "".join(gen := model.generate_text("x", max_tokens=10, sampling=greedy)) == "abcdef"
    assert gen.stats.finish_reason == "stop" and gen.stats.stop_sequence is None  # the end-of-sequence token
    model = Model(ScriptedDecoder(b"abcdef", eos=0), ByteVocabTokenizer(), eos_ids=[0])
    assert "".join(gen := model.generate_text("x", max_tokens=10, sampling=greedy, stop=["zz", "d"])) == "abc"
    assert gen.stats.finish_reason == "stop" and gen.stats.stop_sequence == "d"
