"""Tokenizers shipped as a tiktoken BPE file rather than a ``tokenizer.json``: Kimi-K2 (and Moonshot's other models,
Kimi-Linear, Moonlight), whose HF directories hold ``tiktoken.model`` (one ``base64(token bytes) rank`` line per
token, ranks 0..n-1), ``tokenizer_config.json`` (the special tokens' names) and the model's own Python tokenizer,
which freetoken does not run.

:func:`tokenizer_from_tiktoken` rebuilds it as a ``tokenizers.Tokenizer`` that encodes as tiktoken does:

- the split regex is the model's (``KIMI_K2_SPLIT``, Moonshot's ``pat_str``: Han runs, cased words with an
  optional contraction, digits in groups of up to three, punctuation runs, newlines, spaces), then byte-level;
- byte-level BPE over the ranks. tiktoken merges the adjacent pair whose concatenation has the lowest rank; the
  merges here are, per token in rank order, the two parts tiktoken's own merging ends with when it is only allowed
  ranks below the token's (:func:`bpe_merges`, the conversion llama.cpp's and transformers' converters make), and a
  piece that is a token as a whole is that token (``ignore_merges``, as tiktoken looks a piece up first);
- the ``num_base + 256 + 2`` special ids after the base vocabulary, named by ``added_tokens_decoder`` in
  ``tokenizer_config.json`` or ``<|reserved_token_{id}|>``, are matched whole in the text (tiktoken's
  ``allowed_special="all"``, as Moonshot's tokenizer encodes) and skipped when decoding.

It is built as the GGUF fields of llama.cpp's ``kimi-k2`` vocabulary would be (:mod:`freetoken.loaders.gguf_tokenizer`,
which holds the split regex, ``KIMI_K2_SPLIT``), so a GGUF file written from it reads back the same.
"""

from __future__ import annotations

import base64
import binascii
import json
import os
from pathlib import Path

from tokenizers import Tokenizer

from freetoken.loaders.errors import LoadError
from freetoken.loaders.gguf_tokenizer import CONTROL, NORMAL, tokenizer_from_gguf

#: Special ids after the base vocabulary: Moonshot reserves 256 and two more.
SPECIAL_COUNT = 256 + 2
#: The file name of the ranks.
RANKS_FILE = "tiktoken.model"


def byte_level_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character map (the byte-level BPE alphabet every tokenizer.json and GGUF uses)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    out, extra = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + extra)
            extra += 1
    return out


def read_ranks(path: str | os.PathLike) -> dict[bytes, int]:
    """A tiktoken ranks file -> {token bytes: rank}. Ranks must be 0..n-1, each once, with every single byte a
    token (byte-level BPE needs them); anything else is a :class:`LoadError` naming the file and line."""
    path = Path(path)
    try:
        lines = path.read_bytes().splitlines()
    except OSError as e:
        raise LoadError(path, f"cannot read the tiktoken ranks: {e.strerror or e}") from None
    ranks: dict[bytes, int] = {}
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        parts = line.split()
        try:
            if len(parts) != 2:
                raise ValueError("not two fields")
            token, rank = base64.b64decode(parts[0], validate=True), int(parts[1])
        except (ValueError, binascii.Error) as e:
            raise LoadError(path, f"line {n}: not 'base64-token rank' ({e})") from None
        if not token or token in ranks:
            raise LoadError(path, f"line {n}: {'an empty' if not token else 'a repeated'} token")
        ranks[token] = rank
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise LoadError(path, f"ranks are not 0..{len(ranks) - 1}, each once")
    missing = [b for b in range(256) if bytes([b]) not in ranks]
    if missing:
        raise LoadError(path, f"{len(missing)} single bytes are not tokens (first: {missing[0]:#04x}); byte-level "
                              "BPE needs all 256")
    return ranks


def _merge_down(token: bytes, ranks: dict[bytes, int], below: int) -> list[bytes]:
    """tiktoken's merging of ``token``'s bytes with only the ranks below ``below``: repeatedly the adjacent pair
    whose concatenation has the lowest rank (the leftmost of equals)."""
    parts = [token[i:i + 1] for i in range(len(token))]
    while len(parts) > 1:
        best, at = below, -1
        for i in range(len(parts) - 1):
            r = ranks.get(parts[i] + parts[i + 1], below)
            if r < best:
                best, at = r, i
        if at < 0:
            break
        parts[at:at + 2] = [parts[at] + parts[at + 1]]
    return parts


def bpe_merges(ranks: dict[bytes, int]) -> list[tuple[bytes, bytes]]:
    """The merge that builds each multi-byte token, in rank order: the two parts :func:`_merge_down` ends with. A
    token its lower ranks cannot build in two parts gets no merge (only a whole-piece lookup produces it)."""
    out = []
    for token, rank in sorted(ranks.items(), key=lambda kv: kv[1]):
        if len(token) > 1:
            parts = _merge_down(token, ranks, rank)
            if len(parts) == 2:
                out.append((parts[0], parts[1]))
    return out


def _special_names(config: dict, base: int) -> dict[int, str]:
    names = {}
    for key, entry in (config.get("added_tokens_decoder") or {}).items():
        content = entry.get("content") if isinstance(entry, dict) else None
        if isinstance(content, str) and str(key).isdigit():
            names[int(key)] = content
    return {i: names.get(i, f"<|reserved_token_{i}|>") for i in range(base, base + SPECIAL_COUNT)}


def is_tiktoken_dir(path: str | os.PathLike) -> bool:
    """Whether ``path`` holds a tiktoken tokenizer and no ``tokenizer.json``."""
    p = Path(path)
    return (p / RANKS_FILE).is_file() and not (p / "tokenizer.json").is_file()


def tokenizer_from_tiktoken(path: str | os.PathLike) -> Tokenizer:
    """The tokenizer of an HF directory with ``tiktoken.model`` (see the module docstring). Only Moonshot's split
    regex is known: a directory whose ``tokenizer_config.json`` does not name Moonshot's tokenizer class
    (``tokenization_kimi`` / ``tokenization_moonshot``) is a :class:`LoadError`, since the ranks alone do not say how
    text is split."""
    p = Path(path)
    cfg_path = p / "tokenizer_config.json"
    try:
        config = json.loads(cfg_path.read_text(encoding="utf-8")) if cfg_path.is_file() else {}
    except (OSError, ValueError) as e:
        raise LoadError(cfg_path, f"not readable JSON: {e}") from None
    auto = json.dumps(config.get("auto_map", {}))
    if "tokenization_kimi" not in auto and "tokenization_moonshot" not in auto:
        raise LoadError(p / RANKS_FILE, "a tiktoken tokenizer of unknown split regex (tokenizer_config.json's "
                                        "auto_map names no Moonshot tokenizer; only Kimi / Moonlight are known)")
    ranks = read_ranks(p / RANKS_FILE)
    alphabet = byte_level_alphabet()

    def text(b: bytes) -> str:
        return "".join(alphabet[c] for c in b)

    # the same fields a GGUF file holds for it ("kimi-k2"), so one builder makes both
    tokens = [text(t) for t, _ in sorted(ranks.items(), key=lambda kv: kv[1])]
    specials = _special_names(config, len(ranks))
    meta = {"model": "gpt2", "pre": "kimi-k2", "tokens": tokens + [specials[i] for i in sorted(specials)],
            "token_types": [NORMAL] * len(tokens) + [CONTROL] * len(specials),
            "merges": [f"{text(a)} {text(b)}" for a, b in bpe_merges(ranks)]}
    return tokenizer_from_gguf(meta, cfg_path)
