"""`freetoken chat`: chat templates rendered as transformers renders them, KV-cache prefix reuse, the CLI."""

import io
import json
import re
import shutil

import numpy as np
import pytest
from reuse_checks import assert_reuse_close
from scripted_decoder import ScriptedDecoder

from freetoken.cli import main
from freetoken.engine.decoding.sampling import SamplingParams
from freetoken.engine.generation.chat import CHATML_TEMPLATE, Chat, ChatTemplate
from freetoken.engine.generation.generate import Model
from freetoken.engine.loading.load import DEFAULT_MODEL, load
from freetoken.testing.oracles import need

GREEDY = SamplingParams(temperature=0)

# Templates in the style of real models' (whitespace control, namespaces, helpers, bos/eos tokens).
QWEN_STYLE = (
    "{%- if messages[0]['role'] == 'system' %}\n"
    "    {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}\n"
    "{%- else %}\n"
    "    {{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}\n"
    "{%- endif %}\n"
    "{%- for message in messages %}\n"
    "    {%- if (message.role == 'user') or (message.role == 'system' and not loop.first) "
    "or (message.role == 'assistant') %}\n"
    "        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}\n"
    "    {%- endif %}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|im_start|>assistant\\n' }}\n"
    "{%- endif %}\n"
)
LLAMA3_STYLE = (
    "{{- bos_token }}\n"
    "{%- if not date_string is defined %}\n"
    "    {%- set date_string = strftime_now('%d %b %Y') %}\n"
    "{%- endif %}\n"
    "{%- if messages[0]['role'] == 'system' %}\n"
    "    {%- set system_message = messages[0]['content']|trim %}\n"
    "    {%- set messages = messages[1:] %}\n"
    "{%- else %}\n"
    "    {%- set system_message = '' %}\n"
    "{%- endif %}\n"
    "{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' }}\n"
    "{{- 'Today Date: ' + date_string + '\\n\\n' }}\n"
    "{{- system_message }}\n"
    "{{- '<|eot_id|>' }}\n"
    "{%- set ns = namespace(turns=0) %}\n"
    "{%- for message in messages %}\n"
    "    {%- set ns.turns = ns.turns + 1 %}\n"
    "    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim "
    "+ '<|eot_id|>' }}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}\n"
    "{%- endif %}\n"
)
GEMMA_STYLE = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
    "{% endif %}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if (message['role'] == 'assistant') %}{% set role = 'model' %}{% else %}{% set role = message['role'] %}"
    "{% endif %}{{ '<start_of_turn>' + role + '\\n' + message['content'] | trim + '<end_of_turn>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{'<start_of_turn>model\\n'}}{% endif %}"
)
MISTRAL_STYLE = (  # block tags on their own lines: trim_blocks/lstrip_blocks decide the whitespace
    "{{ bos_token }}\n"
    "{% for message in messages %}\n"
    "    {% if message['role'] == 'user' %}\n"
    "        {{ '[INST] ' + message['content'] + ' [/INST]' }}\n"
    "    {% elif message['role'] == 'assistant' %}\n"
    "        {{ message['content'] + eos_token }}\n"
    "    {% endif %}\n"
    "{% endfor %}\n"
)

WITH_SYSTEM = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi there"},
               {"role": "assistant", "content": "Hello! How can I help?"},
               {"role": "user", "content": " What is 2 + 2? "}]
NO_SYSTEM = WITH_SYSTEM[1:]


