"""Export an HF MoE checkpoint to a llama.cpp GGUF file: routed experts in Q4_0, the rest in a chosen type.

Written with gguf-py's :class:`gguf.GGUFWriter` in its streaming mode: every tensor's name, type and shape is
declared first (all are known from the config), the header goes out, then each tensor is computed, written and
dropped, so no second copy of the model is ever held. The file is written next to its destination under a
temporary name and renamed only when complete: a failed export leaves nothing behind.

Tensor names and metadata keys are llama.cpp's (``token_embd``, ``blk.N.attn_q``, ``blk.N.ffn_gate_exps``,
``{arch}.expert_count``...); ``llama``-architecture (Mixtral) Q/K rows are permuted as llama.cpp's converter does.
Expert quantization is :mod:`freetoken.formats.q4_0` (byte-identical to gguf-py's Q4_0 quantizer).

Qwen3-Next (``qwen3next``) and Qwen3.5-MoE (``qwen35moe``) are written as llama.cpp's converter writes them
(``Qwen3NextModel`` / ``Qwen3_5MoeTextModel`` in its ``conversion/qwen.py``; the tensor layouts are listed in
:mod:`freetoken.models.weights`): the linear layers' ``attn_qkv``, ``attn_gate``, ``ssm_ba`` (qwen3next: [b, a] rows
per key head) or ``ssm_beta`` / ``ssm_alpha``, ``ssm_conv1d`` [C, K], ``ssm_dt.bias``, ``ssm_a`` = -exp(A_log)
(computed in float64 and rounded once, as the decoder computes it, so a freetoken load is exact; the converter's
float32 exp can differ by an ulp), ``ssm_norm``, ``ssm_out``, with qwen35moe's value heads in llama.cpp's tiled order;
``attn_q`` with its gate rows as HF stores it; the zero-centred norms as ``1 + w``; ``ffn_gate_inp_shexp`` [1, hidden];
the MLP norm as ``post_attention_norm``. Metadata: ``{arch}.ssm.conv_kernel`` / ``state_size`` (key head dim) /
``group_count`` (key heads) / ``time_step_rank`` (value heads) / ``inner_size`` (value heads x value head dim),
``{arch}.attention.recurrent_layers`` (per layer: linear or not), ``{arch}.full_attention_interval`` (the interval
that gives those layers, else 4: the converter copies the config's, default 4, the same for the released models),
``{arch}.rope.dimension_count`` (the rotated dims), and for qwen35moe ``{arch}.rope.dimension_sections`` (the
checkpoint's ``mrope_section`` padded to 4, else [11, 11, 10, 0], as the converter writes it; for text every section
sees the same position, so freetoken reads none of it). The multi-token-prediction block is not exported (as the
converter's ``--no-mtp``).
"""

from __future__ import annotations

import math
import os
import warnings
from collections.abc import Callable
from pathlib import Path

import ml_dtypes
import numpy as np

from freetoken.convert.atomic import atomic_output
from freetoken.formats import MATRICES
from freetoken.loaders.errors import LoadError
from freetoken.models.config import ModelConfig
from freetoken.models.families import BY_NAME as FAMILIES
from freetoken.models.families import GGUF_WRITES
from freetoken.models.weights import (
    GGUF_TILED_V_ARCH,
    HFWeights,
    gguf_layer_name,
    llama_permute,
    tiled_v_order,
)

#: freetoken family -> GGUF architecture (the family table's, :mod:`freetoken.models.families`).
ARCHS = GGUF_WRITES
#: Types a non-expert matrix can be written in (norms, biases and routers always stay F32).
OTHER_TYPES = ("f32", "f16", "bf16", "q8_0", "q4_0")
EXPERT_TYPES = ("q4_0", "q8_0", "f16", "bf16", "f32")


def _ggml_type(name: str):
    from gguf import GGMLQuantizationType as T

    return {"f32": T.F32, "f16": T.F16, "bf16": T.BF16, "q8_0": T.Q8_0, "q4_0": T.Q4_0}[name]


