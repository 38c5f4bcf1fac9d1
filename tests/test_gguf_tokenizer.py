"""Byte-level BPE tokenizers through GGUF metadata: tokenizer.json -> GGUF fields -> a GGUF file -> tokenizers."""

import json
import os
from pathlib import Path

import pytest
from gguf import GGUFWriter
from tiny_models import finish_gguf
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

from freetoken.loaders import GGUFFile, LoadError, gguf_tokenizer_fields, tokenizer_from_gguf
from freetoken.loaders.gguf_tokenizer import write_tokenizer

MODEL_DIR = Path(__file__).resolve().parents[1] / "freetoken" / "default_model"

# Hand-written cases: special tokens inside text, unicode (combining marks, CJK, kana, emoji, NBSP), whitespace runs,
# CR/LF, contractions, digit runs, the empty string.
EDGE_TEXTS = [
    "",
    " ",
    "   ",
    "\n",
    "\n\n\n",
    "\r\n\r\n  \t\t x",
    "hello<|endoftext|>world",
    "<|endoftext|><|endoftext|> <|pad|>\n<|pad|>",
    "a<|endoftext|>",
    "I'M here, you'RE there; we'll see. It's 'quoted'.",
    "12345678 1,234.5 3.14159e-10 0x7fff",
    "caf\u00e9 cafe\u0301 na\u00efve \u00c5ngstr\u00f6m \u212b",
    "\u65e5\u672c\u8a9e\u306e\u30c6\u30ad\u30b9\u30c8\u3001\u30ab\u30bf\u30ab\u30ca\u3002"
    "\ud55c\uad6d\uc5b4 \u4e2d\u6587abc",
    "emoji \U0001f916\U0001f468\u200d\U0001f469\u200d\U0001f467 \u2764\ufe0f",
    "non\u00a0breaking\u2003em\u3000ideographic",
    "    def f(x):\n        return x  # trailing   \n\n\n\tindent\n",
    "$$$!!!??? ... --- === ***",
    "\u0645\u0631\u062d\u0628\u0627 \u05e9\u05dc\u05d5\u05dd "
    "\u043f\u0440\u0438\u0432\u0435\u0442 \u03b3\u03b5\u03b9\u03ac",
    "\x00\x01\x7f control \ufffd",
]


def _stdlib_texts(limit: int) -> list[str]:
    """Python stdlib sources, up to ``limit`` characters in all."""
    out, total = [], 0
    for p in sorted(Path(os.__file__).parent.glob("*.py")):
        try:
            t = p.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        t = t[: limit - total]
        out.append(t)
        total += len(t)
        if total >= limit:
            break
    return out


def _write_gguf(path: Path, fields: dict) -> Path:
    w = GGUFWriter(str(path), "qwen3moe")
    w.add_name("tok")
    write_tokenizer(w, fields)
    return finish_gguf(w, path)


def _through_gguf(tmp_path: Path, fields: dict, name: str = "tok.gguf") -> tuple[Tokenizer, dict]:
    g = GGUFFile(_write_gguf(tmp_path / name, fields))
    meta = g.tokenizer_meta()
    return tokenizer_from_gguf(meta, g.path), meta


def _assert_same(ref: Tokenizer, got: Tokenizer, texts: list[str]):
    for add in (True, False):
        want = [e.ids for e in ref.encode_batch(texts, add_special_tokens=add)]
        have = [e.ids for e in got.encode_batch(texts, add_special_tokens=add)]
        for t, w, h in zip(texts, want, have, strict=True):
            assert h == w, f"encode differs on {t[:80]!r}"
    ids = [e.ids for e in ref.encode_batch(texts)]
    for skip in (True, False):
        assert got.decode_batch(ids, skip_special_tokens=skip) == ref.decode_batch(ids, skip_special_tokens=skip)


# ---- the bundled tokenizer ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def bundled(tmp_path_factory):
    fields = gguf_tokenizer_fields(MODEL_DIR / "tokenizer.json", MODEL_DIR / "tokenizer_config.json",
                                   config=MODEL_DIR / "config.json")
    tok, meta = _through_gguf(tmp_path_factory.mktemp("bundled"), fields)
    return fields, tok, meta


