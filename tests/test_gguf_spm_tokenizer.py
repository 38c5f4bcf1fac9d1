"""SentencePiece-style ("llama") GGUF vocabularies: a SentencePiece BPE model trained here, written into a GGUF
(pieces, scores, types), read back and rebuilt by :func:`tokenizer_from_gguf`, against the sentencepiece library."""

import heapq
import io
import os
import random
import re
import time
from pathlib import Path

import numpy as np
import pytest
import sentencepiece as spm
from gguf import GGUFWriter
from tiny_models import finish_gguf

from freetoken.loaders import GGUFFile, LoadError, tokenizer_from_gguf
from freetoken.loaders.gguf_tokenizer import spm_merges

USER_SYMBOLS = ["<tool>", "</tool>"]  # SentencePiece user-defined symbols: GGUF type 4
CONTROL_SYMBOLS = ["<ctl>"]  # plus <s> / </s>: GGUF type 3
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

# Lines the stdlib does not have: unicode (accents, CJK, RTL), emoji and other characters outside the vocabulary
# (byte fallback), spaces leading / trailing / in runs, tabs, newlines, the empty string.
EDGE_LINES = [
    "",
    " ",
    "   ",
    "\t",
    "\n",
    "\n\n\n",
    "  leading two",
    "trailing two  ",
    "    four leading, four trailing    ",
    "a  b   c    d     e",
    "\tindented\t\ttabs\t",
    "line one\nline two\n\n  indented line three\n",
    "x = 1\r\ny = 2\r\n",
    "caf\u00e9 na\u00efve \u00c5ngstr\u00f6m \u212b",
    "\u65e5\u672c\u8a9e\u306e\u30c6\u30ad\u30b9\u30c8 \ud55c\uad6d\uc5b4 \u4e2d\u6587abc",
    "emoji \U0001f916\U0001f468\u200d\U0001f469\u200d\U0001f467 \u2764\ufe0f done",
    "\U0001f600",
    " \U0001f600 ",
    "non\u00a0breaking\u2003em\u3000ideographic",
    "\u0645\u0631\u062d\u0628\u0627 \u05e9\u05dc\u05d5\u05dd \u043f\u0440\u0438\u0432\u0435\u0442",
    "12345678 1,234.5 3.14159e-10 0x7fff",
    "$$$!!!??? ... --- === *** ~~~",
    "<0x41> <0xZZ> written out as text",
]
# Lines with user-defined and control tokens (compared with llama.cpp's procedure, see _llama_cpp_ids).
ADDED_LINES = [
    "<tool>call(x)</tool>",
    "before <tool>f(a, b)</tool> after",
    "a<tool>b</tool>c",
    "  <tool>  spaced  </tool>  ",
    "<tool></tool><tool>",
    "x<ctl>y",
    "<ctl> start and end <ctl>",
    "mixed <ctl><tool>z</tool>\n<ctl>",
    "<s>[INST] hi [/INST] ok</s> <unk>",
]


def _stdlib_files() -> list[str]:
    out = []
    for p in sorted(Path(os.__file__).parent.glob("*.py")):
        try:
            out.append(p.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, OSError):
            continue
    return out


def _train(texts: list[str], vocab_size: int = 2000, **extra) -> spm.SentencePieceProcessor:
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter("\n".join(texts).splitlines()), model_writer=buf, model_type="bpe",
        vocab_size=vocab_size, byte_fallback=True, character_coverage=0.9995,
        # No normalization besides the whitespace escape, so the comparison is about the algorithm.
        normalization_rule_name="identity", remove_extra_whitespaces=False,
        allow_whitespace_only_pieces=True, split_digits=True,  # as Llama 2's tokenizer.model
        user_defined_symbols=USER_SYMBOLS, control_symbols=CONTROL_SYMBOLS,
        max_sentence_length=100_000, num_threads=4, minloglevel=2, **extra)
    return spm.SentencePieceProcessor(model_proto=buf.getvalue())


def _pieces(sp) -> tuple[list[str], list[float], list[int]]:
    pieces = [sp.id_to_piece(i) for i in range(sp.get_piece_size())]
    scores = [sp.get_score(i) for i in range(len(pieces))]

    def kind(i):
        if sp.is_unknown(i):
            return UNKNOWN
        if sp.is_control(i):
            return CONTROL
        if sp.is_byte(i):
            return BYTE
        if sp.is_unused(i):
            return UNUSED
        return USER_DEFINED if pieces[i] in USER_SYMBOLS else NORMAL

    return pieces, scores, [kind(i) for i in range(len(pieces))]


