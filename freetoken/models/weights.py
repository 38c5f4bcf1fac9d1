"""Where the decoder's weights come from: an HF safetensors checkpoint or a GGUF file, behind one interface.

The decoder asks for tensors by canonical key (``"embed"``, ``"q_proj"`` of layer 3, ...) as float32 and for a
MoE layer's routed experts as record banks in its expert format. Each source maps the keys to its own tensor
names and decodes its own storage types:

- :class:`HFWeights`: ``model.layers.N.*`` names (Mixtral's ``block_sparse_moe`` included); bf16/f16/f32 tensors
  and DeepSeek-style block FP8 (``weight`` e4m3 + ``weight_scale_inv`` per 128x128 block), whose routed experts
  move into ``fp8_block`` banks without re-quantization.
- :class:`GGUFWeights`: llama.cpp names (``token_embd``, ``blk.N.attn_q``, ``blk.N.ffn_gate_exps``...); any
  type gguf-py can dequantize for the non-expert tensors; Q4_0 / MXFP4 experts move into ``q4_0`` / ``mxfp4``
  banks bit for bit. llama.cpp's converter permutes the Q/K rows of ``llama``-architecture models (its RoPE
  rotates adjacent pairs, HF's rotates halves); those rows are put back in HF order here.

Experts in any other storage are decoded to float32 and quantized into the requested format.

``get_matrix`` serves the decoder's dense projections: GGUF Q8_0 / Q4_0 matrices as
:class:`freetoken.models.qmatrix.QuantizedMatrix` (their file blocks, never dequantized; llama Q/K rows un-permuted
as whole block rows), every other tensor as ``get`` returns it.

Qwen3-Next (``qwen3next``) and Qwen3.5-MoE (``qwen35moe``) files, as llama.cpp's converter (``Qwen3NextModel``,
``_LinearAttentionVReorderBase``, ``Qwen3_5MoeTextModel`` in its ``conversion/qwen.py``) writes them, and what
:class:`GGUFWeights` undoes to give the values :class:`HFWeights` gives:

- Gated DeltaNet layers: ``attn_qkv`` (q heads, k heads, v heads: Qwen3.5's ``in_proj_qkv``; for Qwen3-Next the
  converter regroups ``in_proj_qkvz``'s per-key-head [q, k, v, z] rows into this and ``attn_gate``), ``attn_gate``
  (z), ``ssm_ba`` (Qwen3-Next: ``in_proj_ba`` as stored, [b, a] rows per key head) or ``ssm_beta`` / ``ssm_alpha``
  (Qwen3.5's ``in_proj_b`` / ``in_proj_a``), ``ssm_conv1d`` (conv1d.weight squeezed to [C, K]), ``ssm_dt.bias``
  (dt_bias), ``ssm_a`` (no ``.weight``: ``-exp(A_log)``, not A_log), ``ssm_norm`` (the gated norm, as stored),
  ``ssm_out`` (out_proj). Older qwen3next files hold one ``ssm_in`` (in_proj_qkvz as stored); they are refused.
- qwen35moe only, when there are fewer key heads than value heads: every value-head axis is put in "tiled" order
  (value head ``v`` of key head ``k``, at ``k * r + v`` in HF's grouped order, moves to ``v * Hk + k``; r = Hv / Hk)
  for llama.cpp's broadcast: the v rows of ``attn_qkv`` and the v channels of ``ssm_conv1d``, the rows of
  ``attn_gate`` (per head of Dv), ``ssm_beta``, ``ssm_alpha``, ``ssm_dt``, ``ssm_a``, and the columns of ``ssm_out``.
  Read back in grouped order here (rows move whole, so quantized rows stay quantized; ``ssm_out``'s columns move in
  whole blocks only when Dv is a multiple of the block, else that matrix is read as float32).
- Full-attention layers: ``attn_q`` is HF's q_proj as stored (each head's query rows, then its output-gate rows),
  ``attn_k``, ``attn_v``, ``attn_output``, ``attn_q_norm`` / ``attn_k_norm``; no row permutation (NeoX-style RoPE).
- The RMSNorms HF stores zero-centred (``input_layernorm``, ``post_attention_layernorm`` -> ``post_attention_norm``,
  q/k norms, the final norm; :data:`OFFSET_NORMS`) are written as ``1 + w``: the effective weights HFWeights returns.
- The shared expert's sigmoid gate ``ffn_gate_inp_shexp`` is [1, hidden] as HF stores it.
"""

from __future__ import annotations

import re

import numpy as np

from freetoken.formats import MATRICES, RecordLayout
from freetoken.formats.parts import ExpertParts
from freetoken.formats.table import ROWS as FORMAT_ROWS
from freetoken.loaders.errors import LoadError
from freetoken.models.config import ModelConfig
from freetoken.models.families import BY_NAME as FAMILIES
from freetoken.models.families import ROWS as FAMILY_ROWS
from freetoken.models.qmatrix import QuantizedMatrix, from_hf_fp8
from freetoken.ops.dense import FP8_K_MULTIPLE, k_multiple, row_bytes

