"""Our GGUF export and loader against llama.cpp itself (llama-cpp-python) on the same Q4_0 file: each family's
tiny random checkpoint (with the bundled tokenizer, so llama.cpp accepts the vocabulary) and the bundled model.
Measured: NMSE 3e-5 (qwen3_moe), 1e-5 (qwen2_moe), 8e-6 (olmoe), 7e-4 (mixtral: one decode step's router flips,
the other 23 tokens ~3e-5), 3.5e-5 (glm4_moe: sigmoid group routing, partial rotary), 4.6e-5 (gpt_oss: sinks,
windows, biases, the clamped SwiGLU), 5e-5 (deepseek_v3: latent attention, YaRN mscale), 5.7e-5 (qwen3_next) and
4.0e-5 (qwen3_5_moe: Gated DeltaNet layers, gated attention; these two with F32 non-expert matrices, see OTHER),
3.0e-5 (minimax_m2: q/k norms over the projection, partial rotary, sigmoid router with a selection bias),
1.8e-5 for the bundled model with identical tokenization. The hybrid families' files made by llama.cpp's own
converter (F32, where freetoken's logits are the HF directory's exactly): 1.5e-5 (qwen3_next; its largest token,
1e-4, is the first decode step after the prompt), 2.3e-5 (qwen3_5_moe) and 3.0e-6 (minimax_m2): llama.cpp's F32 run
of the same numbers.

llama.cpp quantizes the activations to Q8_0 for its Q4_0 matmuls, so the logits differ by that rounding, not
more: the bound is on NMSE over a 16-token prompt and 8 decode steps through our KV cache, which stores float16 keys
and values here as llama.cpp's cache does by default. Where llama-cpp-python
is not installed the module is skipped locally and fails in CI (`bash scripts/setup --llama-cpp` builds it)."""

import shutil

import numpy as np
import pytest
from llama_oracle import llama_logits
from tiny_models import QWEN35_ROPE

from freetoken.convert import export_gguf
from freetoken.engine.loading.load import DEFAULT_MODEL, load
from freetoken.testing.oracles import need

llama_cpp = need("llama_cpp", "bash scripts/setup --llama-cpp builds it")  # every test compares with llama.cpp
pytestmark = pytest.mark.llama_cpp
PROMPT, STEPS = 16, 8


def _ours(path, tokens, cpu_activations="auto"):
    # llama.cpp's default KV cache type: the same roundings
    model = load(path, device="cpu", kv_dtype="f16", cpu_activations=cpu_activations)
    dec = model.decoder
    dec.reset()
    out = [dec.forward(tokens[:PROMPT])]
    out += [dec.forward(tokens[i:i + 1]) for i in range(PROMPT, PROMPT + STEPS)]
    return np.concatenate(out), model


def _compare(path, tokens, cpu_activations="auto"):
    ours, _ = _ours(path, tokens, cpu_activations)
    theirs, _ = llama_logits(path, tokens)
    per_token = ((ours - theirs) ** 2).sum(-1) / (theirs**2).sum(-1)
    # a router near-tie that Q8_0 activations flip moves one token's logits a lot; every other token stays close
    assert (per_token < 2e-4).mean() >= 0.9, per_token
    nmse = float(((ours - theirs) ** 2).sum() / (theirs**2).sum())
    top1 = float((ours.argmax(-1) == theirs.argmax(-1)).mean())
    return nmse, top1


#: What llama.cpp's graphs assume: qwen3moe and qwen3next have no dense layers, OLMoE's k_norm spans all heads (no
#: GQA); qwen35moe (and qwen3next) size the linear-attention value heads by the key head dim (ssm.state_size: a file
#: with other value heads fails to load), and ggml's multi-section RoPE asserts that the sections sum to at most the
#: head dim (an abort, which would take the test process with it): the released models' shapes, in small.
LLAMA_CPP_SHAPES = {"qwen3_moe": dict(mlp_only_layers=[]), "olmoe": dict(num_key_value_heads=4),
                    "qwen3_next": dict(mlp_only_layers=[]),
                    "qwen3_5_moe": dict(linear_value_head_dim=16, rope_parameters=QWEN35_ROPE)}