def _write_gguf(path: Path, sp, *, scores: bool = True, add_bos: bool | None = True, add_eos: bool | None = None,
                add_space_prefix: bool | None = None) -> Path:
    pieces, sc, types = _pieces(sp)
    w = GGUFWriter(str(path), "llama")
    w.add_name("spm")
    w.add_tokenizer_model("llama")
    w.add_token_list(pieces)
    if scores:
        w.add_token_scores(sc)
    w.add_token_types(types)
    w.add_bos_token_id(sp.bos_id())
    w.add_eos_token_id(sp.eos_id())
    w.add_unk_token_id(sp.unk_id())
    if add_bos is not None:
        w.add_add_bos_token(add_bos)
    if add_eos is not None:
        w.add_add_eos_token(add_eos)
    if add_space_prefix is not None:
        w.add_add_space_prefix(add_space_prefix)
    return finish_gguf(w, path)


def _load(path: Path):
    g = GGUFFile(path)
    meta = g.tokenizer_meta()
    # tokenizer_meta() does not return tokenizer.ggml.add_space_prefix; tokenizer_from_gguf reads it from the dict.
    if g.has_meta("tokenizer.ggml.add_space_prefix"):
        meta["add_space_prefix"] = bool(g.meta("tokenizer.ggml.add_space_prefix"))
    return tokenizer_from_gguf(meta, g.path), meta


@pytest.fixture(scope="module")
def corpus():
    files = _stdlib_files()
    train, total, k = [], 0, 0
    while total < 200_000:  # ~200 KB of training text, the last file cut short
        train.append(files[k][: 200_000 - total])
        total += len(train[-1])
        k += 1
    held = files[k:]
    # A few hundred held-out lines: every 7th line of the next files (code, comments, blank and indented lines).
    lines = [ln for f in held[:12] for ln in f.splitlines()[::7]][:400]
    return train, held, lines


@pytest.fixture(scope="module")
def spm_gguf(corpus, tmp_path_factory):
    train, _, _ = corpus
    sp = _train(train)
    assert sp.get_piece_size() == 2000
    path = _write_gguf(tmp_path_factory.mktemp("spm") / "spm.gguf", sp)
    tok, meta = _load(path)
    return sp, tok, meta


def test_gguf_fields(spm_gguf):
    sp, tok, meta = spm_gguf
    pieces, scores, types = _pieces(sp)
    assert meta["model"] == "llama" and meta["merges"] is None
    assert meta["tokens"] == pieces
    assert meta["token_types"].tolist() == types
    np.testing.assert_array_equal(meta["scores"], np.asarray(scores, np.float32))
    assert (meta["bos_token_id"], meta["eos_token_id"], meta["unknown_token_id"]) == (1, 2, 0)
    assert meta["add_bos_token"] is True
    assert types.count(BYTE) == 256 and types.count(USER_DEFINED) == 2 and types.count(CONTROL) == 3
    assert tok.get_vocab_size() == 2000
    assert all(tok.token_to_id(p) == i for i, p in enumerate(pieces))


def _compare(sp, tok, texts: list[str]) -> int:
    """Encodings equal SentencePiece's (BOS in front by default, bare without special tokens); returns the number
    of tokens compared."""
    want = sp.encode(texts)
    bare = [e.ids for e in tok.encode_batch(texts, add_special_tokens=False)]
    full = [e.ids for e in tok.encode_batch(texts)]
    n = 0
    for t, w, b, f in zip(texts, want, bare, full, strict=True):
        assert b == w, f"encode differs on {t[:80]!r}: {[sp.id_to_piece(i) for i in b][:40]} vs " \
                       f"{[sp.id_to_piece(i) for i in w][:40]}"
        assert f == [sp.bos_id(), *w]
        n += len(w)
    return n


def test_lines_match_sentencepiece(spm_gguf, corpus):
    sp, tok, _ = spm_gguf
    _, _, lines = corpus
    assert len(lines) == 400
    n = _compare(sp, tok, lines + EDGE_LINES)
    assert n > 3000
    # the emoji and the CJK are not in a vocabulary trained on Python source: byte fallback
    emoji = tok.encode("\U0001f600", add_special_tokens=False).tokens
    assert emoji == ["\u2581", "<0xF0>", "<0x9F>", "<0x98>", "<0x80>"]
    assert tok.encode("").ids == [sp.bos_id()] and tok.encode("", add_special_tokens=False).ids == []