def _tiny_tokenizer_dir(path, config: dict, template_file: str | None = None):
    """A byte-level BPE tokenizer (tokenizers) with the chat special tokens, and a tokenizer_config.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    specials = ["<s>", "</s>", "<|im_start|>", "<|im_end|>", "<|start_header_id|>", "<|end_header_id|>",
                "<|eot_id|>", "<start_of_turn>", "<end_of_turn>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["Hello! How can I help? What is 2 + 2? You are terse."] * 10, trainer)
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>", **config}
    (path / "tokenizer_config.json").write_text(json.dumps(cfg))
    if template_file is not None:
        (path / "chat_template.jinja").write_text(template_file)
    return path


def _hf_render(path, messages):
    transformers = need("transformers")
    tok = transformers.PreTrainedTokenizerFast.from_pretrained(str(path))
    return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


@pytest.mark.parametrize("name, template, messages, stop", [
    ("qwen", QWEN_STYLE, WITH_SYSTEM, ["<|im_end|>"]),
    ("qwen-no-system", QWEN_STYLE, NO_SYSTEM, ["<|im_end|>"]),
    ("llama3", LLAMA3_STYLE, WITH_SYSTEM, ["<|eot_id|>"]),
    ("gemma", GEMMA_STYLE, NO_SYSTEM, ["<end_of_turn>"]),
    ("mistral", MISTRAL_STYLE, NO_SYSTEM, ["</s>"]),
    ("chatml-fallback", CHATML_TEMPLATE, WITH_SYSTEM, ["<|im_end|>"]),
])
def test_template_matches_transformers(tmp_path, name, template, messages, stop):
    path = _tiny_tokenizer_dir(tmp_path / name, {"chat_template": template})
    tpl = ChatTemplate.from_dir(path)
    assert tpl is not None and tpl.source == template
    assert tpl.special_tokens["bos_token"] == "<s>" and tpl.special_tokens["eos_token"] == "</s>"
    ours = tpl.render(messages)
    assert ours == _hf_render(path, messages)
    assert tpl.stop_strings() == stop


def test_template_sources(tmp_path):
    # A list of named templates: "default" is used (as transformers does without tools).
    listed = _tiny_tokenizer_dir(tmp_path / "listed", {"chat_template": [
        {"name": "tool_use", "template": "TOOLS {{ messages[0]['content'] }}"},
        {"name": "default", "template": GEMMA_STYLE}]})
    assert ChatTemplate.from_dir(listed).render(NO_SYSTEM) == _hf_render(listed, NO_SYSTEM)
    # chat_template.jinja wins over tokenizer_config.json, as in transformers.
    jinja = _tiny_tokenizer_dir(tmp_path / "jinja", {"chat_template": GEMMA_STYLE}, template_file=LLAMA3_STYLE)
    tpl = ChatTemplate.from_dir(jinja)
    assert tpl.source == LLAMA3_STYLE and tpl.render(WITH_SYSTEM) == _hf_render(jinja, WITH_SYSTEM)
    # No template at all.
    assert ChatTemplate.from_dir(_tiny_tokenizer_dir(tmp_path / "none", {})) is None
    # The bundled model's trivial template (one line per message) and its tokenizer_config.json special tokens.
    bundled = ChatTemplate.from_dir(DEFAULT_MODEL)
    assert bundled.render(NO_SYSTEM) == "Hi there\nHello! How can I help?\n What is 2 + 2? \n"
    assert bundled.stop_strings() == [] and bundled.special_tokens == {"eos_token": "<|endoftext|>",
                                                                       "pad_token": "<|pad|>"}


def test_template_errors_and_sandbox():
    with pytest.raises(ValueError, match="System role not supported"):
        ChatTemplate(GEMMA_STYLE).render(WITH_SYSTEM)
    with pytest.raises(ValueError, match="unsafe|access"):
        ChatTemplate("{{ messages.__class__.__mro__ }}").render(NO_SYSTEM)
    with pytest.raises(ValueError):  # the immutable sandbox: no mutating the caller's data
        ChatTemplate("{{ messages.append(1) }}").render(NO_SYSTEM)
    with pytest.raises(ValueError):
        ChatTemplate("")


# ---- prefix reuse in Model.generate ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def model():
    return load(None, device="cpu")


def _spy_forward(model):
    """Record the tokens and logits of every forward pass of the model's step loop (generation runs one sequence:
    each pass has one item)."""
    calls = []
    forward_batch = model.decoder.forward_batch

    def spy(work):
        out = forward_batch(work)
        (_, ids), = work
        calls.append((np.asarray(ids).copy(), out))
        return out

    model.decoder.forward_batch = spy
    return calls


def _restore(model):
    del model.decoder.forward_batch  # back to the class's method


def _check_reuse(model, first: list[int], second: list[int], expect_cached: int):
    """generate(first) then generate(second, reuse_cache=True): logits and greedy tokens as a fresh prefill's."""
    gen1 = list(model.generate(first, max_tokens=5, sampling=GREEDY))
    assert model.cached_ids == first + gen1[:-1] and model.decoder.length == len(model.cached_ids)
    calls = _spy_forward(model)
    try:
        cont = list(gen := model.generate(second, max_tokens=8, sampling=GREEDY, reuse_cache=True))
    finally:
        _restore(model)
    st = gen.stats
    assert st.cached_tokens == expect_cached and st.prompt_tokens == len(second) - expect_cached
    assert list(calls[0][0]) == second[expect_cached:]  # only the new tail was prefilled
    reused_last = calls[0][1][-1]
    fresh_last = model.logits(second)[-1]
    # the reused keys were written by decode steps (one-row products), the fresh ones by a prefill: float32 rounding
    # apart, amplified through the layers by the bf16 KV cache; which elements round to a neighbouring bf16 value
    # follows the machine's SIMD level (5.5e-5 of the scale on one AVX-512 machine), so the shared bound
    assert_reuse_close(reused_last, fresh_last)
    assert cont == list(gen := model.generate(second, max_tokens=8, sampling=GREEDY))  # fresh prefill, same tokens
    assert gen.stats.cached_tokens == 0 and gen.stats.prompt_tokens == len(second)