def _nbytes(type_name: str, shape: tuple[int, ...]) -> int:
    from gguf.constants import GGML_QUANT_SIZES

    block, size = GGML_QUANT_SIZES[_ggml_type(type_name)]
    return math.prod(shape) // block * size


def _encode(w: np.ndarray, type_name: str) -> np.ndarray:
    """float32 array -> the bytes GGUF stores for it."""
    if type_name == "f32":
        return np.ascontiguousarray(w, np.float32)
    if type_name == "f16":
        return np.ascontiguousarray(w, np.float16)
    if type_name == "bf16":
        return np.ascontiguousarray(w.astype(ml_dtypes.bfloat16))
    if type_name == "q4_0":
        from freetoken.formats import q4_0

        flat = w.reshape(-1, w.shape[-2], w.shape[-1])
        return q4_0.to_gguf(q4_0.FORMAT.quantize(flat)).reshape(-1)
    from gguf.quants import quantize

    return quantize(np.ascontiguousarray(w, np.float32), _ggml_type(type_name))


class _Plan:
    """(gguf name, float32 producer, type, NumPy-order shape) for every tensor, in file order."""

    def __init__(self):
        self.items: list[tuple[str, Callable[[], np.ndarray], str, tuple[int, ...]]] = []

    def add(self, name, fn, type_name, shape):
        self.items.append((name, fn, type_name, tuple(int(d) for d in shape)))


def _matrix_type(type_name: str, shape) -> str:
    """Block types need rows that are whole blocks; fall back to f16 otherwise (as llama.cpp's quantizer does)."""
    return type_name if type_name not in ("q8_0", "q4_0") or shape[-1] % 32 == 0 else "f16"


