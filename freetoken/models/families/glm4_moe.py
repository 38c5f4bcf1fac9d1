"""GLM-4.5 (``glm4_moe``): DeepSeek-V3's MoE structure and sigmoid router (one dense layer first, one shared expert,
no expert groups by default) under grouped-query attention with optional per-head q/k norms (``use_qk_norm``), qkv
biases (``attention_bias``) and half of each head rotated (``partial_rotary_factor``, default 0.5)."""

from __future__ import annotations

from dataclasses import dataclass

from freetoken.models.families.base import HFConfig
from freetoken.models.families.deepseek_moe import DeepSeekMoeFamily


@dataclass(frozen=True, eq=False)
class Glm4Moe(DeepSeekMoeFamily):
    def hf_qk_norm(self, c: HFConfig) -> str:
        return "head" if c.f.bool("use_qk_norm", False) else "none"


FAMILY = Glm4Moe(
    "glm4_moe", ("glm4_moe",), "glm4moe", partial_rotary=0.5,
    hf_layer_names={f"shared_{w}": f"mlp.shared_experts.{w}_proj.weight" for w in ("gate", "up", "down")},
    # llama.cpp's glm4moe calls the norm before the MLP post_attention_norm
    gguf_layer_names={"mlp_norm": "post_attention_norm.weight"})