def test_reuse_extends_previous_prompt(model):
    first = model.encode("def add(a, b):\n    return")
    second = first + model.encode(" a + b\n\n\ndef sub(a, b):\n")
    # Cached: first + 4 of the 5 generated tokens; the greedy continuation of "return" need not match " a + b".
    gen = list(model.generate(first, max_tokens=5, sampling=GREEDY))
    cached = first + gen[:-1]
    common = next((i for i, (a, b) in enumerate(zip(cached, second, strict=False)) if a != b),
                  min(len(cached), len(second)))
    _check_reuse(model, first, second, expect_cached=common)
    assert common >= len(first)


def test_reuse_continues_after_generated_tokens(model):
    first = model.encode("import os\nimport sys\n")
    gen = list(model.generate(first, max_tokens=5, sampling=GREEDY))
    second = first + gen[:-1] + model.encode("\nclass Foo:\n")  # the whole cached sequence, then more
    _check_reuse(model, first, second, expect_cached=len(first) + 4)


def test_rollback_when_prompt_diverges(model):
    first = model.encode("for i in range(10):\n    print(i)\n")
    second = first[:5] + model.encode(" while True:\n    pass\n")
    assert second[5] != first[5]
    _check_reuse(model, first, second, expect_cached=5)


def test_whole_prompt_cached_feeds_the_last_token_again(model):
    prompt = model.encode("x = 1\ny = 2\n")
    a = list(model.generate(prompt, max_tokens=4, sampling=GREEDY))
    b = list(gen := model.generate(prompt, max_tokens=4, sampling=GREEDY, reuse_cache=True))
    assert a == b and gen.stats.cached_tokens == len(prompt) - 1 and gen.stats.prompt_tokens == 1


def test_stopping_early_keeps_cache_bookkeeping(model):
    prompt = model.encode("def f(x):\n")
    stream = model.generate(prompt, max_tokens=10, sampling=GREEDY)
    got = [next(stream), next(stream), next(stream)]
    stream.close()
    assert model.cached_ids == prompt + got[:2] and model.decoder.length == len(prompt) + 2
    again = list(gen := model.generate(prompt + got, max_tokens=3, sampling=GREEDY, reuse_cache=True))
    assert gen.stats.cached_tokens == len(prompt) + 2 and gen.stats.prompt_tokens == 1
    assert again == list(model.generate(prompt + got, max_tokens=3, sampling=GREEDY))


