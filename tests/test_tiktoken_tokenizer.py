"""Kimi-K2's tiktoken tokenizer (``tiktoken.model`` + ``tokenizer_config.json``, no ``tokenizer.json``) rebuilt as a
``tokenizers.Tokenizer``, against tiktoken itself (the encoder Moonshot's own tokenizer runs, with Moonshot's split
regex and ``allowed_special="all"``), and through GGUF ("kimi-k2") to llama.cpp.

The ranks are made from the bundled model's byte-level BPE (its merges in order, so every token is reachable, as in
a trained tiktoken vocabulary) plus a few Han tokens, so that Moonshot's Han split and its cased-word splits both
change token boundaries."""

import base64
import json
import shutil

import pytest
from test_gguf_tokenizer import EDGE_TEXTS, MODEL_DIR, _stdlib_texts

from freetoken.loaders import LoadError
from freetoken.loaders.gguf_tokenizer import KIMI_K2_SPLIT, gguf_tokenizer_fields, tokenizer_from_gguf
from freetoken.loaders.tiktoken_tokenizer import (
    SPECIAL_COUNT,
    byte_level_alphabet,
    read_ranks,
    tokenizer_from_tiktoken,
)
from freetoken.testing.oracles import need

tiktoken = need("tiktoken")

HAN = ["你好", "世界", "中文", "你好世界", "模型"]
NAMES = {0: "[BOS]", 1: "[EOS]", 2: "<|im_end|>", 3: "<|im_user|>", 4: "<|im_assistant|>", 7: "<|im_system|>"}
KIMI_TEXTS = ["Hello World你好世界abc中文 It's 12345 ÉCOLE déjà  \n\n  x",
              "[BOS]<|im_user|>user<|im_middle|>hi<|im_end|><|im_assistant|>",
              "I'LL DON'T can't We'Re HTTPServer getURLForKey XMLHttpRequest",
              "模型的输出是:\n```python\nprint('你好')\n```", "1234567 a1b2 3.14159 ½ ² ٣"]


def _ranks() -> dict[bytes, int]:
    inv = {c: b for b, c in byte_level_alphabet().items()}
    tok = json.loads((MODEL_DIR / "tokenizer.json").read_text())
    ranks = {bytes([b]): b for b in range(256)}
    for m in tok["model"]["merges"]:
        a, b = m if isinstance(m, list) else m.split(" ")
        ranks.setdefault(bytes(inv[c] for c in a) + bytes(inv[c] for c in b), len(ranks))
    for h in HAN:  # each character by merges of its UTF-8 bytes, then the word: reachable as trained tokens are
        for c in h:
            b = c.encode()
            for end in range(2, len(b) + 1):
                ranks.setdefault(b[:end], len(ranks))
        ranks.setdefault(h.encode(), len(ranks))
    return ranks


def write_kimi_tokenizer(path, ranks=None) -> dict[bytes, int]:
    """A Kimi-style tokenizer directory at ``path`` (tiktoken.model, tokenizer_config.json); returns the ranks."""
    ranks = _ranks() if ranks is None else ranks
    path.mkdir(parents=True, exist_ok=True)
    lines = sorted(ranks.items(), key=lambda kv: kv[1])
    (path / "tiktoken.model").write_text("".join(f"{base64.b64encode(t).decode()} {r}\n" for t, r in lines))
    n = len(ranks)
    (path / "tokenizer_config.json").write_text(json.dumps({
        "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]},
        "bos_token": "[BOS]", "eos_token": "[EOS]",
        "added_tokens_decoder": {str(n + i): {"content": c, "special": True} for i, c in NAMES.items()}}))
    return ranks


def _oracle(ranks):
    n = len(ranks)
    special = {f"<|reserved_token_{i}|>": i for i in range(n, n + SPECIAL_COUNT) if i - n not in NAMES}
    special.update({c: n + i for i, c in NAMES.items()})
    return tiktoken.Encoding("kimi-test", pat_str=KIMI_K2_SPLIT, mergeable_ranks=ranks, special_tokens=special)


@pytest.fixture(scope="module")
def kimi(tmp_path_factory):
    root = tmp_path_factory.mktemp("kimi")
    ranks = write_kimi_tokenizer(root)
    return root, ranks, _oracle(ranks)


def _first_difference(got, want) -> int:
    return next(i for i, (a, b) in enumerate(zip(got + [-1], want + [-2], strict=False)) if a != b)


def _check_same(tok, enc, texts) -> int:
    count = 0
    for text in texts:
        want = enc.encode(text, allowed_special="all")
        got = tok.encode(text, add_special_tokens=False).ids
        assert got == want, (text[:200], _first_difference(got, want))
        assert tok.decode(got, skip_special_tokens=False) == text
        count += len(want)
    return count


def test_encodes_as_tiktoken(kimi):
    root, _, enc = kimi
    tok = tokenizer_from_tiktoken(root)
    n = _check_same(tok, enc, EDGE_TEXTS + KIMI_TEXTS + _stdlib_texts(400_000))
    assert n > 80_000  # the comparison covered real code, not only the hand-written lines