def build_plan(cfg: ModelConfig, w, other: str, experts: str) -> _Plan:
    """``w``: ``get(key, layer=None)`` and ``expert_stack(layer, matrix)`` float32 arrays (see HFWeights); a
    producer may also return uint8 bytes already in the tensor's file encoding."""
    p = _Plan()
    arch = ARCHS[cfg.family]
    vec = lambda key, layer=None: (lambda: w.get(key, layer).reshape(-1))
    p.add("token_embd.weight", lambda: w.get("embed"), _matrix_type(other, (cfg.hidden,)),
          (cfg.vocab_size, cfg.hidden))
    for i in range(cfg.num_layers):
        b = f"blk.{i}."
        hd = cfg.head_dim
        q_rows = cfg.num_heads * hd * (2 if cfg.attn_output_gate else 1)  # Qwen3-Next / 3.5: the gate rows too
        proj = {"q_proj": (q_rows, cfg.hidden), "k_proj": (cfg.num_kv_heads * hd, cfg.hidden),
                "v_proj": (cfg.num_kv_heads * hd, cfg.hidden), "o_proj": (cfg.hidden, cfg.num_heads * hd)}
        gguf_name = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output"}

        def fetch(key, layer=i):
            t = w.get(key, layer)
            if arch == "llama" and key[0] in "qk" and key[1:] in ("_proj", "_bias"):
                t = llama_permute(t, cfg.num_heads if key[0] == "q" else cfg.num_kv_heads)
            return t

        p.add(b + "attn_norm.weight", vec("attn_norm", i), "f32", (cfg.hidden,))
        linear = cfg.is_linear(i)
        if cfg.mla:
            _latent_attention_plan(p, cfg, w, i, other)
            proj = {}
        if linear:
            _linear_attention_plan(p, cfg, w, i, other, arch)
            proj = {}
        for key, shape in proj.items():
            p.add(b + gguf_name[key] + ".weight", (lambda key=key, f=fetch: f(key)), _matrix_type(other, shape), shape)
        if cfg.qkv_bias and not linear:
            for x in "qkv":
                p.add(b + f"attn_{x}.bias", (lambda x=x, f=fetch: f(f"{x}_bias")), "f32", (proj[f"{x}_proj"][0],))
        if cfg.o_bias:
            p.add(b + "attn_output.bias", vec("o_bias", i), "f32", (cfg.hidden,))
        if cfg.attention_sinks:
            p.add(b + "attn_sinks.weight", vec("attn_sinks", i), "f32", (cfg.num_heads,))
        if cfg.qk_norm != "none" and not linear:
            n_q = hd if cfg.qk_norm == "head" else cfg.num_heads * hd
            n_k = hd if cfg.qk_norm == "head" else cfg.num_kv_heads * hd
            p.add(b + "attn_q_norm.weight", vec("q_norm", i), "f32", (n_q,))
            p.add(b + "attn_k_norm.weight", vec("k_norm", i), "f32", (n_k,))
        p.add(b + gguf_layer_name(arch, "mlp_norm"), vec("mlp_norm", i), "f32", (cfg.hidden,))
        if cfg.is_moe(i):
            e, h, m = cfg.num_experts, cfg.hidden, cfg.moe_inter
            p.add(b + "ffn_gate_inp.weight", lambda i=i: w.get("router", i), "f32", (e, h))
            if cfg.router == "sigmoid_group":
                p.add(b + gguf_layer_name(arch, "router_bias"), vec("router_bias", i), "f32", (e,))
            if cfg.router_logit_bias:
                p.add(b + "ffn_gate_inp.bias", vec("router_logit_bias", i), "f32", (e,))
            if cfg.expert_bias:
                for mat in MATRICES:
                    p.add(b + f"ffn_{mat}_exps.bias", lambda mat=mat, i=i: w.expert_biases(i)[mat], "f32",
                          (e, h if mat == "down" else m))
            shapes = {"gate": (e, m, h), "up": (e, m, h), "down": (e, h, m)}
            for mat in MATRICES:
                fn = lambda mat=mat, i=i: w.expert_stack(i, mat)
                p.add(b + f"ffn_{mat}_exps.weight", fn, _matrix_type(experts, shapes[mat]), shapes[mat])
            if cfg.shared_inter:
                s = cfg.shared_inter
                for mat, shape in (("gate", (s, h)), ("up", (s, h)), ("down", (h, s))):
                    p.add(b + f"ffn_{mat}_shexp.weight", lambda mat=mat, i=i: w.get(f"shared_{mat}", i),
                          _matrix_type(other, shape), shape)
                if cfg.shared_gated and FAMILIES[cfg.family].hybrid:  # the converter keeps HF's [1, hidden]
                    p.add(b + "ffn_gate_inp_shexp.weight", lambda i=i: w.get("shared_sigmoid", i), "f32", (1, h))
                elif cfg.shared_gated:
                    p.add(b + "ffn_gate_inp_shexp.weight", vec("shared_sigmoid", i), "f32", (h,))
        else:
            d, h = cfg.dense_inter, cfg.hidden
            for mat, shape in (("gate", (d, h)), ("up", (d, h)), ("down", (h, d))):
                p.add(b + f"ffn_{mat}.weight", lambda mat=mat, i=i: w.get(f"mlp_{mat}", i),
                      _matrix_type(other, shape), shape)
    p.add("output_norm.weight", vec("norm"), "f32", (cfg.hidden,))
    if not cfg.tie_word_embeddings:
        p.add("output.weight", lambda: w.get("lm_head"), _matrix_type(other, (cfg.hidden,)),
              (cfg.vocab_size, cfg.hidden))
    return p