#: Per-layer canonical keys -> HF names relative to ``model.layers.N.`` (``{moe}``: the family's
#: ``hf_moe_prefix``, ``mlp.`` or Mixtral's ``block_sparse_moe.``); a family's own names are in its module
#: (:attr:`freetoken.models.families.base.Family.hf_layer_names`).
_HF_LAYER = {
    "attn_norm": "input_layernorm.weight", "mlp_norm": "post_attention_layernorm.weight",
    **{f"{x}_proj": f"self_attn.{x}_proj.weight" for x in "qkvo"},
    **{f"{x}_bias": f"self_attn.{x}_proj.bias" for x in "qkvo"},
    "q_norm": "self_attn.q_norm.weight", "k_norm": "self_attn.k_norm.weight", "attn_sinks": "self_attn.sinks",
    "router": "{moe}gate.weight", "router_bias": "{moe}gate.e_score_correction_bias",
    "router_logit_bias": "{moe}gate.bias",
    # DeepSeek-V3's latent attention
    "q_a_proj": "self_attn.q_a_proj.weight", "q_a_norm": "self_attn.q_a_layernorm.weight",
    "q_b_proj": "self_attn.q_b_proj.weight", "kv_a_proj": "self_attn.kv_a_proj_with_mqa.weight",
    "kv_a_norm": "self_attn.kv_a_layernorm.weight", "kv_b_proj": "self_attn.kv_b_proj.weight",
    **{f"shared_{w}": f"mlp.shared_expert.{w}_proj.weight" for w in ("gate", "up", "down")},
    "shared_sigmoid": "mlp.shared_expert_gate.weight",
    **{f"mlp_{w}": f"mlp.{w}_proj.weight" for w in ("gate", "up", "down")},
    # Gated DeltaNet (Qwen3.5-MoE's names; Qwen3-Next fuses qkv+z and b+a: its family's lin_qkvz and lin_ba)
    "lin_qkv": "linear_attn.in_proj_qkv.weight", "lin_z": "linear_attn.in_proj_z.weight",
    "lin_b": "linear_attn.in_proj_b.weight", "lin_a": "linear_attn.in_proj_a.weight",
    "lin_conv": "linear_attn.conv1d.weight", "lin_dt_bias": "linear_attn.dt_bias", "lin_ssm_a": "linear_attn.A_log",
    "lin_norm": "linear_attn.norm.weight", "lin_out": "linear_attn.out_proj.weight",
}
#: Norm weights stored zero-centred by the hybrid families (``ModelConfig.norm_offset``: the model multiplies by
#: ``1 + w``); the gated norm of the linear layers (``lin_norm``) is not one of them.
OFFSET_NORMS = ("attn_norm", "mlp_norm", "q_norm", "k_norm", "norm")
#: gpt-oss' routed experts: fused tensors per layer (relative to ``model.layers.N.mlp.experts.``): ``gate_up_proj``
#: [E, H, 2I] (gate and up interleaved along the last axis: gate at even, up at odd indices) and ``down_proj``
#: [E, I, H], stored input-major (transposed against the other families' [out, in]), with their biases.
GPT_OSS_EXPERTS = ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")
_HF_GLOBAL = {"embed": "model.embed_tokens.weight", "norm": "model.norm.weight", "lm_head": "lm_head.weight"}

#: The same keys in llama.cpp's GGUF names (relative to ``blk.N.``).
_GGUF_LAYER = {
    "attn_norm": "attn_norm.weight", "mlp_norm": "ffn_norm.weight",
    "q_proj": "attn_q.weight", "k_proj": "attn_k.weight", "v_proj": "attn_v.weight", "o_proj": "attn_output.weight",
    "q_bias": "attn_q.bias", "k_bias": "attn_k.bias", "v_bias": "attn_v.bias", "o_bias": "attn_output.bias",
    "q_norm": "attn_q_norm.weight", "k_norm": "attn_k_norm.weight", "attn_sinks": "attn_sinks.weight",
    "router": "ffn_gate_inp.weight", "router_bias": "exp_probs_b.bias", "router_logit_bias": "ffn_gate_inp.bias",
    **{f"shared_{w}": f"ffn_{w}_shexp.weight" for w in ("gate", "up", "down")},
    "shared_sigmoid": "ffn_gate_inp_shexp.weight",
    **{f"mlp_{w}": f"ffn_{w}.weight" for w in ("gate", "up", "down")},
    # latent attention (deepseek2): kv_b_proj is stored split, as attn_k_b [H, R, nope] (transposed) and attn_v_b
    # [H, v, R] (llama.cpp's converter; older files have the whole attn_kv_b)
    "q_a_proj": "attn_q_a.weight", "q_a_norm": "attn_q_a_norm.weight", "q_b_proj": "attn_q_b.weight",
    "kv_a_proj": "attn_kv_a_mqa.weight", "kv_a_norm": "attn_kv_a_norm.weight", "kv_b_proj": "attn_kv_b.weight",
    # Gated DeltaNet (qwen3next / qwen35moe; see the module docstring): lin_a_log is stored as -exp(A_log), lin_ba
    # is qwen3next's fused [b, a] projection (lin_b and lin_a are read out of it)
    "lin_qkv": "attn_qkv.weight", "lin_z": "attn_gate.weight", "lin_b": "ssm_beta.weight",
    "lin_a": "ssm_alpha.weight", "lin_ba": "ssm_ba.weight", "lin_conv": "ssm_conv1d.weight",
    "lin_dt_bias": "ssm_dt.bias", "lin_ssm_a": "ssm_a", "lin_norm": "ssm_norm.weight", "lin_out": "ssm_out.weight",
}
#: Per-architecture GGUF names that differ from :data:`_GGUF_LAYER`'s (each family's ``gguf_layer_names``: llama.cpp's
#: glm4moe, gpt-oss and hybrid architectures call the norm before the MLP ``post_attention_norm``).
_GGUF_LAYER_ARCH = {f.gguf_arch: dict(f.gguf_layer_names) for f in FAMILY_ROWS if f.gguf_layer_names}
#: GGUF architectures of the hybrid families, and the one whose value heads the converter stores in tiled order.
GGUF_HYBRID_ARCHS = ("qwen3next", "qwen35moe")
GGUF_TILED_V_ARCH = "qwen35moe"
#: The halves deepseek2 files store ``kv_b_proj`` as (relative to ``blk.N.``).
GGUF_K_B, GGUF_V_B = "attn_k_b.weight", "attn_v_b.weight"
_GGUF_GLOBAL = {"embed": "token_embd.weight", "norm": "output_norm.weight", "lm_head": "output.weight"}
#: Canonical per-layer key -> GGUF name relative to ``blk.N.`` (read-only; :func:`gguf_layer_name` for an
#: architecture's own).
GGUF_LAYER_NAMES = _GGUF_LAYER


def gguf_layer_name(arch: str, key: str) -> str:
    """The GGUF name (relative to ``blk.N.``) of canonical per-layer ``key`` in a file of architecture ``arch``."""
    return _GGUF_LAYER_ARCH.get(arch, {}).get(key) or _GGUF_LAYER[key]