def test_documents_match_sentencepiece(spm_gguf, corpus):
    sp, tok, _ = spm_gguf
    _, held, _ = corpus
    docs = held[12:20]
    assert sum(map(len, docs)) > 50_000
    _compare(sp, tok, docs + ["\n".join(EDGE_LINES)])


def test_decode_round_trip(spm_gguf, corpus):
    sp, tok, _ = spm_gguf
    _, held, lines = corpus
    texts = lines + EDGE_LINES + held[12:14]
    ids = [e.ids for e in tok.encode_batch(texts)]
    assert tok.decode_batch(ids) == texts  # BOS skipped, the prefix space stripped again
    assert tok.decode_batch(ids) == [sp.decode(i) for i in ids]
    # with the special tokens: BOS written out, no space to strip in front of it
    assert tok.decode(tok.encode("hi there").ids, skip_special_tokens=False) == "<s> hi there"


def _llama_cpp_ids(sp, text: str, bos: bool = True) -> list[int]:
    """What llama.cpp's SPM tokenize does: cut control / user-defined tokens out of the raw text, then encode each
    run of text between them on its own, each with the dummy prefix (SentencePiece's ``encode`` of that run)."""
    ids = [sp.bos_id()] if bos else []
    names = USER_SYMBOLS + CONTROL_SYMBOLS + ["<s>", "</s>", "<unk>"]
    for part in re.split("(" + "|".join(map(re.escape, names)) + ")", text):
        if part in names:
            ids.append(sp.piece_to_id(part))
        elif part:
            ids.extend(sp.encode(part))
    return ids


def test_added_tokens(spm_gguf):
    sp, tok, _ = spm_gguf
    for text in ADDED_LINES:
        got = tok.encode(text).ids
        assert got == _llama_cpp_ids(sp, text), text
        assert tok.encode(text, add_special_tokens=False).ids == _llama_cpp_ids(sp, text, bos=False)
        # decoding skips <s> / <ctl> as SentencePiece's decode does (which writes <unk> as " \u2047 ", where
        # this, as llama.cpp, skips it)
        assert tok.decode(got) == sp.decode(got).replace(" \u2047 ", ""), text
    # SentencePiece itself matches user-defined symbols inside the one string it encodes, so only the start of the
    # line has a "▁" prefix; llama.cpp (and this) prefix every run of text after an added token.
    assert tok.encode("a<tool>b", add_special_tokens=False).tokens == ["\u2581a", "<tool>", "\u2581b"]
    assert [sp.id_to_piece(i) for i in sp.encode("a<tool>b")] == ["\u2581a", "<tool>", "b"]
    # where no text follows an added token, the two agree
    assert tok.encode("a b<tool>", add_special_tokens=False).ids == sp.encode("a b<tool>")
    # control tokens are special: skipped by decode unless asked for
    ids = tok.encode("x<ctl>y").ids
    assert tok.decode(ids, skip_special_tokens=False) == "<s> x<ctl> y"


def test_bos_eos_flags(corpus, tmp_path):
    train, _, lines = corpus
    sp = _train(train[:10], vocab_size=800)
    tok, meta = _load(_write_gguf(tmp_path / "nobos.gguf", sp, add_bos=False, add_eos=True))
    assert meta["add_bos_token"] is False and meta["add_eos_token"] is True
    assert tok.encode("hello world").ids == [*sp.encode("hello world"), sp.eos_id()]
    tok, meta = _load(_write_gguf(tmp_path / "default.gguf", sp, add_bos=None))
    assert meta["add_bos_token"] is None
    assert tok.encode("hello world").ids == [sp.bos_id(), *sp.encode("hello world")]  # llama.cpp's default


def test_no_space_prefix(corpus, tmp_path):
    train, _, lines = corpus
    sp = _train(train[:10], vocab_size=800, add_dummy_prefix=False)
    tok, meta = _load(_write_gguf(tmp_path / "noprefix.gguf", sp, add_space_prefix=False))
    assert meta["add_space_prefix"] is False
    texts = lines[:200] + EDGE_LINES
    _compare(sp, tok, texts)
    assert tok.decode_batch([e.ids for e in tok.encode_batch(texts)]) == texts
    assert tok.encode("a b", add_special_tokens=False).tokens[0] == "a"