def test_default_generate_is_unchanged(model):
    prompt = model.encode("def f(x):\n")
    list(model.generate(prompt, max_tokens=3, sampling=GREEDY))
    list(gen := model.generate(prompt, max_tokens=3, sampling=GREEDY))  # no reuse_cache: a full prefill
    assert gen.stats.cached_tokens == 0 and gen.stats.prompt_tokens == len(prompt)


# ---- Chat -----------------------------------------------------------------------------------------------------------
def test_chat_reuses_the_cache_across_turns(model):
    model.decoder.reset()  # rows of earlier tests: none are reused
    model.prefix_cache.clear()
    chat = Chat(model)
    assert not chat.uses_fallback and chat.stop == []
    reply1 = "".join(turn := chat.send("def add(a, b):", max_tokens=12, sampling=GREEDY))
    assert turn.stats.cached_tokens == 0
    assert chat.messages == [{"role": "user", "content": "def add(a, b):"},
                             {"role": "assistant", "content": reply1}]
    prompt2 = chat.template.render([*chat.messages, {"role": "user", "content": "def sub(a, b):"}])
    reply2 = "".join(turn := chat.send("def sub(a, b):", max_tokens=12, sampling=GREEDY))
    st = turn.stats
    assert st.cached_tokens > 0 and st.cached_tokens + st.prompt_tokens == len(
        model.encode(prompt2, add_special_tokens=False))
    # The reply is the one a fresh prefill of the whole conversation gives.
    fresh = "".join(model.generate_text(model.encode(prompt2, add_special_tokens=False), 12, GREEDY))
    assert reply2 == fresh and chat.messages[-1] == {"role": "assistant", "content": reply2}
    chat.reset()
    assert chat.messages == []


def test_chat_system_prompt_survives_reset(model):
    chat = Chat(model, system="# helpers")
    assert chat.messages == [{"role": "system", "content": "# helpers"}]
    "".join(chat.send("import os", max_tokens=3, sampling=GREEDY))
    chat.reset()
    assert chat.messages == [{"role": "system", "content": "# helpers"}]
    turn = chat.send("import sys", max_tokens=3, sampling=GREEDY)
    "".join(turn)
    assert turn.stats.cached_tokens >= len(model.encode("# helpers\n"))  # the system prompt's rows are reused


class ByteTokenizer:
    """Token i is byte i; token 7 stands for "<|im_end|>" when ``special`` (a single-token end-of-turn)."""

    def __init__(self, special=False):
        self.special = special

    class _Enc:
        def __init__(self, ids):
            self.ids = ids

    def encode(self, text, add_special_tokens=True):
        return self._Enc(list(text.encode()))

    def decode(self, ids):
        return bytes(ids).decode("utf-8", errors="replace")

    def token_to_id(self, text):
        return 7 if self.special and text == "<|im_end|>" else None


def test_chat_stops_at_end_of_turn_text():
    model = Model(ScriptedDecoder(b"Hel<lo <|im_end|>\nmore text"), ByteTokenizer(), eos_ids=[0])
    chat = Chat(model)
    assert chat.uses_fallback and chat.stop == ["<|im_end|>"]
    pieces = list(chat.send("hi", max_tokens=100, sampling=GREEDY))
    assert "".join(pieces) == "Hel<lo " and not any("<|" in p for p in pieces)
    assert chat.messages[-1] == {"role": "assistant", "content": "Hel<lo "}
    assert chat.prompt().endswith("<|im_start|>assistant\nHel<lo <|im_end|>\n<|im_start|>assistant\n")


def test_chat_stops_at_end_of_turn_token():
    model = Model(ScriptedDecoder(b"ok\x07never"), ByteTokenizer(special=True), eos_ids=[0])
    chat = Chat(model)
    assert "".join(chat.send("hi", max_tokens=100, sampling=GREEDY)) == "ok"
    prompt = model.encode(ChatTemplate.chatml().render([{"role": "user", "content": "hi"}]))
    assert model.cached_ids == prompt + [ord("o"), ord("k")]  # the end-of-turn token never ran