def _checkpoint(family, hf):
    """A tiny ``family`` checkpoint llama.cpp runs, with the bundled tokenizer, at ``hf``."""
    from tiny_models import GGUF_OVERRIDES, LLAMA_CPP_OVERRIDES, make_checkpoint

    make_checkpoint(family, hf, vocab_size=4096, **LLAMA_CPP_SHAPES.get(family, {}),
                    **GGUF_OVERRIDES.get(family, {}), **LLAMA_CPP_OVERRIDES.get(family, {}))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(DEFAULT_MODEL / name, hf / name)
    return hf


#: The non-expert type of our export per family (f16 unless named). llama.cpp rounds the activations of an F16
#: matmul to f16 (freetoken keeps them float32), and those small input changes flip some of the Q8_0 roundings of
#: the q4_0 experts' inputs: in the attention-only families that stays within the bound; the Gated DeltaNet layers
#: carry it in their recurrent state (measured with f16: qwen3_next 11 of 24 tokens above 2e-4 per token, up to 9e-4,
#: and a router flip; qwen3_5_moe 7 of 24, NMSE 6.9e-4). With F32 matrices only the experts' Q8_0 inputs differ from
#: a float run, alike on both sides.
OTHER = {"qwen3_next": "f32", "qwen3_5_moe": "f32"}


# 1.5-5 s each: the quick tier keeps qwen3_moe
@pytest.mark.parametrize("family", ["qwen3_moe", *(pytest.param(f, marks=pytest.mark.slow)
                                                   for f in ("qwen2_moe", "mixtral", "olmoe", "glm4_moe",
                                                             "gpt_oss", "deepseek_v3", "deepseek_v2", "qwen3_next",
                                                             "qwen3_5_moe", "minimax_m2"))])
def test_tiny_families_match_llama_cpp(family, tmp_path):
    need("torch")
    need("transformers")
    _checkpoint(family, tmp_path / "hf")
    export_gguf(tmp_path / "hf", tmp_path / "m.gguf", experts="q4_0", other=OTHER.get(family, "f16"))
    tokens = np.random.default_rng(3).integers(2, 4096, PROMPT + STEPS)
    nmse, top1 = _compare(tmp_path / "m.gguf", tokens)
    assert nmse < 1e-3 and top1 >= 0.9, (nmse, top1)


# The converter's own files of the hybrid families (Gated DeltaNet layers) in llama.cpp and in freetoken. F32: its
# Q8_0 files make llama.cpp round every matmul's activations to Q8_0 (freetoken's Q8_0 matrices take them as float32),
# which the recurrent state carries: 2e-4 at the first token, 1e-3 .. 6e-2 further on (measured, qwen3_next)
@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5_moe", "minimax_m2"])
def test_llama_cpp_converter_files_match_llama_cpp(family, tmp_path):
    need("torch")
    need("transformers")
    from llama_convert import convert

    hf = _checkpoint(family, tmp_path / "hf")
    # (the hybrid converters want --no-mtp for checkpoints without an MTP block, as the tiny ones are)
    path = convert(hf, tmp_path / "m.gguf", "f32", ("--no-mtp",) if family != "minimax_m2" else ())
    tokens = np.random.default_rng(3).integers(2, 4096, PROMPT + STEPS)
    # llama.cpp multiplies an F32 file's matrices by float32 activations: so does our float path (the default would
    # give the experts bf16 tokens, whose rounding the recurrent state carries on)
    nmse, top1 = _compare(path, tokens, cpu_activations="f32")
    assert nmse < 1e-3 and top1 >= 0.9, (nmse, top1)


@pytest.mark.slow
def test_bundled_model_matches_llama_cpp(tmp_path):
    export_gguf(DEFAULT_MODEL, tmp_path / "default.gguf")
    text = "import os\n\ndef walk(top):\n    for name in os.listdir(top):\n        yield name\n"
    model = load(tmp_path / "default.gguf", device="cpu")
    tokens = np.asarray(model.encode(text)[: PROMPT + STEPS])
    assert tokens.size == PROMPT + STEPS
    _, llm = llama_logits(tmp_path / "default.gguf", tokens)
    assert llm.tokenize(text.encode(), add_bos=False, special=False)[: tokens.size] == tokens.tolist()
    nmse, top1 = _compare(tmp_path / "default.gguf", tokens)
    assert nmse < 1e-4 and top1 == 1.0, (nmse, top1)
