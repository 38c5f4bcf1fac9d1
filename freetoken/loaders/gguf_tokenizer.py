"""Tokenizers to and from a GGUF file's embedded vocabulary (``tokenizer.ggml.*``), byte-level BPE ("gpt2").

A GGUF carries no ``tokenizer.json``: only the token strings in id order, a type per token, the merges, the
special ids and the name of a pre-tokenizer (``tokenizer.ggml.pre``), which llama.cpp maps to a fixed set of split
regexes. :func:`tokenizer_from_gguf` rebuilds a ``tokenizers.Tokenizer`` from that;
:func:`gguf_tokenizer_fields` goes the other way, from a Hugging Face ``tokenizer.json`` (+ ``tokenizer_config.json``)
to the fields a GGUF writer stores, and :func:`write_tokenizer` stores them with gguf-py's writer.

The fields dict uses :meth:`freetoken.loaders.GGUFFile.tokenizer_meta`'s key names, so
``tokenizer_from_gguf(gguf_tokenizer_fields(...))`` works without a file in between.

Supported ``tokenizer.ggml.pre`` names (:data:`PRE_TOKENIZERS`), each as the Hugging Face ``tokenizer.json`` of the
models they come from spells it:

- ``"gpt-2"`` (also ``"default"`` and a missing key): ``ByteLevel(use_regex=True)``, i.e. GPT-2's split regex.
  llama.cpp's own ``"default"`` splits slightly differently (punctuation runs and digit groups); models written
  by today's converters never carry it.
- ``"qwen2"``: NFC normalizer + the Qwen2 split regex (single digits, ``[\\r\\n]`` handling) + ``ByteLevel``,
  as Qwen2 / Qwen2.5 / Qwen3 ship it (llama.cpp itself skips the NFC step).
- ``"llama-bpe"`` (also ``"llama3"``, ``"llama-v3"``): the Llama 3 split regex (digits in groups of up to three),
  ``ignore_merges`` (a word that is a whole token is not merged up) and BOS added by default, as llama.cpp does.
- ``"deepseek-v3"``: DeepSeek-V3 / R1's three isolated splits (digit groups, CJK / kana runs, the main regex).
- ``"kimi-k2"``: Moonshot's split regex (:data:`KIMI_K2_SPLIT`: Han runs,
  cased words, digit groups of up to three) and ``ignore_merges``, as the tiktoken tokenizer Kimi-K2 ships encodes
  (:mod:`freetoken.loaders.tiktoken_tokenizer` rebuilds that one from ``tiktoken.model``).

Any other name is a :class:`LoadError` naming the pre-tokenizer and the file.

SentencePiece-style vocabularies (``tokenizer.ggml.model`` "llama": Llama 2, Mistral, Mixtral) carry tokens, a score
per token and token types, but no merges. :func:`tokenizer_from_gguf` rebuilds them the way llama.cpp's SPM tokenizer
works and Hugging Face's Llama converter spells it: a BPE model whose merges are every split ``(a, b)`` of a token
``a + b`` (all three in the vocabulary), ranked by that token's score, best first; ``<0xXX>`` byte fallback; spaces
escaped to "▁" with one "▁" put in front of each run of text (``tokenizer.ggml.add_space_prefix``, default true); a
decoder undoing both. Other vocabulary models (``bert``, ``t5``, ...) are a :class:`LoadError`.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

from freetoken.loaders.errors import LoadError

# GGUF token types (gguf.TokenType / llama.cpp's llama_token_type).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

#: What Hugging Face's ``ByteLevel(use_regex=True)`` pre-tokenizer splits with (GPT-2's pattern).
GPT2_SPLIT = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
#: Qwen2's split: letters may take one leading non-letter, digits one by one.
QWEN2_SPLIT = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"""
               r"""|\s+(?!\S)|\s+""")
#: Llama 3's split: as Qwen2's, but digits in groups of up to three.
LLAMA3_SPLIT = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
                r"""|\s*[\r\n]+|\s+(?!\S)|\s+""")