def _linear_attention_plan(p: _Plan, cfg: ModelConfig, w, i: int, other: str, arch: str) -> None:
    """A Gated DeltaNet layer's tensors, as llama.cpp's converter writes them (the module docstring): qwen3next's b
    and a rows fused per key head into ``ssm_ba``, qwen35moe's value heads in tiled order."""
    b, h = f"blk.{i}.", cfg.hidden
    hk, hv, dv = cfg.linear_k_heads, cfg.linear_v_heads, cfg.linear_v_dim
    qk, c = 2 * hk * cfg.linear_k_dim, cfg.linear_conv_dim
    tiled = arch == GGUF_TILED_V_ARCH and hk != hv

    def heads(t, width, skip=0):
        """``t``'s value heads (rows of ``width`` after the first ``skip``) in the file's order."""
        t = np.asarray(t)
        if not tiled:
            return t
        return np.ascontiguousarray(t[np.concatenate([np.arange(skip), skip + tiled_v_order(hk, hv, width)])])

    def ba():
        r = hv // hk
        fused = np.stack([w.get(k, i).reshape(hk, r, h) for k in ("lin_b", "lin_a")], axis=1)  # [Hk, 2, r, H]
        return np.ascontiguousarray(fused.reshape(2 * hv, h))

    def out():
        t = w.get("lin_out", i)
        return np.ascontiguousarray(t[:, tiled_v_order(hk, hv, dv)]) if tiled else t

    p.add(b + "ssm_a", lambda: heads(w.get("lin_ssm_a", i).reshape(-1), 1), "f32", (hv,))
    p.add(b + "ssm_conv1d.weight", lambda: heads(w.get("lin_conv", i).reshape(c, -1), dv, qk), "f32",
          (c, cfg.linear_conv))
    p.add(b + "ssm_dt.bias", lambda: heads(w.get("lin_dt_bias", i).reshape(-1), 1), "f32", (hv,))
    mats = [("ssm_ba", ba, (2 * hv, h))] if arch == "qwen3next" else \
        [("ssm_alpha", lambda: heads(w.get("lin_a", i), 1), (hv, h)),
         ("ssm_beta", lambda: heads(w.get("lin_b", i), 1), (hv, h))]
    mats += [("attn_qkv", lambda: heads(w.get("lin_qkv", i), dv, qk), (c, h)),
             ("attn_gate", lambda: heads(w.get("lin_z", i), dv), (hv * dv, h))]
    for name, fn, shape in mats:
        p.add(b + name + ".weight", fn, _matrix_type(other, shape), shape)
    p.add(b + "ssm_norm.weight", lambda: w.get("lin_norm", i).reshape(-1), "f32", (dv,))
    p.add(b + "ssm_out.weight", out, _matrix_type(other, (h, hv * dv)), (h, hv * dv))


def _interleave_rope(t: np.ndarray, heads: int, width: int, rope: int) -> np.ndarray:
    """Rows of heads of ``width`` ending in ``rope`` rotate-half rope dims, those dims in DeepSeek's interleaved-pair
    order (what llama.cpp's deepseek2 rotates: adjacent pairs), for a checkpoint with ``rope_interleave`` false."""
    order = np.arange(width)
    half = rope // 2
    order[width - rope:] = width - rope + np.stack([np.arange(half), half + np.arange(half)], axis=1).reshape(-1)
    rows = (np.arange(heads)[:, None] * width + order[None, :]).reshape(-1)
    return np.ascontiguousarray(t[rows])


def _latent_attention_plan(p: _Plan, cfg: ModelConfig, w, i: int, other: str) -> None:
    """deepseek2's tensors of latent attention layer ``i``, as llama.cpp's converter writes them: ``kv_b_proj``
    split into ``attn_k_b`` [H, R, nope] (transposed) and ``attn_v_b`` [H, v, R]; the rope rows in DeepSeek's
    interleaved order."""
    b, h, heads = f"blk.{i}.", cfg.hidden, cfg.num_heads
    rank, rope, head, nope, vd = cfg.kv_lora_rank, cfg.qk_rope_dim, cfg.head_dim, cfg.qk_nope_dim, cfg.v_head_dim

    def rows(key, n_heads, width):
        t = w.get(key, i)
        return t if cfg.rope_interleave else _interleave_rope(t, n_heads, width, rope)

    def kv_b(half):
        t = w.get("kv_b_proj", i).reshape(heads, nope + vd, rank)
        return np.ascontiguousarray(t[:, :nope].transpose(0, 2, 1) if half == "k" else t[:, nope:])

    mats = []
    if cfg.q_lora_rank:
        mats += [("attn_q_a", lambda: w.get("q_a_proj", i), (cfg.q_lora_rank, h)),
                 ("attn_q_b", lambda: rows("q_b_proj", heads, head), (heads * head, cfg.q_lora_rank))]
        p.add(b + "attn_q_a_norm.weight", lambda: w.get("q_a_norm", i).reshape(-1), "f32", (cfg.q_lora_rank,))
    else:
        mats.append(("attn_q", lambda: rows("q_proj", heads, head), (heads * head, h)))
    mats += [("attn_kv_a_mqa", lambda: rows("kv_a_proj", 1, rank + rope), (rank + rope, h)),
             ("attn_k_b", lambda: kv_b("k"), (heads, rank, nope)), ("attn_v_b", lambda: kv_b("v"), (heads, vd, rank)),
             ("attn_output", lambda: w.get("o_proj", i), (h, heads * vd))]
    p.add(b + "attn_kv_a_norm.weight", lambda: w.get("kv_a_norm", i).reshape(-1), "f32", (rank,))
    for name, fn, shape in mats:
        p.add(b + name + ".weight", fn, _matrix_type(other, shape), shape)