def test_bundled_fields(bundled):
    fields, _, meta = bundled
    ref = json.loads((MODEL_DIR / "tokenizer.json").read_text())
    vocab = ref["model"]["vocab"]
    assert fields["model"] == "gpt2" and fields["pre"] == "gpt-2"
    assert len(fields["tokens"]) == len(vocab) == 4096
    assert all(fields["tokens"][i] == t for t, i in vocab.items())
    assert fields["token_types"][:2] == [3, 3] and set(fields["token_types"][2:]) == {1}
    assert fields["merges"][0] == "\u0120 \u0120" and len(fields["merges"]) == len(ref["model"]["merges"])
    assert fields["eos_token_id"] == 0 and fields["padding_token_id"] == 1
    assert fields["bos_token_id"] == 0  # from config.json: the tokenizer config names no BOS
    assert fields["add_bos_token"] is None and fields["add_eos_token"] is None
    tc = json.loads((MODEL_DIR / "tokenizer_config.json").read_text())
    assert fields["chat_template"] == tc["chat_template"] and fields["chat_templates"] == {}
    # what the GGUF gives back
    assert meta["model"] == "gpt2" and meta["pre"] == "gpt-2"
    assert meta["tokens"] == fields["tokens"] and meta["merges"] == fields["merges"]
    assert meta["token_types"].tolist() == fields["token_types"]
    for key in ("bos_token_id", "eos_token_id", "padding_token_id", "unknown_token_id", "chat_template"):
        assert meta[key] == fields[key], key
    assert meta["add_bos_token"] is None and meta["chat_templates"] == {}


def test_bundled_round_trip(bundled):
    _, tok, _ = bundled
    ref = Tokenizer.from_file(str(MODEL_DIR / "tokenizer.json"))
    texts = _stdlib_texts(300_000)
    assert sum(map(len, texts)) >= 300_000
    _assert_same(ref, tok, texts + EDGE_TEXTS)
    # byte-level: decoding is lossless
    assert tok.decode_batch([e.ids for e in tok.encode_batch(texts)]) == texts
    # specials stay whole, and are skipped on decode unless asked for
    enc = tok.encode("a<|endoftext|>b<|pad|>")
    assert 0 in enc.ids and 1 in enc.ids and "<|endoftext|>" in enc.tokens
    assert tok.decode(enc.ids) == "ab" and tok.decode(enc.ids, skip_special_tokens=False) == "a<|endoftext|>b<|pad|>"
    assert tok.encode("").ids == [] and tok.get_vocab_size() == ref.get_vocab_size()


def test_fields_without_file(bundled):
    fields, _, _ = bundled
    ref = Tokenizer.from_file(str(MODEL_DIR / "tokenizer.json"))
    _assert_same(ref, tokenizer_from_gguf(fields), EDGE_TEXTS)


# ---- qwen2 / llama-bpe / deepseek-v3: trained miniature tokenizers ----------------------------------------------

# The pre-tokenizers as the upstream tokenizer.json files spell them (Qwen2.5 / Llama 3 / DeepSeek-V3).
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
          r"|\s+(?!\S)|\s+")
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
           r"|\s+(?!\S)|\s+")
_DEEPSEEK3 = ["\\p{N}{1,3}", "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+",
              "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+"
              "| ?[\\p{P}\\p{S}]+[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+"]
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"

CASES = {
    # name: (split regexes, NFC normalizer, ignore_merges, BOS added by the post-processor, tokenizer.ggml.pre)
    "qwen2": ([_QWEN2], True, False, False, "qwen2"),
    "llama3": ([_LLAMA3], False, True, True, "llama-bpe"),
    "deepseek-v3": (_DEEPSEEK3, False, False, True, "deepseek-v3"),
    "gpt2-as-split": ([_GPT2], False, False, False, "gpt-2"),
}
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|begin_of_text|>"]


def _train(splits, nfc, ignore_merges, bos, corpus) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    if nfc:
        tok.normalizer = normalizers.NFC()
    else:
        tok.normalizer = normalizers.Sequence([])  # as DeepSeek-V3 has it: means none
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(s), behavior="isolated") for s in splits]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=700, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus, trainer)
    tok.add_tokens([AddedToken("<think>", special=False, normalized=False),
                    AddedToken("</think>", special=False, normalized=False)])
    if bos:
        tok.post_processor = processors.TemplateProcessing(
            single="<|begin_of_text|> $A", pair="<|begin_of_text|> $A <|begin_of_text|>:1 $B:1",
            special_tokens=[("<|begin_of_text|>", tok.token_to_id("<|begin_of_text|>"))])
    if ignore_merges:
        d = json.loads(tok.to_str())
        d["model"]["ignore_merges"] = True
        tok = Tokenizer.from_str(json.dumps(d))
    return tok


