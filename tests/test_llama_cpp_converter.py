"""GGUF files made by llama.cpp's own converter (``convert_hf_to_gguf.py``, as users make them) load and give the
logits of the HF directory they were converted from: the tensor names, metadata keys and layouts the converter
writes for each family are the ones freetoken reads. The converter runs through tests/llama_convert.py (its one
change: the test tokenizer's pre-tokenizer hash is named ``gpt-2``), writing F32, so the file holds the
checkpoint's numbers and the two loads differ only by what the loaders do."""

import json
import shutil

import numpy as np
import pytest
from tiny_models import GGUF_OVERRIDES

from freetoken.engine.loading.load import DEFAULT_MODEL, load
from freetoken.testing.oracles import need

pytestmark = pytest.mark.llama_cpp

#: Per family: overrides of the tiny checkpoint, and the special tokens the converter's vocabulary step asks the
#: tokenizer for (GLM's looks up [gMASK], <|user|>, <|endoftext|> and <|observation|> by name).
CASES = {
    "glm4_moe": (dict(), ("[gMASK]", "<|user|>", "<|observation|>")),
    "qwen3_moe": (dict(mlp_only_layers=[]), ()),
    "gpt_oss": (GGUF_OVERRIDES["gpt_oss"], ()),  # experts in F32: the converter's non-MXFP4 path
    # transformers' DeepseekV3Config has no scoring_func: without it written out the converter says nothing of the
    # gating and llama.cpp takes a deepseek2 file for DeepSeek-V2's softmax router (freetoken refuses such a file)
    "deepseek_v3": (dict(scoring_func="sigmoid"), ()),
    "deepseek_v2": (dict(topk_method="greedy", n_group=None, topk_group=None), ()),
    # the converter's qwen3next maps no dense MLP tensors (llama.cpp's has none): every layer MoE. The linear layers'
    # fused in_proj_qkvz is regrouped into attn_qkv + attn_gate, A_log stored as -exp(A_log), the norms as 1 + w
    "qwen3_next": (dict(mlp_only_layers=[]), ()),
    # value heads stored in llama.cpp's tiled order (2 key heads, 4 value heads), value head dim 24 != key head dim
    "qwen3_5_moe": (dict(), ()),
    # the converter reads the rotated dims from rotary_dim (which the tiny config keeps); q/k norms over the whole
    # projection, the selection bias as exp_probs_b
    "minimax_m2": (dict(), ()),
}
#: More converter options per family: the Qwen3-Next / Qwen3.5 converters export the checkpoint's multi-token-
#: prediction block and assert that there is one unless told --no-mtp (the tiny checkpoints have none).
CONVERTER_ARGS = {"qwen3_next": ("--no-mtp",), "qwen3_5_moe": ("--no-mtp",)}


def _tokenizer(dst, extra: tuple[str, ...]) -> int:
    """The bundled tokenizer in ``dst`` with ``extra`` special tokens appended; returns the vocabulary size."""
    tok = json.loads((DEFAULT_MODEL / "tokenizer.json").read_text())
    n = len(tok["model"]["vocab"])
    for j, content in enumerate(extra):
        tok["added_tokens"].append({"id": n + j, "content": content, "single_word": False, "lstrip": False,
                                    "rstrip": False, "normalized": False, "special": True})
    (dst / "tokenizer.json").write_text(json.dumps(tok))
    shutil.copy(DEFAULT_MODEL / "tokenizer_config.json", dst / "tokenizer_config.json")
    return n + len(extra)


@pytest.mark.parametrize("family", list(CASES))
def test_llama_cpp_converter_file_matches_the_hf_directory(family, tmp_path):
    need("torch")
    need("transformers")
    from llama_convert import convert
    from tiny_models import make_checkpoint

    overrides, extra = CASES[family]
    hf = tmp_path / "hf"
    hf.mkdir()
    vocab = _tokenizer(hf, extra)
    make_checkpoint(family, hf, vocab_size=vocab, **overrides)
    gguf_path = convert(hf, tmp_path / "m.gguf", "f32", CONVERTER_ARGS.get(family, ()))

    tokens = np.random.default_rng(5).integers(2, vocab, 24)
    logits = {}
    for name, path in (("hf", hf), ("gguf", gguf_path)):
        model = load(path, device="cpu")
        model.decoder.reset()
        logits[name] = np.concatenate([model.decoder.forward(tokens[:16])] +
                                      [model.decoder.forward(tokens[i:i + 1]) for i in range(16, 24)])
    want, got = logits["hf"], logits["gguf"]
    nmse = float(((got - want) ** 2).sum() / (want**2).sum())
    assert nmse < 1e-9, nmse  # the same numbers through the same kernels: only load-time roundings may differ
    assert (got.argmax(-1) == want.argmax(-1)).all()
    # the embedded vocabulary tokenizes as the directory's tokenizer does
    text = "def walk(top):\n    return [name for name in top]\n"
    assert load(gguf_path, device="cpu").encode(text) == load(hf, device="cpu").encode(text)
