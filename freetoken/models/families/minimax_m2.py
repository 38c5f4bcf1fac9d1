"""MiniMax-M2: grouped-query attention with q/k RMSNorms over the whole projection (OLMoE's kind; the config's
``use_qk_norm`` with ``qk_norm_type`` "per_layer"), the first ``rotary_dim`` dims of each head rotated; every layer
MoE with Mixtral's layout (``block_sparse_moe``, experts ``w1``/``w3``/``w2``), routed by sigmoid scores with a
selection bias (``e_score_correction_bias``) and the top-k renormalised, no shared expert, no expert groups. Its
multi-token-prediction modules are not read. llama.cpp: ``minimax-m2``."""

from __future__ import annotations

from dataclasses import dataclass

from freetoken.models.families.base import Family, GGUFConfig, HFConfig
from freetoken.models.families.deepseek_moe import GATING_NONE, GATING_SIGMOID
from freetoken.models.fields import ConfigError

#: The router every MiniMax-M2 has: DeepSeek-V3's sigmoid scores and selection bias over one group, unscaled.
_ROUTER = dict(router="sigmoid_group", n_group=1, topk_group=1, routed_scale=1.0)


@dataclass(frozen=True, eq=False)
class MiniMaxM2(Family):
    def hf_attention(self, c: HFConfig) -> dict:
        f, raw = c.f, c.raw
        for key, want in (("use_qk_norm", True), ("qk_norm_type", "per_layer")):
            if raw.get(key) not in (None, want):
                f.fail(key, raw.get(key), f"{want!r} (q/k norms over the whole projection)")
        head_dim = c.head_dim()
        # the released config names ``rotary_dim``; transformers turns it into partial_rotary_factor
        default = f.int("rotary_dim", hi=head_dim) / head_dim if raw.get("rotary_dim") is not None else 1.0
        return dict(head_dim=head_dim, qk_norm="full", qkv_bias=False, rotary_dim=c.rotary_dim(head_dim, default))

    def hf_moe(self, c: HFConfig) -> dict:
        f, raw = c.f, c.raw
        for key, want in (("scoring_func", "sigmoid"), ("use_routing_bias", True)):
            if raw.get(key) not in (None, want):
                f.fail(key, raw.get(key), f"{want!r} (MiniMax-M2's router)")
        return dict(**c.experts(), **c.expert_ffn_only(), norm_topk_prob=True, moe_layers=(True,) * c.layers,
                    **_ROUTER)

    def gguf_router(self, g: GGUFConfig, scale: float, mtp: int) -> dict:
        """Sigmoid scores (``expert_gating_func``, which llama.cpp's minimax-m2 needs: its converter writes it from
        the config's ``scoring_func``; a file without it is read as the model defines it)."""
        super().gguf_router(g, scale, mtp)  # no scale, no MTP layers
        gating = g.m.int(f"{g.arch}.expert_gating_func", default=GATING_NONE, lo=0, hi=8)
        if gating not in (GATING_NONE, GATING_SIGMOID):
            raise ConfigError(f"{g.where}: {g.arch}.expert_gating_func {gating}: MiniMax-M2 scores with a sigmoid")
        return dict(_ROUTER)

    def write_gguf(self, writer, cfg, rope_sections) -> None:
        from gguf import ExpertGatingFuncType

        writer.add_expert_gating_func(ExpertGatingFuncType.SIGMOID)
        writer.add_rope_dimension_count(cfg.rope_dim)


FAMILY = MiniMaxM2(
    "minimax_m2", ("minimax_m2",), "minimax-m2", gguf_norm_topk=True, partial_rotary=1.0, gguf_qk_norm="full",
    hf_moe_prefix="block_sparse_moe.", hf_expert_names=("w1", "w3", "w2"),
    hf_layer_names={"router_bias": "block_sparse_moe.e_score_correction_bias"})
