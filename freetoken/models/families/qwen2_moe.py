"""Qwen2-MoE: qkv biases always, a shared expert scaled by a sigmoid gate beside the routed ones."""

from __future__ import annotations

from dataclasses import dataclass

from freetoken.models.families.base import Family, HFConfig


@dataclass(frozen=True, eq=False)
class Qwen2Moe(Family):
    def hf_attention(self, c: HFConfig) -> dict:
        return dict(head_dim=c.head_dim(), qk_norm="none", qkv_bias=True)  # (attention_bias is not read)


FAMILY = Qwen2Moe("qwen2_moe", ("qwen2_moe",), "qwen2moe", shared_expert="gated")