def layer_shapes(cfg: ModelConfig, i: int) -> dict[str, tuple[int, ...]]:
    """HF-order shape of every per-layer tensor the decoder reads from layer ``i`` (canonical keys; routed
    experts excluded: their storage differs per source)."""
    hd, h = cfg.head_dim, cfg.hidden
    if cfg.mla:
        s = {"attn_norm": (h,), "mlp_norm": (h,), "kv_a_proj": (cfg.kv_lora_rank + cfg.qk_rope_dim, h),
             "kv_a_norm": (cfg.kv_lora_rank,),
             "kv_b_proj": (cfg.num_heads * (cfg.qk_nope_dim + cfg.v_head_dim), cfg.kv_lora_rank),
             "o_proj": (h, cfg.num_heads * cfg.v_head_dim)}
        if cfg.q_lora_rank:
            s.update(q_a_proj=(cfg.q_lora_rank, h), q_a_norm=(cfg.q_lora_rank,),
                     q_b_proj=(cfg.num_heads * hd, cfg.q_lora_rank))
        else:
            s["q_proj"] = (cfg.num_heads * hd, h)
    elif cfg.is_linear(i):
        s = {"attn_norm": (h,), "mlp_norm": (h,), **linear_shapes(cfg)}
    else:
        q_rows = cfg.num_heads * hd * (2 if cfg.attn_output_gate else 1)  # the output gate's rows interleaved per head
        s = {"attn_norm": (h,), "mlp_norm": (h,), "q_proj": (q_rows, h),
             "k_proj": (cfg.num_kv_heads * hd, h), "v_proj": (cfg.num_kv_heads * hd, h),
             "o_proj": (h, cfg.num_heads * hd)}
    if cfg.qkv_bias and not cfg.is_linear(i):
        s.update(q_bias=(cfg.num_heads * hd,), k_bias=(cfg.num_kv_heads * hd,), v_bias=(cfg.num_kv_heads * hd,))
    if cfg.is_linear(i):
        pass
    elif cfg.qk_norm == "head":
        s.update(q_norm=(hd,), k_norm=(hd,))
    elif cfg.qk_norm == "full":
        s.update(q_norm=(cfg.num_heads * hd,), k_norm=(cfg.num_kv_heads * hd,))
    if cfg.attention_sinks:
        s["attn_sinks"] = (cfg.num_heads,)
    if cfg.o_bias:
        s["o_bias"] = (h,)
    if cfg.is_moe(i):
        s["router"] = (cfg.num_experts, h)
        if cfg.router_logit_bias:
            s["router_logit_bias"] = (cfg.num_experts,)
        if cfg.router == "sigmoid_group":
            s["router_bias"] = (cfg.num_experts,)
        if cfg.shared_inter:
            si = cfg.shared_inter
            s.update(shared_gate=(si, h), shared_up=(si, h), shared_down=(h, si))
            if cfg.shared_gated:
                s["shared_sigmoid"] = (1, h)
    else:
        d = cfg.dense_inter
        s.update(mlp_gate=(d, h), mlp_up=(d, h), mlp_down=(h, d))
    return s


def linear_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Shapes of a Gated DeltaNet layer's tensors: the canonical keys, except Qwen3-Next's b and a projections, which
    both of its sources store fused (``lin_ba``: [b, a] rows per key head). Its HF checkpoints fuse q|k|v with z too
    (``lin_qkvz``: :func:`hf_layer_shapes`); llama.cpp's converter splits that into ``lin_qkv`` and ``lin_z``."""
    h, hv = cfg.hidden, cfg.linear_v_heads
    kd, vd = cfg.linear_k_heads * cfg.linear_k_dim, hv * cfg.linear_v_dim
    s = {"lin_qkv": (2 * kd + vd, h), "lin_z": (vd, h), "lin_conv": (cfg.linear_conv_dim, 1, cfg.linear_conv),
         "lin_dt_bias": (hv,), "lin_ssm_a": (hv,), "lin_norm": (cfg.linear_v_dim,), "lin_out": (h, vd)}
    if FAMILIES[cfg.family].fused_linear_inputs:
        s["lin_ba"] = (2 * hv, h)
    else:
        s.update(lin_b=(hv, h), lin_a=(hv, h))
    return s


def hf_layer_shapes(cfg: ModelConfig, i: int) -> dict[str, tuple[int, ...]]:
    """:func:`layer_shapes` as an HF checkpoint stores layer ``i``: a Qwen3-Next linear layer's q|k|v and z
    projections are one ``in_proj_qkvz`` (``lin_qkvz``, rows grouped per key head)."""
    s = layer_shapes(cfg, i)
    if FAMILIES[cfg.family].fused_linear_inputs and cfg.is_linear(i):
        qkv, z = s.pop("lin_qkv"), s.pop("lin_z")
        s["lin_qkvz"] = (qkv[0] + z[0], cfg.hidden)
    return s


def split_qwen3_next(cfg: ModelConfig, key: str, fused: np.ndarray) -> np.ndarray:
    """Qwen3.5's ``lin_qkv`` / ``lin_z`` / ``lin_b`` / ``lin_a`` rows out of Qwen3-Next's fused ``in_proj_qkvz`` /
    ``in_proj_ba`` (grouped per key head: [q, k, v of the group's value heads, z of them] and [b, a])."""
    hk, dk, dv = cfg.linear_k_heads, cfg.linear_k_dim, cfg.linear_v_dim
    r = cfg.linear_v_heads // hk
    if key in ("lin_b", "lin_a"):
        g = fused.reshape(hk, 2 * r, -1)
        return np.ascontiguousarray((g[:, :r] if key == "lin_b" else g[:, r:]).reshape(hk * r, -1))
    g = fused.reshape(hk, 2 * dk + 2 * r * dv, -1)
    if key == "lin_z":
        return np.ascontiguousarray(g[:, 2 * dk + r * dv:].reshape(hk * r * dv, -1))
    q, k, v = g[:, :dk], g[:, dk:2 * dk], g[:, 2 * dk:2 * dk + r * dv]
    return np.ascontiguousarray(np.concatenate([a.reshape(-1, g.shape[-1]) for a in (q, k, v)]))


