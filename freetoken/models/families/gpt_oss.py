"""gpt-oss: sliding-window layers alternating with full ones (``layer_types``), attention sinks, biases on the
attention output and the router's logits, experts with biases run with the clamped SwiGLU (``swiglu_limit`` 7,
``swiglu_alpha`` 1.702: the kernels' constants, other values refused by name); every layer MoE."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from freetoken.models.families.base import Family, GGUFConfig, HFConfig
from freetoken.models.fields import MAX_LAYERS, MAX_POSITIONS, ConfigError

#: What every gpt-oss model has, whatever file it comes from.
_ALWAYS = dict(attention_sinks=True, o_bias=True, router_logit_bias=True, expert_bias=True, expert_act="gpt_oss")


@dataclass(frozen=True, eq=False)
class GptOss(Family):
    def hf_fields(self, c: HFConfig) -> dict:
        return {**super().hf_fields(c), **self._hf_oss(c)}

    def hf_moe(self, c: HFConfig) -> dict:
        # softmax over the top-k logits = the top-k renormalised
        return dict(**c.experts(), **c.expert_ffn_only(), norm_topk_prob=True, moe_layers=c.sparse_step_layers())

    @staticmethod
    def _hf_oss(c: HFConfig) -> dict:
        """The window and which layers have it (transformers' default: even layers windowed), the constants."""
        from freetoken.device.constants import GPT_OSS_ALPHA, GPT_OSS_LIMIT

        f, layers = c.f, c.layers
        for key, want in (("swiglu_limit", GPT_OSS_LIMIT), ("swiglu_alpha", GPT_OSS_ALPHA)):
            got = f.float(key, default=want)
            if got != want:
                f.fail(key, got, f"{want:g} (the expert kernels' constant)")
        window = f.int("sliding_window", default=128, lo=0, hi=MAX_POSITIONS)
        types = f.get("layer_types")
        if types is None:
            types = ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(layers)]
        if not isinstance(types, list) or len(types) != layers or \
                any(t not in ("sliding_attention", "full_attention") for t in types):
            f.fail("layer_types", types, f"a list of {layers} 'sliding_attention' / 'full_attention'")
        return dict(sliding_windows=tuple(window if t == "sliding_attention" else 0 for t in types), **_ALWAYS)

    def gguf_router(self, g: GGUFConfig, scale: float, mtp: int) -> dict:
        """As llama.cpp reads a file: the window and which layers have it (``{arch}.attention.
        sliding_window_pattern``: a per-layer array, or every n-th layer full, default n = 2, so layer 0 is
        windowed), and the tensors every gpt-oss file has."""
        gf, m, arch, layers = g.gf, g.m, g.arch, g.layers
        window = m.int(f"{arch}.attention.sliding_window", lo=0, hi=MAX_POSITIONS)
        pattern = gf.meta(f"{arch}.attention.sliding_window_pattern", None)
        if pattern is None or isinstance(pattern, (int, float)):
            n = 2 if pattern is None else m.int(f"{arch}.attention.sliding_window_pattern", hi=MAX_LAYERS)
            swa = [i % n < n - 1 for i in range(layers)]
        else:
            swa = [bool(x) for x in np.asarray(pattern).reshape(-1)]
            if len(swa) < layers:
                raise ConfigError(f"{g.where}: {arch}.attention.sliding_window_pattern has {len(swa)} entries for "
                                  f"{layers} layers")
        for name in ("attn_sinks.weight", "attn_output.bias", "ffn_gate_inp.bias", "ffn_gate_exps.bias",
                     "ffn_up_exps.bias", "ffn_down_exps.bias"):
            if not gf.has(f"blk.0.{name}"):
                raise ConfigError(f"{g.where}: a gpt-oss file without blk.0.{name}")
        return dict(sliding_windows=tuple(window if swa[i] else 0 for i in range(layers)), **_ALWAYS)

    def write_gguf(self, writer, cfg, rope_sections) -> None:
        # the window, and which layers have it (a per-layer array: llama.cpp reads it before its every-2nd default)
        writer.add_sliding_window(max(cfg.sliding_windows))
        writer.add_sliding_window_pattern([w > 0 for w in cfg.sliding_windows])


FAMILY = GptOss("gpt_oss", ("gpt_oss",), "gpt-oss", gguf_norm_topk=True, hf_experts_interleaved=True,
                hf_layer_names={"router": "mlp.router.weight", "router_logit_bias": "mlp.router.bias"},
                gguf_layer_names={"mlp_norm": "post_attention_norm.weight"})
