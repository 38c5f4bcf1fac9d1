"""`freetoken run` end to end on a tiny HF checkpoint with its own BPE tokenizer."""

import json

import pytest

from freetoken.cli import main
from freetoken.testing.oracles import need
from freetoken.trace.format import load_trace


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    torch, transformers = need("torch"), need("transformers")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    path = tmp_path_factory.mktemp("tiny")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["def f(x):\n    return x + 1\n", "for i in range(10):\n    print(i)\n"] * 20, trainer)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    torch.manual_seed(0)
    cfg = transformers.Qwen3MoeConfig(vocab_size=tok.get_vocab_size(), hidden_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8,
                                      num_experts_per_tok=2, moe_intermediate_size=32, intermediate_size=96,
                                      max_position_embeddings=256, eos_token_id=0)
    transformers.Qwen3MoeForCausalLM(cfg).save_pretrained(path)
    return path


@pytest.mark.parametrize("dev", ["cpu", "emu"])
def test_run_streams_and_reports(model_dir, capsys, dev):
    from freetoken.device import device_status

    if not device_status()[dev][0]:
        pytest.skip(f"{dev} unavailable")
    extra = ["--cache-slots", "16"] if dev == "emu" else []
    assert main(["run", "--model", str(model_dir), "--device", dev, "--max-tokens", "6", "--seed", "0", *extra,
                 "def f(x):"]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("def f(x):")
    assert f"[{dev}] prefill" in err and "decode at" in err and "tok/s" in err
    # 16 slots hold all 2 x 8 experts: the policy is lru
    assert ("expert cache: 16 slots (lru), hit rate" in err) if dev == "emu" else ("read in place" in err)


def test_record_trace(model_dir, tmp_path, capsys):
    trace_path = tmp_path / "t.npz"
    assert main(["run", "--model", str(model_dir), "--device", "cpu", "--max-tokens", "5", "--temperature", "0",
                 "--record-trace", str(trace_path), "for i in"]) == 0
    trace = load_trace(trace_path)
    assert trace.num_layers == 2 and trace.num_experts == 8 and trace.top_k == 2
    assert trace.steps == 4  # 5 tokens: the first from the prefill, 4 from decode steps
    counts = trace.prefill_counts.sum()
    assert counts > 0 and counts % (2 * 2) == 0  # every prompt token routed to top-2 in both MoE layers
    assert main(["trace", "info", str(trace_path)]) == 0


def test_bad_model_path(tmp_path, capsys):
    assert main(["run", "--model", str(tmp_path / "nope"), "hello"]) == 2
    assert "no such model directory" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.parametrize("family", ["glm4_moe", "gpt_oss", "deepseek_v3", "deepseek_v2", "minimax_m2"])
def test_run_the_new_families_from_hf_and_gguf(family, tmp_path, capsys):
    """`freetoken run --model DIR` on cpu and emu and `--model FILE.gguf` (our converter's file) on cpu, for each of
    the families issue 15 added and MiniMax-M2: a continuation streams, the HF and GGUF greedy tokens agree (an f32
    export), and a checkpoint that declares multi-token-prediction layers says they are skipped."""
    import shutil
    import warnings

    need("torch")
    from tiny_models import GGUF_OVERRIDES, make_checkpoint

    from freetoken.convert import export_gguf
    from freetoken.engine.loading.load import DEFAULT_MODEL

    hf = tmp_path / "hf"
    make_checkpoint(family, hf, vocab_size=4096, **GGUF_OVERRIDES.get(family, {}))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(DEFAULT_MODEL / name, hf / name)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        export_gguf(hf, tmp_path / "m.gguf", experts="f32", other="f32")
    outs = {}
    for key, model, dev in (("hf", hf, "cpu"), ("emu", hf, "emu"), ("gguf", tmp_path / "m.gguf", "cpu")):
        rc = main(["run", "--model", str(model), "--device", dev, "--max-tokens", "6", "--temperature", "0",
                   "def f(x):"])
        out = capsys.readouterr()
        assert rc == 0, out.err
        outs[key] = out
    assert outs["hf"].out == outs["gguf"].out and outs["hf"].out.startswith("def f(x):")
    mtp = "multi-token-prediction layer(s)"
    assert (mtp in outs["hf"].err) == (family in ("glm4_moe", "deepseek_v3")), outs["hf"].err