@pytest.mark.parametrize("case", list(CASES))
def test_split_pre_tokenizers_round_trip(case, tmp_path):
    splits, nfc, ignore_merges, bos, pre = CASES[case]
    corpus = _stdlib_texts(60_000) + EDGE_TEXTS * 5
    ref = _train(splits, nfc, ignore_merges, bos, corpus)
    ref.save(str(tmp_path / "tokenizer.json"))
    templates = [{"name": "default", "template": "{{ messages[0]['content'] }}"},
                 {"name": "tool_use", "template": "{{ tools }}"}]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": "<|im_end|>", "pad_token": {"content": "<|endoftext|>", "special": True},
         "chat_template": templates}))
    fields = gguf_tokenizer_fields(tmp_path / "tokenizer.json", tmp_path / "tokenizer_config.json")
    assert fields["pre"] == pre
    assert fields["add_bos_token"] is (True if bos else None)
    assert fields["bos_token_id"] == (ref.token_to_id("<|begin_of_text|>") if bos else None)
    assert fields["eos_token_id"] == ref.token_to_id("<|im_end|>")
    assert fields["padding_token_id"] == ref.token_to_id("<|endoftext|>")
    types = dict(zip(fields["tokens"], fields["token_types"], strict=True))
    assert [types[s] for s in SPECIALS] == [3] * 4 and types["<think>"] == types["</think>"] == 4
    assert fields["chat_template"] == templates[0]["template"]
    assert fields["chat_templates"] == {"tool_use": "{{ tools }}"}

    tok, meta = _through_gguf(tmp_path, fields)
    assert meta["pre"] == pre and meta["chat_templates"] == {"tool_use": "{{ tools }}"}
    assert meta["add_bos_token"] is (True if bos else None)
    texts = _stdlib_texts(150_000)[-20:] + EDGE_TEXTS + [
        "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n<think>\nhmm\n</think>\n\nok<|im_end|>",
        "<think>x</think><think>",
        "\u3053\u3093\u306b\u3061\u306f\u4e16\u754c\uff01 \u6f22\u5b57\u30ab\u30bf\u30ab\u30ca",
    ]
    _assert_same(ref, tok, texts)
    if bos:
        assert tok.encode("hi").ids[0] == fields["bos_token_id"]
        assert tok.encode("hi", add_special_tokens=False).ids == ref.encode("hi", add_special_tokens=False).ids
    if nfc:  # composed and decomposed spellings tokenize the same
        assert tok.encode("cafe\u0301").ids == tok.encode("caf\u00e9").ids


def test_llama3_adds_bos_when_the_file_does_not_say(tmp_path):
    ref = _train([_LLAMA3], False, True, True, EDGE_TEXTS * 3)
    ref.save(str(tmp_path / "tokenizer.json"))
    fields = gguf_tokenizer_fields(tmp_path / "tokenizer.json")
    fields["add_bos_token"] = None  # llama.cpp's default for llama-bpe: add BOS
    tok = tokenizer_from_gguf(fields)
    assert tok.encode("hello").ids == ref.encode("hello").ids
    assert tok.encode("hello").ids[0] == ref.token_to_id("<|begin_of_text|>")
    fields["add_bos_token"] = False
    assert tokenizer_from_gguf(fields).encode("hello").ids == ref.encode("hello", add_special_tokens=False).ids


# ---- errors ------------------------------------------------------------------------------------------------------


def _bundled_fields() -> dict:
    return gguf_tokenizer_fields(MODEL_DIR / "tokenizer.json", MODEL_DIR / "tokenizer_config.json")


def test_unknown_pre_tokenizer(tmp_path):
    fields = dict(_bundled_fields(), pre="falcon")
    g = GGUFFile(_write_gguf(tmp_path / "falcon.gguf", fields))
    with pytest.raises(LoadError, match=r"falcon\.gguf: pre-tokenizer 'falcon' \(tokenizer\.ggml\.pre\) is not supp"):
        tokenizer_from_gguf(g.tokenizer_meta(), g.path)


