"""DeepSeek-V2: DeepSeek-V3's latent attention and MoE structure with softmax router scores and a plain greedy
top-k (``topk_method`` "greedy") or one limited to the best groups ("group_limited_greedy"). Its GGUF files share
``deepseek2`` with V3 and are read through V3's family (by their gating function)."""

from __future__ import annotations

from dataclasses import dataclass

from freetoken.models.families.base import HFConfig
from freetoken.models.families.deepseek_v3 import LatentAttentionFamily


@dataclass(frozen=True, eq=False)
class DeepSeekV2(LatentAttentionFamily):
    def hf_router(self, c: HFConfig) -> dict:
        method = c.raw.get("topk_method") or "greedy"
        if method not in ("greedy", "group_limited_greedy"):
            c.f.fail("topk_method", method, "'greedy' or 'group_limited_greedy' (DeepSeek-V2's)")
        # a greedy router's config may still name groups: they are not used
        return self.hf_groups(c, "softmax_group", greedy=method == "greedy")


FAMILY = DeepSeekV2(
    "deepseek_v2", ("deepseek_v2",), "deepseek2", reads_gguf=False, norm_topk_default=False, first_dense=0,
    shared_count=2,
    hf_layer_names={f"shared_{w}": f"mlp.shared_experts.{w}_proj.weight" for w in ("gate", "up", "down")})