def test_chat_error_takes_the_message_back():
    model = Model(ScriptedDecoder(b"x"), ByteTokenizer(), eos_ids=[0])
    model.decoder.ctx = 20
    chat = Chat(model)
    with pytest.raises(ValueError, match="context"):
        "".join(chat.send("a long message that does not fit", max_tokens=4))
    assert chat.messages == []


# ---- CLI ------------------------------------------------------------------------------------------------------------
STATS = re.compile(r"prefill (\d+) new tokens at [\d.]+ tok/s, (\d+) cached tokens reused, generated (\d+) tokens")


def _chat(monkeypatch, capsys, stdin: str, *args):
    monkeypatch.setattr("sys.stdin", io.StringIO(stdin))
    rc = main(["chat", "--device", "cpu", "--temperature", "0", "--max-tokens", "6", *args])
    out, err = capsys.readouterr()
    return rc, out, err


def test_cli_chat_turns_reset_and_eof(monkeypatch, capsys):
    rc, out, err = _chat(monkeypatch, capsys, "def add(a, b):\n\nreturn a + b\n/reset\nimport os\n")
    assert rc == 0, err
    turns = [tuple(int(v) for v in m) for m in STATS.findall(err)]
    assert len(turns) == 3 and "(conversation reset)" in err and "warning" not in err
    assert turns[0][1] == 0 and turns[1][1] > 0  # the second turn reuses the first one's rows
    assert all(t[2] >= 1 for t in turns)
    assert out.count("\n") >= 3 and "> " not in out  # no prompt when stdin is not a terminal


def test_cli_chat_exit_command(monkeypatch, capsys):
    rc, out, err = _chat(monkeypatch, capsys, "def add(a, b):\n/exit\nnever sent\n", "--seed", "1")
    assert rc == 0 and len(STATS.findall(err)) == 1
    rc, out, err = _chat(monkeypatch, capsys, "/bogus\n")
    assert rc == 0 and "unknown command /bogus" in err


def test_cli_chat_fallback_template_warns(tmp_path, monkeypatch, capsys):
    path = tmp_path / "model"
    shutil.copytree(DEFAULT_MODEL, path, ignore=shutil.ignore_patterns("__*", "*.py", "*.md"))
    config = json.loads((path / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    rc, out, err = _chat(monkeypatch, capsys, "hello\n", "--model", str(path))
    assert rc == 0 and "no chat template; using ChatML" in err and len(STATS.findall(err)) == 1


def test_cli_chat_errors(tmp_path, monkeypatch, capsys):
    rc, out, err = _chat(monkeypatch, capsys, "hi\n", "--model", str(tmp_path / "nope"))
    assert rc == 2 and "freetoken chat: error:" in err and "no such model directory" in err
    path = tmp_path / "gemma"
    shutil.copytree(DEFAULT_MODEL, path, ignore=shutil.ignore_patterns("__*", "*.py", "*.md"))
    config = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": GEMMA_STYLE}))
    rc, out, err = _chat(monkeypatch, capsys, "hi\n", "--model", str(path), "--system", "be brief")
    assert rc == 2 and "freetoken chat: error:" in err and "System role not supported" in err
    rc, out, err = _chat(monkeypatch, capsys, "hi\n", "--temperature", "-1")
    assert rc == 2 and "temperature" in err


def test_chat_accepts_template_text_on_the_model():
    model = Model(ScriptedDecoder(b"fine"), ByteTokenizer(), eos_ids=[0], chat_template=MISTRAL_STYLE)
    chat = Chat(model)
    assert not chat.uses_fallback and chat.stop == []  # no eos token text known: nothing to stop on but eos ids
    assert "".join(chat.send("hi", max_tokens=20, sampling=GREEDY)) == "fine"
    assert chat.messages == [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "fine"}]
    assert "[INST] hi [/INST]" in chat.prompt() and "fine" in chat.prompt()