def test_missing_merges(tmp_path):
    fields = dict(_bundled_fields(), merges=None)
    g = GGUFFile(_write_gguf(tmp_path / "nomerges.gguf", fields))
    meta = g.tokenizer_meta()
    assert meta["merges"] is None
    with pytest.raises(LoadError, match=r"nomerges\.gguf: .*without merges"):
        tokenizer_from_gguf(meta, g.path)


def test_bad_merges_and_types(tmp_path):
    fields = _bundled_fields()
    with pytest.raises(LoadError, match=r"x\.gguf: tokenizer\.ggml\.merges\[1\] 'nospace'"):
        tokenizer_from_gguf(dict(fields, merges=["\u0120 \u0120", "nospace"]), tmp_path / "x.gguf")
    with pytest.raises(LoadError, match=r"x\.gguf: cannot build the BPE model"):
        tokenizer_from_gguf(dict(fields, merges=["\u0120 \u0120", "zzzq qqqz"]), tmp_path / "x.gguf")
    with pytest.raises(LoadError, match=r"<gguf tokenizer metadata>: tokenizer\.ggml\.model 'bert'"):
        tokenizer_from_gguf(dict(fields, model="bert"))
    with pytest.raises(LoadError, match="add_bos_token is true, but tokenizer.ggml.bos_token_id is not set"):
        tokenizer_from_gguf(dict(fields, add_bos_token=True, bos_token_id=None))


def test_fields_unknown_pre_tokenizer(tmp_path):
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(["some text here"], trainers.BpeTrainer(vocab_size=50, show_progress=False))
    tok.save(str(tmp_path / "ws.json"))
    with pytest.raises(ValueError, match=r"ws\.json: unknown pre-tokenizer"):
        gguf_tokenizer_fields(tmp_path / "ws.json")
    # byte-level with a prefix space: not a GGUF pre-tokenizer either
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
    tok.save(str(tmp_path / "prefix.json"))
    with pytest.raises(LoadError, match=r"prefix\.json: unknown pre-tokenizer"):
        gguf_tokenizer_fields(tmp_path / "prefix.json")
    wp = Tokenizer(models.WordPiece({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    wp.save(str(tmp_path / "wp.json"))
    with pytest.raises(LoadError, match=r"wp\.json: model type 'WordPiece'"):
        gguf_tokenizer_fields(tmp_path / "wp.json")
    with pytest.raises(LoadError, match=r"nope\.json: missing"):
        gguf_tokenizer_fields(tmp_path / "nope.json")


def test_fields_pad_to_vocab_size(tmp_path):
    fields = gguf_tokenizer_fields(MODEL_DIR / "tokenizer.json", config={"vocab_size": 4100, "eos_token_id": [0, 1]})
    assert len(fields["tokens"]) == 4100 and fields["tokens"][4096:] == [f"[PAD{i}]" for i in range(4096, 4100)]
    assert fields["token_types"][4096:] == [5] * 4 and fields["eos_token_id"] == 0
    tok, _ = _through_gguf(tmp_path, fields)
    ref = Tokenizer.from_file(str(MODEL_DIR / "tokenizer.json"))
    _assert_same(ref, tok, EDGE_TEXTS)


def test_bos_eos_template_with_odd_token_strings():
    meta = {"model": "gpt2", "pre": "gpt-2", "tokens": ["a", "b", "ab", "<s x>", "<|a:b|>"],
            "token_types": [1, 1, 1, 3, 3], "merges": ["a b"], "add_bos_token": True, "bos_token_id": 3,
            "add_eos_token": True, "eos_token_id": 4}
    tok = tokenizer_from_gguf(meta)
    enc = tok.encode("aba")
    assert enc.ids == [3, 2, 0, 4] and enc.tokens == ["<s x>", "ab", "a", "<|a:b|>"]
    assert tok.encode("aba", add_special_tokens=False).ids == [2, 0]
    assert tok.encode("ab", "b").ids == [3, 2, 4, 3, 1, 4]
    assert tok.decode(enc.ids) == "aba" and tok.decode(enc.ids, skip_special_tokens=False) == "<s x>aba<|a:b|>"
    assert tokenizer_from_gguf(dict(meta, add_eos_token=False)).encode("ab").ids == [3, 2]
