"""Qwen3-MoE: grouped-query attention with per-head q/k RMSNorms, softmax top-k routing (``norm_topk_prob``), MoE
layers chosen by ``decoder_sparse_step`` / ``mlp_only_layers``. The plain family the others depart from."""

from __future__ import annotations

from dataclasses import dataclass

from freetoken.models.families.base import Family, HFConfig


@dataclass(frozen=True, eq=False)
class Qwen3Moe(Family):
    def hf_qk_norm(self, c: HFConfig) -> str:
        return "head"


FAMILY = Qwen3Moe("qwen3_moe", ("qwen3_moe",), "qwen3moe", gguf_norm_topk=True)