def global_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Shapes of the tensors outside the layers (``lm_head`` only when the embeddings are not tied)."""
    out = {"embed": (cfg.vocab_size, cfg.hidden), "norm": (cfg.hidden,)}
    if not cfg.tie_word_embeddings:
        out["lm_head"] = (cfg.vocab_size, cfg.hidden)
    return out


def load_bytes(cfg: ModelConfig, dense_bytes: int, expert_format: str | None, kv_bytes: int = 0,
               layouts: list[RecordLayout | ExpertParts] | None = None) -> dict[str, int]:
    """What a load allocates on the host, by kind: ``dense_bytes`` (the non-expert weights as the decoder holds
    them), the expert banks (of ``layouts``, one per MoE layer, when given; else every layer in ``expert_format``),
    one layer's float32 expert matrices while they are quantized (callers zero this entry when the experts move as
    stored), the KV pool (``kv_bytes``: what the caller knows of it before the load)."""
    from freetoken import formats

    moe = sum(cfg.moe_layers)
    e, h, i = cfg.num_experts, cfg.hidden, cfg.moe_inter
    if layouts is not None:
        banks = sum(lay.host_bytes if isinstance(lay, ExpertParts) else e * lay.record_bytes for lay in layouts)
    else:
        try:
            banks = moe * e * RecordLayout(formats.get(expert_format or "bf16"), h, i).record_bytes
        except (ValueError, KeyError):
            banks = moe * e * 3 * h * i * 4
    return {"non-expert weights": dense_bytes, "expert banks": banks,
            "float32 experts of one layer while quantized": 3 * e * h * i * 4 if moe else 0,
            "KV pool": int(kv_bytes)}


#: safetensors dtypes the decoder reads as weights (integers would be read as numbers, never as weights).
HF_FLOAT_DTYPES = ("BF16", "F16", "F32")


def check_hf_tensors(cfg: ModelConfig, sd, fp8_block: bool = False, kv_bytes: int = 0,
                     expert_format: str | None = None, mxfp4: bool = False) -> int:
    """Check every tensor the decoder will read from the :class:`freetoken.loaders.SafetensorsDir` ``sd`` by
    name, shape and dtype, that no tensor of a kind the decoder knows sits where the config has no use for it
    (a layer or expert beyond the config's counts, q/k norms or biases the family has not, a dense MLP in a
    MoE layer...), that block-FP8 tensors come with their scales (and only when ``quantization_config`` says
    FP8), and that the host memory the load needs is available. LoadError naming the file and tensor; returns
    the bytes the load allocates."""
    w = HFWeights(cfg, sd.get, sd.has, fp8_block=fp8_block, where=str(sd.path), mxfp4=mxfp4)
    expected: dict[str, tuple[int, ...]] = {w.name(k): v for k, v in global_shapes(cfg).items()}
    experts: list[str] = []
    for i in range(cfg.num_layers):
        expected.update({w.name(k, i): v for k, v in hf_layer_shapes(cfg, i).items()})
        if cfg.is_moe(i):
            shapes = w.expert_tensor_shapes(i)
            expected.update(shapes)
            experts += list(shapes)
    expert_set = set(experts)
    dense = 0
    for name, want in expected.items():
        info = sd.info(name)  # LoadError naming close matches when missing
        if info.shape != want:
            raise LoadError(info.file, f"expected shape {list(want)} (from config.json), got {list(info.shape)}",
                            name)
        scale = name + "_scale_inv"
        if info.dtype == "F8_E4M3" and fp8_block and sd.has(scale):
            s = sd.info(scale)
            ws = tuple(-(-d // 128) for d in want)
            if s.dtype not in HF_FLOAT_DTYPES or s.shape != ws:
                raise LoadError(s.file, f"expected a weight_scale_inv of shape {list(ws)} "
                                        f"({'/'.join(HF_FLOAT_DTYPES)}) for F8_E4M3 weight {list(want)}, got "
                                        f"{s.dtype} {list(s.shape)}", scale)
        elif info.dtype == "F8_E4M3":
            why = "no block-FP8 quantization_config in config.json" if not fp8_block else f"no {scale!r}"
            raise LoadError(info.file, f"F8_E4M3 weight without its block scales ({why})", name)
        elif mxfp4 and name.endswith(("_blocks", "_scales")) and name in expert_set:
            if info.dtype != "U8":
                raise LoadError(info.file, f"dtype {info.dtype}: MXFP4 blocks and scales are U8", name)
        elif info.dtype not in HF_FLOAT_DTYPES:
            also = " or F8_E4M3 with scales" if fp8_block else ""
            raise LoadError(info.file, f"dtype {info.dtype} is not a weight dtype (expected "
                                       f"{' / '.join(HF_FLOAT_DTYPES)}{also})", name)
        elif fp8_block and name in expert_set:
            raise LoadError(info.file, f"config.json's quantization_config says block FP8, but this expert weight "
                                       f"is {info.dtype} (the checkpoint is not block-FP8; remove quantization_config "
                                       "or use the FP8 checkpoint)", name)
        if name not in expert_set:
            dense += _held_bytes(want, info.dtype == "F8_E4M3")
    _check_no_strays(cfg, w, sd, set(expected))
    from freetoken.loaders.memory import check_load_bytes

    native = "fp8_block" if fp8_block else "mxfp4" if mxfp4 else None
    fmt = expert_format or native or "bf16"
    need = load_bytes(cfg, dense, fmt, kv_bytes)
    if fmt == native:
        need["float32 experts of one layer while quantized"] = 0  # the stored bytes and scales move as they are
    return check_load_bytes(sd.path, need)


def _held_bytes(shape: tuple[int, ...], fp8: bool) -> int:
    """Host bytes the decoder holds for a non-expert tensor: block-FP8 matrices as fp8_block rows
    (:meth:`HFWeights.get_matrix`; kv_b_proj's absorbed halves too, when its heads sit on scale tiles, which this
    check takes as given), the rest float32."""
    if fp8 and len(shape) == 2 and shape[1] % FP8_K_MULTIPLE == 0:
        return shape[0] * row_bytes("fp8_block", shape[1])
    return 4 * int(np.prod(shape))


_LAYER = re.compile(r"^model\.(?:language_model\.)?layers\.(\d+)\.(.*)$")
_EXPERT = re.compile(r"(?:^|\.)experts\.(\d+)\.")


def _check_no_strays(cfg: ModelConfig, w: HFWeights, sd, expected: set[str]) -> None:
    """LoadError for a tensor of a kind the decoder reads that this config leaves unread (a sign that
    config.json and the weights disagree: the tensor would be ignored silently)."""
    known = {}
    for i in range(cfg.num_layers):
        for key in (*_HF_LAYER, *FAMILIES[cfg.family].hf_layer_names):
            known[w.name(key, i)] = key
    for name in sd.names():
        if name in expected:
            continue
        if name.endswith("_scale_inv") and name.removesuffix("_scale_inv") in expected:
            continue
        m = _LAYER.match(name)
        if m is None:
            if name == w.name("lm_head") and cfg.tie_word_embeddings:
                continue  # some tied checkpoints store the copy; the embedding is used
            continue
        layer = int(m.group(1))
        where = sd.info(name).file
        if cfg.num_layers <= layer < cfg.num_layers + cfg.mtp_layers:
            continue  # a multi-token-prediction layer: not run (``run``/``chat`` say so)
        if layer >= cfg.num_layers:
            raise LoadError(where, f"layer {layer} is beyond num_hidden_layers = {cfg.num_layers} in config.json",
                            name)
        e = _EXPERT.search(m.group(2))
        if e is not None and (int(e.group(1)) >= cfg.num_experts or not cfg.is_moe(layer)):
            why = f"num_experts = {cfg.num_experts}" if cfg.is_moe(layer) else "a dense layer by config.json"
            raise LoadError(where, f"expert {int(e.group(1))} of layer {layer} does not exist in the config "
                                   f"({why})", name)
        if name in known:
            raise LoadError(where, f"{known[name]} tensor the config leaves unused (config.json and the weights "
                                   f"disagree: family {cfg.family}, qk_norm {cfg.qk_norm}, qkv_bias "
                                   f"{cfg.qkv_bias}, layer {layer} {'MoE' if cfg.is_moe(layer) else 'dense'})", name)


def llama_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """HF Q/K rows -> llama.cpp's order (what its converter does for ``llama`` models): within each head the
    first and second halves are interleaved, so that adjacent-pair RoPE equals HF's rotate-half RoPE."""
    half = w.shape[0] // heads // 2
    return w.reshape(heads, 2, half, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama_unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    """Inverse of :func:`llama_permute`."""
    half = w.shape[0] // heads // 2
    return w.reshape(heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def tiled_v_order(k_heads: int, v_heads: int, width: int) -> np.ndarray:
    """Index of the rows (heads of ``width``) of an HF value-head axis, in HF's grouped order (value head ``v`` of key
    head ``k`` at ``k * r + v``), that puts them in llama.cpp's tiled order (``v * k_heads + k``):
    ``tiled = grouped[tiled_v_order(...)]`` (what the converter does for qwen35moe)."""
    heads = np.arange(v_heads).reshape(k_heads, v_heads // k_heads).T.reshape(-1)
    return (heads[:, None] * width + np.arange(width)[None, :]).reshape(-1)


def grouped_v_order(k_heads: int, v_heads: int, width: int) -> np.ndarray:
    """The inverse of :func:`tiled_v_order`: ``grouped = tiled[grouped_v_order(...)]``."""
    return np.argsort(tiled_v_order(k_heads, v_heads, width))


def ssm_a_from_a_log(a_log: np.ndarray) -> np.ndarray:
    """The canonical ``lin_ssm_a`` of an HF ``A_log``, and what llama.cpp's converter stores as ``ssm_a``:
    ``-exp(A_log)`` (float64, rounded once to float32)."""
    return (-np.exp(np.asarray(a_log, np.float64))).astype(np.float32)


class Weights:
    """Interface: ``get(key, layer=None)`` float32 array, ``has(key, layer)``, ``expert_banks(layer, layout)``,
    ``native_expert_format`` (the format the experts are stored in, or None when they need quantizing)."""

    native_expert_format: str | None = None

    def name(self, key: str, layer: int | None = None) -> str:
        raise NotImplementedError

    def has(self, key: str, layer: int | None = None) -> bool:
        raise NotImplementedError

    def get(self, key: str, layer: int | None = None) -> np.ndarray:
        raise NotImplementedError

    def get_matrix(self, key: str, layer: int | None = None) -> np.ndarray | QuantizedMatrix:
        """A dense projection's matrix as the decoder's :class:`freetoken.models.linear.Linear` takes it: a
        :class:`QuantizedMatrix` when the source stores it in a block type Linear runs as is, else ``get``."""
        return self.get(key, layer)

    def quantized_kind(self, key: str, layer: int | None = None) -> str | None:
        """The :class:`QuantizedMatrix` kind :meth:`get_matrix` returns for ``key``, or None (a float array)."""
        return None

    def native_expert_formats(self, layer: int) -> tuple[str, str] | None:
        """The formats MoE layer ``layer``'s experts are stored in, (gate/up, down), or None when they are stored
        as floats (or in a type no format keeps) and need quantizing."""
        f = self.native_expert_format
        return None if f is None else (f, f)

    def expert_parts(self, layer: int) -> ExpertParts | None:
        """MoE layer ``layer``'s experts by stored layout when they are in several (an FTW file's mixed layer), else
        None."""
        return None

    def expert_banks(self, layer: int, layout: RecordLayout) -> dict[str, np.ndarray]:
        raise NotImplementedError


def expert_layouts(cfg: ModelConfig, weights: Weights,
                   expert_format: str | None = None) -> list[RecordLayout | ExpertParts]:
    """The record layout of every MoE layer, in order: ``expert_format`` (quantized from the stored values) for all
    layers when given, else each layer's stored formats (a GGUF Q4_K_M file: q4_k gate/up, q6_k or q4_k down
    depending on the layer; an FTW layer that mixes formats: its :class:`ExpertParts`), else bf16."""
    from freetoken import formats

    out = []
    for i in range(cfg.num_layers):
        if not cfg.is_moe(i):
            continue
        parts = None if expert_format else weights.expert_parts(i)
        if parts is not None:
            out.append(parts)
            continue
        native = None if expert_format else weights.native_expert_formats(i)
        up, down = native or (expert_format or "bf16",) * 2
        out.append(RecordLayout(formats.get(up), cfg.hidden, cfg.moe_inter, cfg.expert_bias, cfg.expert_act,
                                down_fmt=formats.get(down)))
    return out


class HFWeights(Weights):
    """An HF checkpoint. ``get_tensor(name)`` returns the stored array (any dtype, may be e4m3);
    ``has_tensor(name)`` says whether it exists. With ``fp8_block=True`` every tensor that has a
    ``<name>_scale_inv`` companion is block-FP8 and is dequantized (or moved as is into fp8_block banks)."""

    def __init__(self, cfg: ModelConfig, get_tensor, has_tensor=None, fp8_block: bool = False, where: str = "",
                 mxfp4: bool = False):
        self.cfg, self._get, self._fp8, self.where = cfg, get_tensor, fp8_block, where
        self._has, self._mxfp4 = has_tensor, mxfp4
        self.native_expert_format = "fp8_block" if fp8_block else "mxfp4" if mxfp4 else None
        # Qwen3.5's image-text checkpoints keep the language model under model.language_model. (the vision tower,
        # model.visual.*, and the multi-token-prediction layers, mtp.*, are never read)
        self.family = FAMILIES[cfg.family]
        prefixes = self.family.hf_model_prefixes
        self._model = prefixes[0] if len(prefixes) == 1 else \
            next((p for p in prefixes if self._exists(p + "embed_tokens.weight")), prefixes[-1])

    def name(self, key: str, layer: int | None = None) -> str:
        if layer is None:
            name = _HF_GLOBAL[key]
            return self._model + name.removeprefix("model.") if name.startswith("model.") else name
        name = self.family.hf_layer_names.get(key) or _HF_LAYER[key]
        return f"{self._model}layers.{layer}." + name.format(moe=self.family.hf_moe_prefix)

    def _exists(self, name: str) -> bool:
        if self._has is not None:
            return bool(self._has(name))
        try:
            self._get(name)
        except (KeyError, LoadError):
            return False
        return True

    def _scale_name(self, name: str) -> str | None:
        if not self._fp8 or not name.endswith(".weight"):
            return None
        scale = name + "_scale_inv"
        return scale if self._exists(scale) else None

    def tensor_f32(self, name: str) -> np.ndarray:
        """One stored tensor as float32, block-FP8 dequantized."""
        w = self._get(name)
        scale = self._scale_name(name)
        if scale is None:
            return np.asarray(w, dtype=np.float32)
        from freetoken.formats import fp8_block

        s = np.asarray(self._get(scale), np.float32)
        n, k = w.shape
        want = (-(-n // 128), -(-k // 128))
        if s.shape != want:
            raise LoadError(self.where, f"expected a weight_scale_inv of shape {list(want)} for weight "
                                        f"{[n, k]}, got {list(s.shape)}", scale)
        return fp8_block.FORMAT.dequantize(fp8_block.from_hf(np.asarray(w)[None], s[None]))[0]

    def get(self, key: str, layer: int | None = None) -> np.ndarray:
        if key == "lm_head" and self.cfg.tie_word_embeddings:
            key = "embed"
        fused = self._fused_source(key)
        if fused is not None:
            return split_qwen3_next(self.cfg, key, self.tensor_f32(self.name(fused, layer)))
        w = self.tensor_f32(self.name(key, layer))
        if key == "lin_ssm_a":  # stored as A_log; the decay rate the model uses is -exp(A_log)
            return ssm_a_from_a_log(w)
        if self.cfg.norm_offset and key in OFFSET_NORMS:
            w = w + np.float32(1.0)  # zero-centred storage: the model's norm multiplies by 1 + w
        return w

    def has(self, key: str, layer: int | None = None) -> bool:
        return self._exists(self.name(self._fused_source(key) or key, layer))

    def _fused_source(self, key: str) -> str | None:
        """The Qwen3-Next fused projection (``lin_qkvz`` / ``lin_ba``) that ``key``'s rows are read out of, or None."""
        if not self.family.fused_linear_inputs or key not in ("lin_qkv", "lin_z", "lin_b", "lin_a"):
            return None
        return "lin_ba" if key in ("lin_b", "lin_a") else "lin_qkvz"

    def _fp8_matrix(self, key: str, layer: int | None) -> tuple[str, str] | None:
        """(weight name, scale name) of ``key`` when it is a block-FP8 matrix whose K the fp8 dense kernels take (a
        multiple of 16), else None."""
        if key == "lm_head" and self.cfg.tie_word_embeddings:
            key = "embed"
        name = self.name(key, layer)
        scale = self._scale_name(name)
        if scale is None:
            return None
        shape = self._get(name).shape
        return (name, scale) if len(shape) == 2 and shape[1] % FP8_K_MULTIPLE == 0 else None

    def quantized_kind(self, key: str, layer: int | None = None) -> str | None:
        """"fp8_block" for a block-FP8 matrix the fp8 dense kernels take (:meth:`_fp8_matrix`), else None."""
        return "fp8_block" if self._fp8_matrix(key, layer) is not None else None

    def get_matrix(self, key: str, layer: int | None = None) -> np.ndarray | QuantizedMatrix:
        """A block-FP8 matrix stays in its codes and scales (:func:`freetoken.models.qmatrix.from_hf_fp8`: 1.03 bytes
        per weight instead of 4 dequantized); anything else as :meth:`get`."""
        names = self._fp8_matrix(key, layer)
        if names is None:
            return self.get(key, layer)
        name, scale = names
        w, s = np.asarray(self._get(name)), np.asarray(self._get(scale), np.float32)  # bf16/f16 scales: exact
        if w.dtype.itemsize != 1:
            raise LoadError(self.where, f"a block-FP8 weight must be 1-byte e4m3 codes, got {w.dtype}", name)
        try:
            return from_hf_fp8(w.view(np.uint8), s)
        except ValueError as e:
            raise LoadError(self.where, str(e), scale) from None

    def _expert_prefix(self, layer: int) -> str:
        return f"{self._model}layers.{layer}.{self.family.hf_moe_prefix}experts."

    def _fused_experts(self, layer: int) -> bool:
        """Whether ``layer``'s experts are stored as one ``gate_up_proj`` [E, 2I, H] (gate rows, then up rows) and one
        ``down_proj`` [E, H, I] (Qwen3.5's releases), not per expert."""
        return self.family.hf_stacked_experts and \
            self._exists(self._expert_prefix(layer) + "gate_up_proj")

    def _expert_names(self, layer: int) -> dict[str, list[str]]:
        prefix = self._expert_prefix(layer)
        names = self.family.hf_expert_names
        return {m: [f"{prefix}{j}.{n}.weight" for j in range(self.cfg.num_experts)]
                for m, n in zip(MATRICES, names, strict=True)}

    def expert_tensor_shapes(self, layer: int) -> dict[str, tuple[int, ...]]:
        """Name -> stored shape of every routed-expert tensor of ``layer``."""
        e, h, i = self.cfg.num_experts, self.cfg.hidden, self.cfg.moe_inter
        if self.family.hf_experts_interleaved:
            prefix = self._expert_prefix(layer)
            if self._mxfp4:  # the release checkpoints: MXFP4 blocks of 32 (16 bytes) and e8m0 scales, rows [out]
                return {prefix + "gate_up_proj_blocks": (e, 2 * i, h // 32, 16),
                        prefix + "gate_up_proj_scales": (e, 2 * i, h // 32), prefix + "gate_up_proj_bias": (e, 2 * i),
                        prefix + "down_proj_blocks": (e, h, i // 32, 16), prefix + "down_proj_scales": (e, h, i // 32),
                        prefix + "down_proj_bias": (e, h)}
            shapes = ((e, h, 2 * i), (e, 2 * i), (e, i, h), (e, h))
            return {prefix + n: s for n, s in zip(GPT_OSS_EXPERTS, shapes, strict=True)}
        if self._fused_experts(layer):
            prefix = self._expert_prefix(layer)
            return {prefix + "gate_up_proj": (e, 2 * i, h), prefix + "down_proj": (e, h, i)}
        names = self._expert_names(layer)
        return {**dict.fromkeys(names["gate"], (i, h)), **dict.fromkeys(names["up"], (i, h)),
                **dict.fromkeys(names["down"], (h, i))}

    def expert_stack(self, layer: int, matrix: str) -> np.ndarray:
        """float32 [E, N, K] of one matrix ("gate", "up", "down") of every routed expert of ``layer``."""
        if self.family.hf_experts_interleaved and self._mxfp4:
            from freetoken.formats import mxfp4

            return mxfp4.decode(**{k[0]: v for k, v in self._mxfp4_banks(layer)[matrix].items()})
        if self.family.hf_experts_interleaved:
            prefix = self._expert_prefix(layer)
            if matrix == "down":
                return np.ascontiguousarray(self.tensor_f32(prefix + "down_proj").transpose(0, 2, 1))
            gate_up = self.tensor_f32(prefix + "gate_up_proj")  # [E, H, 2I], gate and up interleaved
            first = 0 if matrix == "gate" else 1
            return np.ascontiguousarray(gate_up[:, :, first::2].transpose(0, 2, 1))
        if self._fused_experts(layer):
            prefix = self._expert_prefix(layer)
            if matrix == "down":
                return self.tensor_f32(prefix + "down_proj")
            gate_up = self.tensor_f32(prefix + "gate_up_proj")
            half = gate_up.shape[1] // 2
            return np.ascontiguousarray(gate_up[:, :half] if matrix == "gate" else gate_up[:, half:])
        return np.stack([self.tensor_f32(n) for n in self._expert_names(layer)[matrix]])

    def _mxfp4_banks(self, layer: int) -> dict[str, dict[str, np.ndarray]]:
        """{"gate": {"w", "s"}, "up": ..., "down": ...} mxfp4 banks of a gpt-oss MXFP4 checkpoint's layer (bits
        moved: gate and up de-interleaved from ``gate_up_proj``'s rows)."""
        from freetoken.formats import mxfp4

        prefix = self._expert_prefix(layer)
        try:
            gate, up = mxfp4.from_gpt_oss(self._get(prefix + "gate_up_proj_blocks"),
                                          self._get(prefix + "gate_up_proj_scales"))
            down = mxfp4.from_gpt_oss_down(self._get(prefix + "down_proj_blocks"),
                                           self._get(prefix + "down_proj_scales"))
        except ValueError as e:
            raise LoadError(self.where, f"layer {layer} experts: {e}", prefix + "*_blocks") from e
        return {"gate": gate, "up": up, "down": down}

    def expert_biases(self, layer: int) -> dict[str, np.ndarray]:
        """float32 {"gate": [E, I], "up": [E, I], "down": [E, H]} of ``layer``'s routed experts (gpt-oss)."""
        prefix = self._expert_prefix(layer)
        gate_up = self.tensor_f32(prefix + "gate_up_proj_bias")
        return {"gate": np.ascontiguousarray(gate_up[:, 0::2]), "up": np.ascontiguousarray(gate_up[:, 1::2]),
                "down": self.tensor_f32(prefix + "down_proj_bias")}

    def expert_banks(self, layer: int, layout: RecordLayout) -> dict[str, np.ndarray]:
        names = self._expert_names(layer)
        if layout.fmt.name == "fp8_block" and self._fp8 and all(self._scale_name(n) for n in names["gate"][:1]):
            from freetoken.formats import fp8_block

            out = {}
            for m in MATRICES:
                w = np.stack([np.asarray(self._get(n)) for n in names[m]])
                s = np.stack([np.asarray(self._get(n + "_scale_inv"), np.float32) for n in names[m]])
                try:
                    banks = fp8_block.from_hf(w, s)
                except ValueError as e:
                    raise LoadError(self.where, f"layer {layer} {m} experts: {e}", names[m][0]) from e
                out.update({f"{m}.{k}": v for k, v in banks.items()})
            return out
        biases = self.expert_biases(layer) if layout.bias else None
        if self._mxfp4 and layout.fmt.name == "mxfp4":
            banks = {f"{m}.{k}": v for m, b in self._mxfp4_banks(layer).items() for k, v in b.items()}
            if biases is not None:
                banks.update({f"{m}.b": np.ascontiguousarray(b, np.float32) for m, b in biases.items()})
            return banks
        return layout.quantize(*(self.expert_stack(layer, m) for m in MATRICES), biases=biases)


class GGUFWeights(Weights):
    """A :class:`freetoken.loaders.GGUFFile` as decoder weights."""

    def __init__(self, cfg: ModelConfig, gguf):
        self.cfg, self.gguf = cfg, gguf
        first_moe = next((i for i in range(cfg.num_layers) if cfg.is_moe(i)), None)
        self.native_expert_format = None  # the first MoE layer's record formats ("q4_k+q6_k"), for reports
        if first_moe is not None:
            formats = self.native_expert_formats(first_moe)
            self.native_expert_format = None if formats is None else \
                formats[0] if formats[0] == formats[1] else "+".join(formats)

    def name(self, key: str, layer: int | None = None) -> str:
        table = _GGUF_GLOBAL if layer is None else _GGUF_LAYER
        if key not in table:
            raise LoadError(self.gguf.path, f"weight key {key!r} has no GGUF tensor name"
                                            f"{'' if layer is None else f' (layer {layer})'}")
        return _GGUF_GLOBAL[key] if layer is None else f"blk.{layer}." + gguf_layer_name(self.gguf.arch, key)

    def has(self, key: str, layer: int | None = None) -> bool:
        if key not in (_GGUF_GLOBAL if layer is None else _GGUF_LAYER):
            return False
        stored = key if key == "lm_head" else self._source(key, layer)[0]  # lm_head: whether output.weight is there
        return self.gguf.has(self.name(stored, layer))

    def _source(self, key: str, layer: int | None) -> tuple[str, np.ndarray | None, np.ndarray | None]:
        """(the key of the tensor ``key`` is read from, the rows of it that give ``key``'s rows in HF's order or
        None, the same for its columns): tied embeddings, qwen3next's fused ``ssm_ba``, qwen35moe's tiled value
        heads (the module docstring)."""
        cfg = self.cfg
        if key == "lm_head" and not self.gguf.has(_GGUF_GLOBAL["lm_head"]):
            return "embed", None, None  # tied embeddings: llama.cpp files simply omit output.weight
        if layer is None or not key.startswith("lin_"):
            return key, None, None
        hk, hv, dv = cfg.linear_k_heads, cfg.linear_v_heads, cfg.linear_v_dim
        if self.gguf.arch == "qwen3next" and key in ("lin_b", "lin_a"):
            r = hv // hk  # ssm_ba: per key head, its r value heads' b rows then their a rows
            first = 0 if key == "lin_b" else r
            return "lin_ba", (np.arange(hk)[:, None] * 2 * r + first + np.arange(r)[None, :]).reshape(-1), None
        if self.gguf.arch != GGUF_TILED_V_ARCH or hk == hv:
            return key, None, None
        if key in ("lin_qkv", "lin_conv"):
            qk = 2 * hk * cfg.linear_k_dim
            return key, np.concatenate([np.arange(qk), qk + grouped_v_order(hk, hv, dv)]), None
        if key == "lin_z":
            return key, grouped_v_order(hk, hv, dv), None
        if key in ("lin_b", "lin_a", "lin_dt_bias", "lin_ssm_a"):
            return key, grouped_v_order(hk, hv, 1), None
        if key == "lin_out":
            return key, None, grouped_v_order(hk, hv, dv)
        return key, None, None

    def get(self, key: str, layer: int | None = None) -> np.ndarray:
        if key == "kv_b_proj" and not self.has(key, layer):  # the split halves: back to HF's [H * (nope + v), R]
            k_b = self.gguf.get_f32(f"blk.{layer}.{GGUF_K_B}")  # [H, R, nope]
            v_b = self.gguf.get_f32(f"blk.{layer}.{GGUF_V_B}")  # [H, v, R]
            kv = np.concatenate([k_b.transpose(0, 2, 1), v_b], axis=1)
            return np.ascontiguousarray(kv.reshape(-1, kv.shape[-1]))
        stored, rows, cols = self._source(key, layer)
        name = self.name(stored, layer)
        w = self.gguf.get_f32(name)
        if key in ("lin_ssm_a", "lin_dt_bias"):
            w = w.reshape(-1)  # [Hv] (a [1, Hv] tensor is the same numbers)
        if key == "lin_ssm_a" and not np.all(w <= 0):  # the decay is exp(ssm_a * softplus(..)): a rate in (0, 1]
            raise LoadError(self.gguf.path, f"expected -exp(A_log) (values <= 0), got {w[~(w <= 0)][:4].tolist()}",
                            name)
        if rows is not None:
            w = w[rows]
        if cols is not None:
            w = w[:, cols]
        if key == "lin_conv":
            w = w.reshape(w.shape[0], 1, -1)  # stored squeezed [C, K]; HF's conv1d.weight is [C, 1, K]
        if key == "shared_sigmoid":
            w = w.reshape(1, -1)  # stored as a vector [hidden] by some converters; the decoder wants HF's [1, hidden]
        if self.gguf.arch == "llama" and key in ("q_proj", "k_proj", "q_bias", "k_bias"):
            heads = self.cfg.num_heads if key[0] == "q" else self.cfg.num_kv_heads
            w = llama_unpermute(w, heads)
        return np.ascontiguousarray(w)

    #: ggml type -> QuantizedMatrix kind of the matrices kept quantized.
    QUANTIZED = {r.ggml: r.name for r in FORMAT_ROWS if r.dense}

    def quantized_kind(self, key: str, layer: int | None = None) -> str | None:
        if key == "kv_b_proj" and not self.has(key, layer):
            return None  # llama.cpp's split attn_k_b / attn_v_b: get() puts the float matrix back together
        stored, _, cols = self._source(key, layer)
        kind = self.kept_kind(self.gguf.info(self.name(stored, layer)))
        if kind is not None and cols is not None and self.cfg.linear_v_dim % k_multiple(kind):
            return None  # qwen35moe's ssm_out: heads of Dv columns are not whole blocks, so they are read as float32
        return kind

    @classmethod
    def kept_kind(cls, info) -> str | None:
        """The :class:`QuantizedMatrix` kind a tensor (a ``GGUFTensorInfo``) is kept in, or None when it is read as
        float32: another type, a vector (shared_sigmoid), or rows that are not whole blocks."""
        kind = cls.QUANTIZED.get(info.type)
        if kind is None or len(info.shape) != 2 or info.shape[1] % k_multiple(kind):
            return None
        return kind

    def get_matrix(self, key: str, layer: int | None = None) -> np.ndarray | QuantizedMatrix:
        kind = self.quantized_kind(key, layer)
        if kind is None:
            return self.get(key, layer)
        stored, rows, cols = self._source(key, layer)
        raw, _, shape = self.gguf.get_raw(self.name(stored, layer))
        blocks = np.array(raw)  # a host copy of the file's bytes (as get_f32 makes one)
        if self.gguf.arch == "llama" and key in ("q_proj", "k_proj"):
            heads = self.cfg.num_heads if key[0] == "q" else self.cfg.num_kv_heads
            blocks = np.ascontiguousarray(llama_unpermute(blocks, heads))  # whole rows move: exact on block rows
        if rows is not None:  # whole rows move: exact
            blocks = np.ascontiguousarray(blocks[rows])
            shape = (len(rows), shape[1])
        if cols is not None:  # heads of whole blocks move within each row (quantized_kind checked): exact
            per = k_multiple(kind)
            heads = cols.reshape(-1, self.cfg.linear_v_dim)[:, 0] // self.cfg.linear_v_dim
            bph = self.cfg.linear_v_dim // per  # blocks per head
            order = (heads[:, None] * bph + np.arange(bph)[None, :]).reshape(-1)
            n = blocks.shape[0]
            blocks = np.ascontiguousarray(blocks.reshape(n, shape[1] // per, -1)[:, order].reshape(n, -1))
        return QuantizedMatrix(kind, blocks, shape)

    def native_expert_formats(self, layer: int) -> tuple[str, str] | None:
        try:
            return self.gguf.expert_formats(layer)
        except LoadError:
            return None  # f16/bf16/unsupported experts: decoded and quantized on load

    def expert_banks(self, layer: int, layout: RecordLayout) -> dict[str, np.ndarray]:
        names = self.gguf.expert_names(layer)
        if (layout.fmt.name, layout.format_of("down").name) == self.native_expert_formats(layer):
            banks = self.gguf.expert_banks(layer)
            if layout.bias != any(k.endswith(".b") for k in banks):
                raise LoadError(self.gguf.path, f"layer {layer}: expert biases do not match the record layout",
                                names["gate"])
            return banks
        biases = {m: self.gguf.get_f32(names[m].removesuffix(".weight") + ".bias") for m in MATRICES} \
            if layout.bias else None
        return layout.quantize(*(self.gguf.get_f32(names[m]) for m in MATRICES), biases=biases)