def test_missing_scores(spm_gguf, tmp_path):
    sp, _, _ = spm_gguf
    g = GGUFFile(_write_gguf(tmp_path / "noscores.gguf", sp, scores=False))
    meta = g.tokenizer_meta()
    assert meta["model"] == "llama" and meta["scores"] is None
    with pytest.raises(LoadError, match=r"noscores\.gguf: SentencePiece-style vocabulary .*without scores"):
        tokenizer_from_gguf(meta, g.path)


# ---- the merge-by-score algorithm on random vocabularies ---------------------------------------------------------


def _spm_reference(text: str, vocab: dict[str, int], score: list[float]) -> list[int]:
    """llama.cpp's / SentencePiece's BPE on an escaped string: repeatedly join the adjacent pair whose concatenation
    is the token with the highest score, the leftmost among equals. Every character must be a token."""
    sym = list(text)
    nxt, prv = list(range(1, len(sym))) + [-1], list(range(-1, len(sym) - 1))
    heap: list[tuple[float, int, int, int]] = []

    def push(left, right):
        if left >= 0 and right >= 0 and (t := sym[left] + sym[right]) in vocab:
            heapq.heappush(heap, (-score[vocab[t]], left, right, len(t)))

    for i in range(1, len(sym)):
        push(i - 1, i)
    while heap:
        _, left, right, n = heapq.heappop(heap)
        if not sym[left] or not sym[right] or len(sym[left]) + len(sym[right]) != n:
            continue  # stale: one of the two merged since (symbols only grow, or are emptied into a neighbour)
        sym[left] += sym[right]
        sym[right] = ""
        nxt[left] = nxt[right]
        if nxt[right] >= 0:
            prv[nxt[right]] = left
        push(prv[left], left)
        push(left, nxt[left])
    return [vocab[s] for s in sym if s]


def test_random_vocabularies_match_reference():
    rng = random.Random(1234)
    alphabet = "ab\u2581"
    for _ in range(150):
        toks = set(alphabet)
        while len(toks) < 30:
            toks.add("".join(rng.choice(alphabet) for _ in range(rng.randint(2, 6))))
        toks = sorted(toks)
        rng.shuffle(toks)
        scores = [-float(i) for i in range(len(toks))]  # every token its own score, as real vocabularies
        rng.shuffle(scores)
        meta = {"model": "llama", "tokens": toks, "scores": scores, "add_bos_token": False,
                "add_space_prefix": False}
        tok = tokenizer_from_gguf(meta)
        vocab = {t: i for i, t in enumerate(toks)}
        texts = ["".join(rng.choice("ab ") for _ in range(rng.randint(1, 40))) for _ in range(30)]
        got = [e.ids for e in tok.encode_batch(texts)]
        for t, g in zip(texts, got, strict=True):
            assert g == _spm_reference(t.replace(" ", "\u2581"), vocab, scores), (toks, scores, t)


def test_merges_of_a_32k_vocabulary_are_fast():
    rng = random.Random(7)
    letters = "abcdefghijklmnopqrstuvwxyz"
    toks = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + ["\u2581", *letters]
    seen = set(toks)
    while len(toks) < 32000:  # as BPE training grows a vocabulary: each new token joins two earlier ones
        t = toks[rng.randrange(259, len(toks))] + toks[rng.randrange(260, min(len(toks), 600))]
        if t not in seen and len(t) <= 12:
            seen.add(t)
            toks.append(t)
    types = [UNKNOWN, CONTROL, CONTROL] + [BYTE] * 256 + [NORMAL] * (len(toks) - 259)
    scores = np.asarray([0.0] * 259 + [-float(i) for i in range(len(toks) - 259)], np.float32)
    t0 = time.perf_counter()
    merges = spm_merges(toks, types, scores)
    tok = tokenizer_from_gguf({"model": "llama", "tokens": toks, "token_types": types, "scores": scores,
                               "bos_token_id": 1, "unknown_token_id": 0})
    assert time.perf_counter() - t0 < 10.0  # 0.2 s here; the quadratic version took minutes
    assert len(merges) > 32000
    assert tok.encode("abc", add_special_tokens=False).ids  # builds and encodes