def hf_rope_sections(config: dict) -> list[int] | None:
    """An HF config's ``mrope_section`` (Qwen3.5's, in ``rope_parameters`` or ``rope_scaling``, of the
    ``text_config`` when there is one), or None."""
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    for key in ("rope_parameters", "rope_scaling"):
        rope = text.get(key) or config.get(key)
        if isinstance(rope, dict) and isinstance(rope.get("mrope_section"), list):
            return [int(x) for x in rope["mrope_section"]]
    return None


def llama_cpp_notes(cfg: ModelConfig, rope_sections: list[int] | None = None) -> list[str]:
    """What of a model written in its llama.cpp architecture llama.cpp itself will not load or run (the family's
    :meth:`~freetoken.models.families.base.Family.llama_cpp_notes`)."""
    return FAMILIES[cfg.family].llama_cpp_notes(cfg, rope_sections)


def _write_metadata(writer, cfg: ModelConfig, name: str, experts: str, rope_sections=None) -> None:
    from gguf import LlamaFileType

    writer.add_name(name)
    ftype = {"q4_0": LlamaFileType.MOSTLY_Q4_0, "q8_0": LlamaFileType.MOSTLY_Q8_0, "f16": LlamaFileType.MOSTLY_F16,
             "bf16": LlamaFileType.MOSTLY_BF16, "f32": LlamaFileType.ALL_F32}[experts]
    writer.add_file_type(int(ftype))
    writer.add_context_length(cfg.max_position)
    writer.add_embedding_length(cfg.hidden)
    writer.add_block_count(cfg.num_layers)
    writer.add_feed_forward_length(cfg.dense_inter or cfg.moe_inter)
    writer.add_head_count(cfg.num_heads)
    if cfg.mla:  # stored as MQA over the latent, as llama.cpp's converter does
        writer.add_head_count_kv(1)
        writer.add_key_length(cfg.kv_cache_dim)
        writer.add_value_length(cfg.kv_lora_rank)
        writer.add_key_length_mla(cfg.head_dim)
        writer.add_value_length_mla(cfg.v_head_dim)
        writer.add_kv_lora_rank(cfg.kv_lora_rank)
        if cfg.q_lora_rank:
            writer.add_q_lora_rank(cfg.q_lora_rank)
        writer.add_rope_dimension_count(cfg.qk_rope_dim)
        mscale_all = (cfg.rope_scaling or {}).get("mscale_all_dim")
        if mscale_all:
            writer.add_rope_scaling_yarn_log_mul(0.1 * float(mscale_all))
    else:
        writer.add_head_count_kv(cfg.num_kv_heads)
        writer.add_key_length(cfg.head_dim)
        writer.add_value_length(cfg.head_dim)
    writer.add_rope_freq_base(cfg.rope_theta)
    if cfg.attn_temperature_scale > 0:  # llama.cpp's keys (its llama4 and deepseek2 read them)
        writer.add_float32(f"{ARCHS[cfg.family]}.attention.temperature_scale", cfg.attn_temperature_scale)
        writer.add_uint32(f"{ARCHS[cfg.family]}.attention.temperature_length", cfg.attn_temperature_floor)
    writer.add_layer_norm_rms_eps(cfg.rms_eps)
    writer.add_expert_count(cfg.num_experts)
    writer.add_expert_used_count(cfg.top_k)
    writer.add_expert_weights_norm(cfg.norm_topk_prob)
    writer.add_vocab_size(cfg.vocab_size)
    family = FAMILIES[cfg.family]
    if family.gguf_expert_ffn_length:
        writer.add_expert_feed_forward_length(cfg.moe_inter)
    if cfg.shared_inter:
        writer.add_expert_shared_feed_forward_length(cfg.shared_inter)
    family.write_gguf(writer, cfg, rope_sections)
    if cfg.rope_scaling is not None:
        from gguf import RopeScalingType

        kind = cfg.rope_scaling.get("rope_type", cfg.rope_scaling.get("type"))
        if kind not in ("linear", "yarn"):
            raise ValueError(f"rope scaling {kind!r} has no GGUF metadata freetoken writes (linear and yarn do)")
        writer.add_rope_scaling_type(RopeScalingType.LINEAR if kind == "linear" else RopeScalingType.YARN)
        writer.add_rope_scaling_factor(float(cfg.rope_scaling["factor"]))
        orig = cfg.rope_scaling.get("original_max_position_embeddings")
        if orig:
            writer.add_rope_scaling_orig_ctx_len(int(orig))
        if kind == "yarn":
            for key in ("beta_fast", "beta_slow"):
                if cfg.rope_scaling.get(key) is not None:
                    getattr(writer, f"add_rope_scaling_yarn_{key}")(float(cfg.rope_scaling[key]))
            if not cfg.rope_scaling.get("truncate", True):
                warnings.warn("YaRN with truncate=false: GGUF has no key for it and llama.cpp (and freetoken reading "
                              "a GGUF file) round the ramp's ends to whole dimensions, so the file's RoPE differs "
                              "slightly from the checkpoint's", stacklevel=3)