def test_special_tokens_ids_and_decoding(kimi):
    root, ranks, _ = kimi
    tok = tokenizer_from_tiktoken(root)
    n = len(ranks)
    assert tok.get_vocab_size() == n + SPECIAL_COUNT
    assert tok.token_to_id("<|im_end|>") == n + 2 and tok.token_to_id(f"<|reserved_token_{n + 5}|>") == n + 5
    ids = tok.encode("a<|im_end|>b").ids
    assert n + 2 in ids and tok.decode(ids) == "ab"  # specials matched whole, skipped when decoding


def test_gguf_round_trip_is_kimi_k2(kimi, tmp_path):
    """The tokenizer written as GGUF fields is llama.cpp's "kimi-k2" pre-tokenizer and reads back the same."""
    root, ranks, enc = kimi
    fields = gguf_tokenizer_fields(root / "tiktoken.model", root / "tokenizer_config.json",
                                   tokenizer=tokenizer_from_tiktoken(root))
    assert fields["pre"] == "kimi-k2" and len(fields["tokens"]) == len(ranks) + SPECIAL_COUNT
    assert fields["bos_token_id"] == len(ranks) and fields["eos_token_id"] == len(ranks) + 1
    _check_same(tokenizer_from_gguf(fields), enc, EDGE_TEXTS + KIMI_TEXTS + _stdlib_texts(100_000))


@pytest.mark.slow
def test_kimi_checkpoint_loads_and_llama_cpp_reads_its_gguf(kimi, tmp_path):
    """A DeepSeek-V3 checkpoint with Kimi's tokenizer files: freetoken.load tokenizes as tiktoken, so does the GGUF
    file freetoken's converter writes from it, and llama.cpp (vocab only) reads that file's vocabulary and merges
    as tiktoken's: every piece of Moonshot's split gets tiktoken's ids, special tokens their ids.

    Whole texts are compared per piece because llama.cpp's own "kimi-k2" split keeps a CamelCase word whole
    (" RuntimeError" in the stdlib sources is one llama.cpp piece) where Moonshot's regex, which the model was
    trained with and freetoken follows, cuts it at the case change (" Runtime", "Error")."""
    need("torch")
    need("transformers")
    llama_cpp = need("llama_cpp", "bash scripts/setup --llama-cpp builds it")
    from tiny_models import make_checkpoint
    from tokenizers import Regex, pre_tokenizers

    from freetoken.convert import export_gguf
    from freetoken.engine.loading.load import load

    root, ranks, enc = kimi
    make_checkpoint("deepseek_v3", tmp_path / "hf", vocab_size=len(ranks) + SPECIAL_COUNT)
    for name in ("tiktoken.model", "tokenizer_config.json"):
        shutil.copy(root / name, tmp_path / "hf" / name)
    model = load(tmp_path / "hf", device="cpu")
    texts = EDGE_TEXTS + KIMI_TEXTS + _stdlib_texts(60_000)
    _check_same(model.tokenizer, enc, texts)
    assert model.tokenizer.token_to_id("[EOS]") in model.eos_ids
    export_gguf(tmp_path / "hf", tmp_path / "m.gguf")
    gguf_model = load(tmp_path / "m.gguf", device="cpu")
    _check_same(gguf_model.tokenizer, enc, texts)
    assert model.tokenizer.token_to_id("[EOS]") in gguf_model.eos_ids

    llm = llama_cpp.Llama(str(tmp_path / "m.gguf"), vocab_only=True, verbose=False)
    split = pre_tokenizers.Split(Regex(KIMI_K2_SPLIT), behavior="isolated", invert=False)
    pieces = 0
    for text in texts:
        for _, (a, b) in split.pre_tokenize_str(text):
            piece = text[a:b]
            assert llm.tokenize(piece.encode(), add_bos=False, special=False) == enc.encode_ordinary(piece), piece
            pieces += 1
    assert pieces > 10_000
    n = len(ranks)
    assert llm.tokenize(b"a<|im_end|>b", add_bos=False, special=True) == enc.encode("a<|im_end|>b",
                                                                                    allowed_special="all")
    assert llm.token_bos() == n and llm.token_eos() == n + 1


@pytest.mark.parametrize("content, match", [
    (b"QUJD 0\nnot-base64! 1\n", r"line 2: not 'base64-token rank'"),
    (b"QQ== 0\nQQ== 1\n", r"line 2: a repeated token"),
    (b"QQ== 0\nQg== 2\n", r"ranks are not 0\.\.1"),
    (b"QQ== 0\nQg== 1\n", r"254 single bytes are not tokens \(first: 0x00\)"),
])
def test_bad_ranks_name_the_file(tmp_path, content, match):
    (tmp_path / "tiktoken.model").write_bytes(content)
    with pytest.raises(LoadError, match=match) as e:
        read_ranks(tmp_path / "tiktoken.model")
    assert str(tmp_path / "tiktoken.model") in str(e.value)


def test_unknown_tiktoken_tokenizer_is_refused(kimi, tmp_path):
    root, _, _ = kimi
    shutil.copy(root / "tiktoken.model", tmp_path / "tiktoken.model")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"auto_map": {"AutoTokenizer": ["tok.Other", None]}}))
    with pytest.raises(LoadError, match="unknown split regex"):
        tokenizer_from_tiktoken(tmp_path)
