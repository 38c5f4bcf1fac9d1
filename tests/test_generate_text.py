"""Streaming text: pieces are held back while they end inside a multi-byte character."""

from scripted_decoder import ScriptedDecoder

from freetoken.engine.decoding.sampling import SamplingParams
from freetoken.engine.generation.generate import Model


class ByteTokenizer:
    """Token i is byte i; decoding replaces incomplete UTF-8 with U+FFFD, like real BPE tokenizers."""

    class _Enc:
        def __init__(self, ids):
            self.ids = ids

    def encode(self, text):
        return self._Enc(list(text.encode()))

    def decode(self, ids):
        return bytes(ids).decode("utf-8", errors="replace")


def test_pieces_never_split_a_character():
    text = "héllo → wörld"
    model = Model(ScriptedDecoder(text.encode(), eos=0, replay=True), ByteTokenizer(), eos_ids=[0])
    pieces = list(gen := model.generate_text("x", max_tokens=100, sampling=SamplingParams(temperature=0)))
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)
    assert gen.stats.generated_tokens == len(text.encode()) + 1  # the end-of-sequence token is counted


def test_max_tokens_stops():
    model = Model(ScriptedDecoder(b"abcdef", eos=0, replay=True), ByteTokenizer(), eos_ids=[0])
    assert "".join(model.generate_text("x", max_tokens=3, sampling=SamplingParams(temperature=0))) == "abc"


class ByteVocabTokenizer(ByteTokenizer):
    """Also knows its vocabulary: a one-byte string is a token, so a one-byte stop string stops at its id."""

    def token_to_id(self, s):
        return s.encode()[0] if len(s.encode()) == 1 else None


def test_the_stop_string_that_ended_the_text_is_reported():
    greedy = SamplingParams(temperature=0)
    model = Model(ScriptedDecoder(b"abcdef", eos=0, replay=True), ByteTokenizer(), eos_ids=[0])
    assert "".join(gen := model.generate_text("x", max_tokens=10, sampling=greedy, stop=["zz", "de"])) == "abc"
    assert gen.stats.finish_reason == "stop" and gen.stats.stop_sequence == "de"
    assert "".join(gen := model.generate_text("x", max_tokens=10, sampling=greedy)) == "abcdef"
    assert gen.stats.finish_reason == "stop" and gen.stats.stop_sequence is None  # the end-of-sequence token
    model = Model(ScriptedDecoder(b"abcdef", eos=0, replay=True), ByteVocabTokenizer(), eos_ids=[0])
    assert "".join(gen := model.generate_text("x", max_tokens=10, sampling=greedy, stop=["zz", "d"])) == "abc"
    assert gen.stats.finish_reason == "stop" and gen.stats.stop_sequence == "d"


def test_a_generation_left_open_is_ended_by_the_next():
    greedy = SamplingParams(temperature=0)
    model = Model(ScriptedDecoder(b"abcdef", eos=0, replay=True), ByteTokenizer(), eos_ids=[0])
    first = model.generate("x", max_tokens=10, sampling=greedy)
    assert next(first) == ord("a")
    assert list(model.generate("y", max_tokens=3, sampling=greedy)) == list(b"abc")
    assert list(first) == [] and first.stats.finish_reason is None  # ended, not finished
    assert model.cached_ids == list(b"yab") and model.decoder.length == 3  # the second call's, untouched by the first