def check_output(out: Path, inputs: Path, force: bool = False) -> None:
    """Refuse, before any work, an output that would lose data or fail at the end: one of the checkpoint's own
    files (never, even with ``force``), an existing file (unless ``force``), a directory, a directory that does not
    exist or is not writable."""
    target = out.expanduser().resolve()
    src = inputs.expanduser().resolve()
    if target.exists() and (target == src or src in target.parents):
        raise ValueError(f"{out}: is a file of the checkpoint {inputs} being converted; write the GGUF elsewhere")
    if target.is_dir():
        raise ValueError(f"{out}: is a directory; give the GGUF file's path")
    if target.exists() and not force:
        raise ValueError(f"{out}: exists; pass --force to replace it")
    if not target.parent.is_dir():
        raise ValueError(f"{out}: the directory {target.parent} does not exist")
    if not os.access(target.parent, os.W_OK):
        raise ValueError(f"{out}: the directory {target.parent} is not writable")


def export_gguf(model_dir: str | os.PathLike, out: str | os.PathLike, experts: str = "q4_0", other: str = "f16",
                progress: bool = False, force: bool = False) -> Path:
    """Write ``model_dir`` (an HF MoE checkpoint: bf16/f16/f32 or block FP8) as a GGUF file at ``out``.

    ``experts``: type of the routed experts (default q4_0); ``other``: type of the other matrices (embedding,
    attention, shared experts, dense MLPs; default f16). Norms, biases and routers are F32. Returns ``out``.
    ``out`` is never one of the checkpoint's files and an existing ``out`` is replaced only with ``force``
    (:func:`check_output`, before any work); the file appears only when complete."""
    from freetoken.loaders import SafetensorsDir, quantization
    from freetoken.models import from_hf

    if experts not in EXPERT_TYPES:
        raise ValueError(f"expert type {experts!r}: choose one of {', '.join(EXPERT_TYPES)}")
    if other not in OTHER_TYPES:
        raise ValueError(f"non-expert type {other!r}: choose one of {', '.join(OTHER_TYPES)}")
    src = Path(model_dir)
    check_output(Path(out), src, force)
    sd = SafetensorsDir(src)
    q = quantization(sd.config, sd.hf_quant_config)
    cfg = from_hf(sd.config, str(src / "config.json"))
    mxfp4 = q.method == "mxfp4" and FAMILIES[cfg.family].hf_experts_interleaved  # experts decoded from the blocks
    if q.method not in ("none", "fp8_block") and not mxfp4:
        raise LoadError(src / "config.json", f"exporting {q.method} checkpoints is not supported")
    weights = HFWeights(cfg, sd.get, sd.has, fp8_block=q.method == "fp8_block", where=str(src), mxfp4=mxfp4)
    tok_fields = None
    from freetoken.loaders.gguf_tokenizer import gguf_tokenizer_fields
    from freetoken.loaders.tiktoken_tokenizer import RANKS_FILE, is_tiktoken_dir, tokenizer_from_tiktoken

    tc = src / "tokenizer_config.json"
    tc = tc if tc.is_file() else None
    if (src / "tokenizer.json").is_file():
        tok_fields = gguf_tokenizer_fields(src / "tokenizer.json", tc, config=sd.config)
    elif is_tiktoken_dir(src):  # Kimi-K2: tiktoken.model, rebuilt as freetoken loads it
        tok_fields = gguf_tokenizer_fields(src / RANKS_FILE, tc, config=sd.config,
                                           tokenizer=tokenizer_from_tiktoken(src))
    else:
        warnings.warn(f"{src}: no tokenizer.json (nor tiktoken.model); the GGUF file gets no vocabulary (llama.cpp "
                      "will not load it)", stacklevel=2)
    return write_gguf(cfg, weights, out, experts=experts, other=other, tokenizer=tok_fields,
                      name=_model_name(src, sd.config), progress=progress, rope_sections=hf_rope_sections(sd.config))


