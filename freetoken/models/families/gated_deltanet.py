"""The hybrid families' layers (Qwen3-Next, Qwen3.5-MoE): Gated DeltaNet linear attention beside gated full
attention (``layer_types``), the sigmoid output gate the q projection carries, a quarter of each head rotated, norms
stored zero-centred, a gated shared expert and multi-token-prediction layers after the decoder's (skipped)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from freetoken.models.families.base import Family, GGUFConfig, HFConfig
from freetoken.models.fields import MAX_HEAD_DIM, MAX_HEADS, MAX_LAYERS, ConfigError

#: Layer kinds of ``ModelConfig.layer_types``.
LAYER_TYPES = ("full_attention", "linear_attention")


@dataclass(frozen=True, eq=False)
class HybridFamily(Family):
    hybrid: bool = True
    gguf_norm_topk: bool = True
    shared_expert: str = "gated"
    partial_rotary: float = 0.25
    hf_stacked_experts: bool = True

    def hf_qk_norm(self, c: HFConfig) -> str:
        return "head"

    def hf_fields(self, c: HFConfig) -> dict:
        """The layer kinds and Gated DeltaNet dims (transformers' defaults: every 4th layer full attention,
        ``full_attention_interval``), the gated attention output and the zero-centred norms."""
        f, layers = c.f, c.layers
        out = super().hf_fields(c)
        types = f.get("layer_types")
        if types is None:
            every = f.int("full_attention_interval", default=4, hi=MAX_LAYERS)
            types = ["full_attention" if (i + 1) % every == 0 else "linear_attention" for i in range(layers)]
        if not isinstance(types, list) or len(types) != layers or any(t not in LAYER_TYPES for t in types):
            f.fail("layer_types", types, f"a list of {layers} of {', '.join(LAYER_TYPES)}")
        if f.bool("attention_bias", False):
            f.fail("attention_bias", True, "false (biases on a gated q projection are not supported)")
        return dict(out, layer_types=tuple(types),
                    linear_k_heads=f.int("linear_num_key_heads", hi=MAX_HEADS),
                    linear_v_heads=f.int("linear_num_value_heads", hi=MAX_HEADS),
                    linear_k_dim=f.int("linear_key_head_dim", hi=MAX_HEAD_DIM),
                    linear_v_dim=f.int("linear_value_head_dim", hi=MAX_HEAD_DIM),
                    linear_conv=f.int("linear_conv_kernel_dim", default=4, hi=64),
                    attn_output_gate=True, norm_offset=True)

    def gguf_layer_kinds(self, g: GGUFConfig) -> dict:
        """Qwen3-Next's / Qwen3.5-MoE's fields of a GGUF file, as llama.cpp reads them and its converter writes them.

        Which layers are Gated DeltaNet: ``{arch}.attention.recurrent_layers`` (one flag per block, the MTP blocks
        included; the converter writes it from the config's ``layer_types``), else every
        ``{arch}.full_attention_interval``-th layer (default 4) is full attention and the rest linear; each layer's
        tensors must agree (a linear layer has ``ssm_a``, a full one ``attn_q``). The linear layers' dims:
        ``ssm.group_count`` key heads, ``ssm.time_step_rank`` value heads, ``ssm.state_size`` the key head dim,
        ``ssm.inner_size`` value heads x value head dim, ``ssm.conv_kernel`` the convolution's taps. What every such
        model has: the sigmoid output gate in ``attn_q`` and zero-centred norms (stored as ``1 + w``, read as stored).
        Refused by name: qwen3next's older fused ``ssm_in`` and a fused ``attn_qkv`` in a full-attention layer."""
        gf, m, arch, layers, blocks, where = g.gf, g.m, g.arch, g.layers, g.blocks, g.where
        key = f"{arch}.attention.recurrent_layers"
        rec = gf.meta(key, None)
        if rec is not None:
            flags = [bool(x) for x in np.asarray(rec).reshape(-1)]
            if len(flags) == 1:  # one value for every block (llama.cpp's key-or-array)
                flags *= blocks
            if len(flags) != blocks:
                raise ConfigError(f"{where}: {key} has {len(flags)} entries for {blocks} blocks ({arch}.block_count)")
            source = key
        else:
            every = m.int(f"{arch}.full_attention_interval", default=4, hi=MAX_LAYERS)
            flags = [(i + 1) % every != 0 for i in range(blocks)]
            source = f"{arch}.full_attention_interval {every}"
        types = tuple("linear_attention" if flags[i] else "full_attention" for i in range(layers))
        for i, t in enumerate(types):
            linear = t == "linear_attention"
            if linear and gf.has(f"blk.{i}.ssm_in.weight") and not gf.has(f"blk.{i}.attn_qkv.weight"):
                raise ConfigError(f"{where}: blk.{i}.ssm_in.weight: the fused q|k|v|z projection of older qwen3next "
                                  "conversions is not supported; re-convert with a current convert_hf_to_gguf.py "
                                  "(attn_qkv + attn_gate)")
            if linear != gf.has(f"blk.{i}.ssm_a"):
                kind = "linear-attention (Gated DeltaNet)" if linear else "full-attention"
                raise ConfigError(f"{where}: {source} makes layer {i} a {kind} layer, but the file "
                                  f"{'lacks' if linear else 'has'} blk.{i}.ssm_a")
            if not linear and gf.has(f"blk.{i}.attn_qkv.weight") and not gf.has(f"blk.{i}.attn_q.weight"):
                raise ConfigError(f"{where}: blk.{i}.attn_qkv.weight: a fused q|k|v projection in a full-attention "
                                  "layer is not supported (attn_q, attn_k and attn_v, as the converter writes them by "
                                  "default)")
        dims = dict(linear_k_heads=0, linear_v_heads=0, linear_k_dim=0, linear_v_dim=0, linear_conv=0)
        if "linear_attention" in types:
            v_heads = m.int(f"{arch}.ssm.time_step_rank", hi=MAX_HEADS)
            inner = m.int(f"{arch}.ssm.inner_size", hi=MAX_HEADS * MAX_HEAD_DIM)
            if inner % v_heads:
                raise ConfigError(f"{where}: {arch}.ssm.inner_size {inner} is not a whole number of value heads "
                                  f"({arch}.ssm.time_step_rank {v_heads})")
            dims = dict(linear_k_heads=m.int(f"{arch}.ssm.group_count", hi=MAX_HEADS), linear_v_heads=v_heads,
                        linear_k_dim=m.int(f"{arch}.ssm.state_size", hi=MAX_HEAD_DIM), linear_v_dim=inner // v_heads,
                        linear_conv=m.int(f"{arch}.ssm.conv_kernel", hi=64))
        return dict(layer_types=types, attn_output_gate=True, norm_offset=True, **dims)

    def gguf_router(self, g: GGUFConfig, scale: float, mtp: int) -> dict:
        """The plain router; the MTP block(s) after the decoder's (nextn) are not run, as for DeepSeek-V3."""
        if scale != 1.0:
            raise ConfigError(f"{g.where}: expert_weights_scale {scale} is not supported")
        return dict(mtp_layers=mtp)

    def gguf_check_attention(self, g: GGUFConfig, first_attention: int, qk_norm: str, qkv_bias: bool) -> None:
        if qk_norm != "head" or qkv_bias:
            raise ConfigError(f"{g.where}: a {g.arch} model's attention has q/k norms (blk.{first_attention}."
                              f"attn_q_norm.weight) and no biases; this file "
                              f"{'has biases (attn_q.bias)' if qkv_bias else 'lacks the norms'}")

    def write_gguf(self, writer, cfg, rope_sections) -> None:
        """The keys llama.cpp's converter writes (:mod:`freetoken.convert.gguf_export`'s module doc)."""
        arch = self.gguf_arch
        writer.add_ssm_conv_kernel(cfg.linear_conv)
        writer.add_ssm_state_size(cfg.linear_k_dim)
        writer.add_ssm_group_count(cfg.linear_k_heads)
        writer.add_ssm_time_step_rank(cfg.linear_v_heads)
        writer.add_ssm_inner_size(cfg.linear_v_dim * cfg.linear_v_heads)
        linear = [cfg.is_linear(i) for i in range(cfg.num_layers)]
        writer.add_array(f"{arch}.attention.recurrent_layers", linear)  # gguf-py's add_recurrent_layers, newer ones
        # the interval that gives these layers (llama.cpp reads it only without the array above), else transformers' 4
        every = next((n for n in range(1, cfg.num_layers + 1)
                      if linear == [(j + 1) % n != 0 for j in range(cfg.num_layers)]), 4)
        writer.add_full_attention_interval(every)
        writer.add_rope_dimension_count(cfg.rope_dim)

    def llama_cpp_notes(self, cfg, rope_sections) -> list[str]:
        arch, notes = self.gguf_arch, []
        if not all(cfg.moe_layers):
            notes.append(f"llama.cpp's {arch} has no dense MLP layers (mlp_only_layers): llama.cpp will not load this "
                         "file (freetoken does)")
        if cfg.linear_v_dim != cfg.linear_k_dim and "linear_attention" in cfg.layer_types:
            notes.append(f"llama.cpp's {arch} sizes the linear-attention value heads by the key head dim "
                         f"({arch}.ssm.state_size): it will not load a model whose linear_value_head_dim "
                         f"({cfg.linear_v_dim}) differs from linear_key_head_dim ({cfg.linear_k_dim}) (freetoken does)")
        return notes