#: DeepSeek-V3's three isolated splits, character for character as its tokenizer.json has them (the CR / LF in
#: the third are literal characters there, not regex escapes).
DEEPSEEK_V3_SPLITS = (
    "\\p{N}{1,3}",
    "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+",
    "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+"
    "| ?[\\p{P}\\p{S}]+[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+",
)

#: Moonshot's split regex (Kimi-K2's ``pat_str``): ``&&`` is a character-class intersection, which tiktoken's regex
#: engine and Oniguruma (the tokenizers library's) both read.
KIMI_K2_SPLIT = "|".join([
    r"""[\p{Han}]+""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"""
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"""
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
])


@dataclass(frozen=True)
class PreTokenizer:
    """How one ``tokenizer.ggml.pre`` name tokenizes: isolated regex splits before a regex-less ``ByteLevel``
    (none: ``ByteLevel(use_regex=True)``, GPT-2's), an NFC normalizer or not, BPE ``ignore_merges``, and whether
    BOS is added when the file does not say (``tokenizer.ggml.add_bos_token`` missing)."""

    splits: tuple[str, ...] = ()
    nfc: bool = False
    ignore_merges: bool = False
    add_bos: bool = False

    def normalizer(self):
        return normalizers.NFC() if self.nfc else None

    def pre_tokenizer(self):
        if not self.splits:
            return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        return pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(s), behavior="isolated", invert=False) for s in self.splits]
            + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


_GPT2 = PreTokenizer()
_QWEN2 = PreTokenizer((QWEN2_SPLIT,), nfc=True)
_LLAMA3 = PreTokenizer((LLAMA3_SPLIT,), ignore_merges=True, add_bos=True)
_DEEPSEEK_V3 = PreTokenizer(DEEPSEEK_V3_SPLITS)
_KIMI_K2 = PreTokenizer((KIMI_K2_SPLIT,), ignore_merges=True)  # tiktoken looks a whole piece up first

#: ``tokenizer.ggml.pre`` -> how it tokenizes. The first name of each is the one :func:`gguf_tokenizer_fields`
#: writes (what llama.cpp's convert_hf_to_gguf.py writes for those models).
PRE_TOKENIZERS: dict[str, PreTokenizer] = {
    "gpt-2": _GPT2, "default": _GPT2,
    "qwen2": _QWEN2,
    "llama-bpe": _LLAMA3, "llama3": _LLAMA3, "llama-v3": _LLAMA3,
    "deepseek-v3": _DEEPSEEK_V3,
    "kimi-k2": _KIMI_K2,
}
_WRITTEN_NAMES = ("gpt-2", "qwen2", "llama-bpe", "deepseek-v3", "kimi-k2")


def _where(path) -> str:
    return os.fspath(path) if path is not None else "<gguf tokenizer metadata>"


# ---- GGUF -> tokenizers ------------------------------------------------------------------------------------------


def tokenizer_from_gguf(meta: dict[str, Any], path: str | os.PathLike | None = None) -> Tokenizer:
    """A ``tokenizers.Tokenizer`` for an embedded vocabulary: byte-level BPE ("gpt2") or SentencePiece-style BPE
    ("llama", see :func:`_spm_tokenizer`).

    ``meta``: :meth:`GGUFFile.tokenizer_meta` (or :func:`gguf_tokenizer_fields`); ``path``: the file, for errors.
    Tokens typed control (3) become special added tokens and user-defined ones (4) plain added tokens, so text
    containing them is never split into pieces; ``decode`` skips the special ones unless told otherwise. When the
    file asks for BOS / EOS (``add_bos_token`` / ``add_eos_token``, or the pre-tokenizer's default), a template
    post-processor adds them, so ``encode(text)`` matches llama.cpp and ``encode(text, add_special_tokens=False)``
    gives the bare ids.
    """
    where = _where(path)
    model = meta.get("model")
    if model == "llama":
        return _spm_tokenizer(meta, where)
    if model != "gpt2":
        raise LoadError(where, f"tokenizer.ggml.model {model!r} is not supported; only byte-level BPE ('gpt2') and "
                               "SentencePiece-style BPE ('llama')")
    pre_name = meta.get("pre")
    pre = PRE_TOKENIZERS.get("gpt-2" if pre_name is None else pre_name)
    if pre is None:
        raise LoadError(where, f"pre-tokenizer {pre_name!r} (tokenizer.ggml.pre) is not supported; supported: "
                               f"{', '.join(PRE_TOKENIZERS)}")
    tokens, types = _tokens_and_types(meta, where)
    raw_merges = meta.get("merges")
    if raw_merges is None:
        raise LoadError(where, "byte-level BPE vocabulary without merges (tokenizer.ggml.merges missing)")
    merges = []
    for i, m in enumerate(raw_merges):
        cut = m.find(" ", 1)  # as llama.cpp: the first part may itself be a single space
        if cut < 0 or cut == len(m) - 1:
            raise LoadError(where, f"tokenizer.ggml.merges[{i}] {m!r} is not two tokens separated by a space")
        merges.append((m[:cut], m[cut + 1:]))

    vocab = _vocab(tokens)
    kwargs = {"ignore_merges": True} if pre.ignore_merges else {}
    try:
        tok = Tokenizer(models.BPE(vocab, merges, dropout=None, unk_token=None, fuse_unk=False, byte_fallback=False,
                                   **kwargs))
    except Exception as e:  # merges naming tokens the vocabulary lacks, unencodable strings, ...
        raise LoadError(where, f"cannot build the BPE model from the embedded vocabulary: {e}") from e
    if pre.nfc:
        tok.normalizer = pre.normalizer()
    tok.pre_tokenizer = pre.pre_tokenizer()
    tok.decoder = decoders.ByteLevel()
    _add_vocab_tokens(tok, tokens, types, vocab, where, special_types=(CONTROL,))
    _add_bos_eos(tok, meta, tokens, pre.add_bos, where)
    return tok


def _tokens_and_types(meta: dict[str, Any], where: str) -> tuple[list[str], list[int]]:
    tokens = list(meta.get("tokens") or [])
    if not tokens:
        raise LoadError(where, "embedded tokenizer without tokens")
    types = meta.get("token_types")
    types = [NORMAL] * len(tokens) if types is None else [int(t) for t in types]
    if len(types) != len(tokens):
        raise LoadError(where, f"{len(types)} token types for {len(tokens)} tokens")
    return tokens, types


def _vocab(tokens: list[str]) -> dict[str, int]:
    vocab: dict[str, int] = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)  # a duplicate string keeps its first id
    return vocab


def _add_vocab_tokens(tok: Tokenizer, tokens: list[str], types: list[int], vocab: dict[str, int], where: str,
                      special_types: tuple[int, ...]) -> None:
    """Added tokens: matched whole in the raw text, before normalization and pre-tokenization. They already sit in
    the BPE vocabulary with their ids, so adding them keeps those ids. ``special_types``: the token types added as
    special (skipped by ``decode``); user-defined ones are added as plain tokens."""
    special = [AddedToken(tokens[i], special=True, normalized=False) for i, ty in enumerate(types)
               if ty in special_types and vocab[tokens[i]] == i]
    plain = [AddedToken(tokens[i], special=False, normalized=False) for i, ty in enumerate(types)
             if ty == USER_DEFINED and vocab[tokens[i]] == i]
    if special:
        tok.add_special_tokens(special)
    if plain:
        tok.add_tokens(plain)
    moved = [t.content for t in special + plain if tok.token_to_id(t.content) != vocab[t.content]]
    if moved:  # cannot happen with a well-formed vocabulary; guard the ids the model was trained on
        raise LoadError(where, f"added tokens changed ids: {moved[:5]}")


def _add_bos_eos(tok: Tokenizer, meta: dict[str, Any], tokens: list[str], default_bos: bool, where: str) -> None:
    """A template post-processor adding BOS / EOS when the file asks for them (BOS: ``default_bos`` when it does not
    say)."""
    add_bos = meta.get("add_bos_token")
    add_bos = default_bos if add_bos is None else bool(add_bos)
    add_eos = bool(meta.get("add_eos_token"))
    around: list[tuple[str, int] | None] = []
    for flag, key in ((add_bos, "bos"), (add_eos, "eos")):
        tid = meta.get(f"{key}_token_id")
        if flag and tid is None:
            raise LoadError(where, f"tokenizer.ggml.add_{key}_token is true, but tokenizer.ggml.{key}_token_id is "
                                   "not set")
        around.append((tokens[tid], int(tid)) if flag else None)
    bos, eos = around
    if bos or eos:  # template pieces by key, so token strings with spaces or colons do not reach its parser
        b, e = ["BOS"] if bos else [], ["EOS"] if eos else []
        b1, e1 = ["BOS:1"] if bos else [], ["EOS:1"] if eos else []
        keyed = [{"id": k, "ids": [x[1]], "tokens": [x[0]]} for k, x in (("BOS", bos), ("EOS", eos)) if x]
        tok.post_processor = processors.TemplateProcessing(
            single=[*b, "$A", *e], pair=[*b, "$A", *e, *b1, "$B:1", *e1], special_tokens=keyed)


# ---- SentencePiece-style ("llama") vocabularies ------------------------------------------------------------------

#: SentencePiece's whitespace escape.
SPIECE_SPACE = "\u2581"
#: How SentencePiece spells a byte-fallback piece (and Hugging Face's BPE ``byte_fallback`` looks them up).
_BYTE_PIECE = re.compile(r"<0x[0-9A-F]{2}>")
#: Token types SentencePiece never produces by merging (nor merges further): they are not pieces of text.
_NOT_MERGED = (UNKNOWN, CONTROL, BYTE)


def spm_merges(tokens: list[str], types: list[int], scores) -> list[tuple[str, str]]:
    """BPE merges equivalent to SentencePiece's merge-by-score for a vocabulary without merges.

    SentencePiece (and llama.cpp's SPM tokenizer) repeatedly joins the adjacent pair of symbols whose concatenation
    is the vocabulary token with the highest score. As a merge list: every split ``(a, b)`` of every token ``a + b``
    where ``a`` and ``b`` are tokens too, ranked by the score of ``a + b``, best first; unknown / control / byte
    tokens take no part. Ties go to the lower token id, then (one token, several splits) the longer left part. A
    merge list is a strict order, so one thing is not reproduced: where two different tokens have the same score and
    both could be formed at once, SentencePiece takes the leftmost pair and this the lower id. Real vocabularies give
    every mergeable token its own score; files written with one placeholder score for all tokens tokenize
    differently (in llama.cpp too: greedily from the left).
    Linear in the summed token lengths: one dict lookup per split (a 32k vocabulary: well under a second).
    """
    mergeable: dict[str, int] = {}
    for i, (t, ty) in enumerate(zip(tokens, types, strict=True)):
        if ty not in _NOT_MERGED:
            mergeable.setdefault(t, i)
    score = [float(x) for x in scores]
    found: list[tuple[float, int, int, str, str]] = []
    for t, i in mergeable.items():
        for cut in range(len(t) - 1, 0, -1):  # longer left part first
            a = t[:cut]
            if a in mergeable:
                b = t[cut:]
                if b in mergeable:
                    found.append((-score[i], i, len(found), a, b))
    found.sort()
    return [(a, b) for *_, a, b in found]


def _spm_tokenizer(meta: dict[str, Any], where: str) -> Tokenizer:
    """SentencePiece-style BPE as llama.cpp tokenizes it, built the way Hugging Face's (legacy) Llama converter does.

    - model: BPE with the merges of :func:`spm_merges`, ``byte_fallback`` (characters outside the vocabulary become
      their UTF-8 bytes' ``<0xXX>`` tokens), the unknown token (``unknown_token_id``, else the first token typed
      unknown) for what has no byte tokens, consecutive unknowns fused;
    - normalizer: a leading "▁" (``add_space_prefix``, i.e. ``tokenizer.ggml.add_space_prefix``; default true), then
      every " " -> "▁". No pre-tokenizer: each run of text between added tokens is one BPE word;
    - added tokens: control and unknown tokens special, user-defined ones plain, all cut out of the raw text first,
      so each run of text between them gets its own "▁" prefix, as llama.cpp encodes it (and Mistral's tokenizer the
      text between control tokens). SentencePiece itself, which matches user-defined symbols inside one normalized
      string, prefixes only the start: "a <x>b" is "▁a▁", "<x>", "▁b" here and in llama.cpp, but "▁a▁", "<x>", "b"
      there. (Matching them in the normalized text instead is what ``tokenizers`` cannot do reliably: its normalized
      added-token matching misplaces pieces when the normalizer inserts or widens characters, as these do.)
    - decoder: "▁" -> " ", byte tokens -> bytes -> text, then the prefix space stripped again;
    - post-processor: BOS (``add_bos_token``, default true as llama.cpp) and EOS (``add_eos_token``).
    """
    tokens, types = _tokens_and_types(meta, where)
    scores = meta.get("scores")
    if scores is None:
        raise LoadError(where, "SentencePiece-style vocabulary (tokenizer.ggml.model 'llama') without scores "
                               "(tokenizer.ggml.scores missing): its merges cannot be recovered")
    if len(scores) != len(tokens):
        raise LoadError(where, f"{len(scores)} token scores for {len(tokens)} tokens")
    vocab = _vocab(tokens)
    merges = spm_merges(tokens, types, scores)
    unk_id = meta.get("unknown_token_id")
    if unk_id is None:
        unk_id = next((i for i, ty in enumerate(types) if ty == UNKNOWN), None)
    if unk_id is not None and not 0 <= int(unk_id) < len(tokens):
        raise LoadError(where, f"unknown token id {unk_id} is outside the {len(tokens)}-token vocabulary")
    unk = None if unk_id is None else tokens[int(unk_id)]
    byte_fallback = any(_BYTE_PIECE.fullmatch(t) for t in vocab)
    try:
        tok = Tokenizer(models.BPE(vocab, merges, dropout=None, unk_token=unk, fuse_unk=True,
                                   byte_fallback=byte_fallback))
    except Exception as e:  # unencodable strings, ...
        raise LoadError(where, f"cannot build the BPE model from the embedded vocabulary: {e}") from e
    prefix = meta.get("add_space_prefix")
    prefix = True if prefix is None else bool(prefix)
    escape = [normalizers.Replace(" ", SPIECE_SPACE)]
    tok.normalizer = normalizers.Sequence([normalizers.Prepend(SPIECE_SPACE), *escape] if prefix else escape)
    steps = [decoders.Replace(SPIECE_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    tok.decoder = decoders.Sequence([*steps, decoders.Strip(" ", 1, 0)] if prefix else steps)
    _add_vocab_tokens(tok, tokens, types, vocab, where, special_types=(CONTROL, UNKNOWN))
    _add_bos_eos(tok, meta, tokens, True, where)
    return tok


# ---- tokenizer.json -> GGUF fields -------------------------------------------------------------------------------


def _canonical(x):
    """JSON of a normalizer / pre-tokenizer with what does not change token ids dropped: ``trim_offsets`` (offsets
    only) and empty normalizer sequences."""
    if isinstance(x, dict):
        if x.get("type") == "Sequence" and "normalizers" in x and not x["normalizers"]:
            return None
        return {k: _canonical(v) for k, v in x.items() if k != "trim_offsets"}
    if isinstance(x, list):
        return [_canonical(v) for v in x]
    return x


def _profile_json(normalizer, pre_tokenizer) -> tuple:
    t = Tokenizer(models.BPE())
    if normalizer is not None:
        t.normalizer = normalizer
    t.pre_tokenizer = pre_tokenizer
    d = json.loads(t.to_str())
    return _canonical(d.get("normalizer")), _canonical(d.get("pre_tokenizer"))


def _known_profiles() -> list[tuple[str, tuple]]:
    out = [(name, _profile_json(PRE_TOKENIZERS[name].normalizer(), PRE_TOKENIZERS[name].pre_tokenizer()))
           for name in _WRITTEN_NAMES]
    # GPT-2's regex spelled out as an explicit split is the same pre-tokenizer.
    out.append(("gpt-2", _profile_json(None, PreTokenizer((GPT2_SPLIT,)).pre_tokenizer())))
    return out


def _token_content(entry) -> str | None:
    if isinstance(entry, dict):
        entry = entry.get("content")
    return entry if isinstance(entry, str) else None


def _read_json(path, what: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            d = json.load(f)
    except FileNotFoundError:
        raise LoadError(path, "missing") from None
    except (OSError, ValueError) as e:
        raise LoadError(path, f"cannot read {what}: {e}") from e
    if not isinstance(d, dict):
        raise LoadError(path, f"not a {what} (top level is {type(d).__name__})")
    return d


def gguf_tokenizer_fields(tokenizer_json_path: str | os.PathLike,
                          tokenizer_config_path: str | os.PathLike | None = None,
                          config: dict | str | os.PathLike | None = None,
                          tokenizer: Tokenizer | None = None) -> dict[str, Any]:
    """What a GGUF stores for a Hugging Face byte-level BPE ``tokenizer.json``, in :meth:`GGUFFile.tokenizer_meta`'s
    key names: ``model`` ("gpt2"), ``pre`` (detected, see :data:`PRE_TOKENIZERS`), ``tokens`` (id order; ids no
    token has become ``[PAD<id>]``, as convert_hf_to_gguf.py writes them), ``token_types`` (1 normal, 3 control for
    special added tokens, 4 user-defined for other added tokens, 5 unused for the padding), ``merges`` ("a b"),
    ``bos_token_id`` / ``eos_token_id`` / ``padding_token_id`` / ``unknown_token_id`` (int or None), ``add_bos_token``
    / ``add_eos_token`` (bool or None: not stated), ``chat_template`` (str or None) and ``chat_templates`` (named
    extra templates).

    ``tokenizer_config_path``: special tokens by name, ``add_bos_token`` / ``add_eos_token``, the chat template (or a
    ``chat_template.jinja`` / ``chat_template.json`` beside it). ``config``: ``config.json`` (a path or its dict):
    ``*_token_id`` where the tokenizer config names none, ``vocab_size`` to pad the vocabulary up to the embedding
    rows. A tokenizer GGUF cannot describe (not BPE, byte fallback, a pre-tokenizer or normalizer not in
    :data:`PRE_TOKENIZERS`, ...) is a :class:`LoadError` (a ``ValueError``) naming the file.

    ``tokenizer``: the tokenizer itself, when it was not read from a ``tokenizer.json`` (Kimi-K2's tiktoken files,
    :mod:`freetoken.loaders.tiktoken_tokenizer`); ``tokenizer_json_path`` then names its file in errors.
    """
    path = Path(tokenizer_json_path)
    if tokenizer is not None:
        tok = tokenizer
    else:
        data = _read_json(path, "tokenizer.json")
        try:
            tok = Tokenizer.from_str(json.dumps(data))
        except Exception as e:
            raise LoadError(path, f"tokenizers cannot load it: {e}") from e
    canon = json.loads(tok.to_str())  # the library's own spelling, to compare with the profiles'
    m = canon.get("model") or {}
    if m.get("type") != "BPE":
        raise LoadError(path, f"model type {m.get('type')!r}: only byte-level BPE can be stored as a 'gpt2' GGUF "
                              "vocabulary")
    for key, ok in (("byte_fallback", lambda v: not v), ("dropout", lambda v: v is None),
                    ("continuing_subword_prefix", lambda v: not v), ("end_of_word_suffix", lambda v: not v),
                    ("unk_token", lambda v: v is None)):
        if not ok(m.get(key)):
            raise LoadError(path, f"BPE {key}={m.get(key)!r} cannot be stored in a GGUF vocabulary")
    dec = canon.get("decoder") or {}
    if dec.get("type") != "ByteLevel":
        raise LoadError(path, f"decoder {dec.get('type')!r}: a 'gpt2' GGUF vocabulary is decoded byte-level")

    got = (_canonical(canon.get("normalizer")), _canonical(canon.get("pre_tokenizer")))
    pre = next((name for name, want in _known_profiles() if want == got), None)
    if pre is None:
        raise LoadError(path, "unknown pre-tokenizer / normalizer (no tokenizer.ggml.pre name for it): "
                              f"normalizer {json.dumps(got[0])}, pre_tokenizer {json.dumps(got[1])[:400]}")
    if bool(m.get("ignore_merges")) != PRE_TOKENIZERS[pre].ignore_merges:
        raise LoadError(path, f"BPE ignore_merges={bool(m.get('ignore_merges'))} does not match pre-tokenizer "
                              f"{pre!r} (llama.cpp uses ignore_merges={PRE_TOKENIZERS[pre].ignore_merges} for it)")

    # Vocabulary: the BPE model's plus the added tokens, by id.
    by_id: dict[int, str] = {}
    for t, i in m.get("vocab", {}).items():
        if i in by_id:
            raise LoadError(path, f"tokens {by_id[i]!r} and {t!r} share id {i}")
        by_id[i] = t
    added = canon.get("added_tokens") or []
    added_type: dict[int, int] = {}
    for a in added:
        i, t = int(a["id"]), a["content"]
        if by_id.get(i, t) != t:
            raise LoadError(path, f"added token {t!r} has id {i}, which the vocabulary gives to {by_id[i]!r}")
        by_id[i] = t
        added_type[i] = CONTROL if a.get("special") else USER_DEFINED
    n = max(by_id) + 1 if by_id else 0
    cfg = config
    if isinstance(cfg, (str, os.PathLike)):
        cfg = _read_json(cfg, "config.json")
    cfg = cfg or {}
    vs = cfg.get("vocab_size", cfg.get("text_config", {}).get("vocab_size") if isinstance(cfg.get("text_config"),
                                                                                           dict) else None)
    if isinstance(vs, int) and vs > n:
        n = vs
    tokens = [by_id.get(i, f"[PAD{i}]") for i in range(n)]
    types = [added_type.get(i, NORMAL) if i in by_id else UNUSED for i in range(n)]

    merges = []
    for i, mg in enumerate(m.get("merges") or []):
        parts = mg.split(" ") if isinstance(mg, str) else list(mg)
        if len(parts) != 2 or not all(parts):
            raise LoadError(path, f"merge {i} {mg!r} is not a pair of space-free tokens (a GGUF stores 'a b')")
        merges.append(f"{parts[0]} {parts[1]}")

    ids = {t: i for i, t in reversed(list(enumerate(tokens)))}
    for a in added:
        ids[a["content"]] = int(a["id"])
    out: dict[str, Any] = {"model": "gpt2", "pre": pre, "tokens": tokens, "token_types": types, "merges": merges}
    for key in ("bos", "eos", "padding", "unknown"):
        out[f"{key}_token_id"] = None
    out.update(add_bos_token=None, add_eos_token=None, chat_template=None, chat_templates={})

    # BOS / EOS the post-processor adds (as gguf-py's SpecialVocab reads them).
    pp = canon.get("post_processor")
    procs = (pp.get("processors") or []) if isinstance(pp, dict) and pp.get("type") == "Sequence" else [pp]
    for p in procs:
        if not p or p.get("type") == "ByteLevel":
            continue
        if p.get("type") != "TemplateProcessing":
            raise LoadError(path, f"post-processor {p.get('type')!r} cannot be stored in a GGUF vocabulary")
        single = p.get("single") or []
        seq = [k for k, x in enumerate(single) if "Sequence" in x]
        if len(seq) != 1 or seq[0] > 1 or len(single) - seq[0] > 2:
            raise LoadError(path, f"TemplateProcessing {single} is not [BOS] $A [EOS]")
        first = single[0]["SpecialToken"]["id"] if seq[0] == 1 else None
        last = single[-1]["SpecialToken"]["id"] if len(single) - seq[0] == 2 else None
        specials = p.get("special_tokens") or {}
        for key, name in (("bos", first), ("eos", last)):
            out[f"add_{key}_token"] = name is not None
            if name is not None:
                tid = (specials.get(name) or {}).get("ids") or [ids.get(name)]
                if len(tid) != 1 or tid[0] is None:
                    raise LoadError(path, f"TemplateProcessing special token {name!r} is not one known token")
                out[f"{key}_token_id"] = int(tid[0])

    if tokenizer_config_path is not None:
        tc_path = Path(tokenizer_config_path)
        tc = _read_json(tc_path, "tokenizer_config.json")
        for key, name in (("bos", "bos_token"), ("eos", "eos_token"), ("padding", "pad_token"),
                          ("unknown", "unk_token")):
            content = _token_content(tc.get(name))
            if content is None:
                continue
            if content not in ids:
                raise LoadError(tc_path, f"{name} {content!r} is not in the vocabulary of {path}")
            out[f"{key}_token_id"] = ids[content]
        for key in ("add_bos_token", "add_eos_token"):
            if isinstance(tc.get(key), bool):
                out[key] = tc[key]
        template = tc.get("chat_template")
        if template is None:
            jinja, js = tc_path.parent / "chat_template.jinja", tc_path.parent / "chat_template.json"
            if jinja.is_file():
                template = jinja.read_text(encoding="utf-8")
            elif js.is_file():
                template = _read_json(js, "chat_template.json").get("chat_template")
        if isinstance(template, list):  # [{"name": ..., "template": ...}, ...]
            named = {x.get("name"): x.get("template") for x in template if isinstance(x, dict)}
            out["chat_template"] = named.pop("default", None)
            out["chat_templates"] = {k: v for k, v in named.items() if k and isinstance(v, str)}
        elif isinstance(template, str):
            out["chat_template"] = template
        elif template is not None:
            raise LoadError(tc_path, f"chat_template is a {type(template).__name__}, not a string or a list")
    for key, name in (("bos", "bos_token_id"), ("eos", "eos_token_id"), ("padding", "pad_token_id")):
        v = cfg.get(name)
        if isinstance(v, list):
            v = v[0] if v else None
        if out[f"{key}_token_id"] is None and isinstance(v, int) and 0 <= v < n:
            out[f"{key}_token_id"] = v
    for key in ("bos", "eos"):
        if out[f"add_{key}_token"] and out[f"{key}_token_id"] is None:
            raise LoadError(path, f"add_{key}_token is set but no {key} token is named")
    return out


# ---- GGUF writer -------------------------------------------------------------------------------------------------

_ID_WRITERS: dict[str, str] = {
    "bos_token_id": "add_bos_token_id", "eos_token_id": "add_eos_token_id", "padding_token_id": "add_pad_token_id",
    "unknown_token_id": "add_unk_token_id", "eot_token_id": "add_eot_token_id", "eom_token_id": "add_eom_token_id",
    "seperator_token_id": "add_sep_token_id", "mask_token_id": "add_mask_token_id",
}


def write_tokenizer(writer, fields: dict[str, Any]) -> None:
    """Add ``fields`` (:func:`gguf_tokenizer_fields`, or a :meth:`GGUFFile.tokenizer_meta` dict) to a
    ``gguf.GGUFWriter`` before its KV data is written: ``tokenizer.ggml.model`` / ``pre`` / ``tokens`` /
    ``token_type`` / ``merges`` / ``scores``, the special ids, ``add_bos_token`` / ``add_eos_token`` and the chat
    template(s). Missing and None fields are left out."""
    writer.add_tokenizer_model(fields["model"])
    if fields.get("pre") is not None:
        writer.add_tokenizer_pre(fields["pre"])
    writer.add_token_list(list(fields["tokens"]))
    if fields.get("token_types") is not None:
        writer.add_token_types([int(t) for t in fields["token_types"]])
    if fields.get("scores") is not None:
        writer.add_token_scores([float(s) for s in fields["scores"]])
    if fields.get("merges") is not None:
        writer.add_token_merges(list(fields["merges"]))
    for key, method in _ID_WRITERS.items():
        if fields.get(key) is not None:
            add: Callable[[int], None] = getattr(writer, method)
            add(int(fields[key]))
    if fields.get("add_bos_token") is not None:
        writer.add_add_bos_token(bool(fields["add_bos_token"]))
    if fields.get("add_eos_token") is not None:
        writer.add_add_eos_token(bool(fields["add_eos_token"]))
    named = fields.get("chat_templates") or {}
    if named:
        choices = [{"name": k, "template": v} for k, v in named.items()]
        if fields.get("chat_template") is not None:
            choices.insert(0, {"name": "default", "template": fields["chat_template"]})
        writer.add_chat_template(choices)
    elif fields.get("chat_template") is not None:
        writer.add_chat_template(fields["chat_template"])