def write_gguf(cfg: ModelConfig, weights, out: str | os.PathLike, experts: str = "q4_0", other: str = "f16",
               tokenizer: dict | None = None, name: str = "freetoken export", progress: bool = False,
               rope_sections: list[int] | None = None) -> Path:
    """Write a model given as a config and a weight source (``get`` / ``expert_stack``, see :func:`build_plan`)
    as a GGUF file; ``tokenizer``: :func:`freetoken.loaders.gguf_tokenizer.gguf_tokenizer_fields` output;
    ``rope_sections``: Qwen3.5's ``mrope_section`` (:func:`hf_rope_sections`; None: the converter's default). A model
    llama.cpp will not load (:func:`llama_cpp_notes`) is written all the same, with a warning."""
    import gguf

    out = Path(out)
    plan = build_plan(cfg, weights, other, experts)
    for note in llama_cpp_notes(cfg, rope_sections):
        warnings.warn(f"{out}: {note}", stacklevel=2)
    for tname, _, type_name, shape in plan.items:
        if _matrix_type(type_name, shape) != type_name:
            raise ValueError(f"{tname}: rows of {shape[-1]} are not whole {type_name} blocks")

    with atomic_output(out) as tmp:
        writer = gguf.GGUFWriter(tmp, ARCHS[cfg.family])
        _write_metadata(writer, cfg, name, experts, rope_sections)
        if tokenizer is not None:
            from freetoken.loaders.gguf_tokenizer import write_tokenizer

            write_tokenizer(writer, tokenizer)
        for tname, _, type_name, shape in plan.items:
            # declared up front (NumPy-order element shape; gguf-py reverses it to ggml order)
            writer.add_tensor_info(tname, shape, np.dtype(np.float32), _nbytes(type_name, shape),
                                   raw_dtype=_ggml_type(type_name))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        items = plan.items
        if progress:
            from tqdm import tqdm

            items = tqdm(items, desc=f"writing {out.name}", unit="tensor", leave=False)
        for tname, fn, type_name, shape in items:
            data = fn()
            if data.dtype == np.uint8 and data.nbytes == _nbytes(type_name, shape):
                writer.write_tensor_data(np.ascontiguousarray(data).reshape(-1))  # already in the file's encoding
                continue
            if tuple(data.shape) != shape:
                raise ValueError(f"{tname}: expected shape {list(shape)}, got {list(data.shape)}")
            writer.write_tensor_data(_encode(np.asarray(data, np.float32), type_name))
        writer.close()
    return out


def _model_name(src: Path, config: dict) -> str:
    """general.name: the directory's name and its HF architecture."""
    archs = config.get("architectures") or [""]
    return f"{src.resolve().name} ({archs[0]})" if archs[0] else src.resolve().name
