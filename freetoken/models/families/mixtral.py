"""Mixtral: every layer MoE (``intermediate_size`` is the experts' width), the top-k weights always renormalised,
experts named ``w1``/``w3``/``w2`` under ``block_sparse_moe``. llama.cpp writes it as ``llama`` with experts (its Q/K
rows permuted: :func:`freetoken.models.weights.llama_permute`)."""

from __future__ import annotations

from dataclasses import dataclass

from freetoken.models.families.base import Family, HFConfig


@dataclass(frozen=True, eq=False)
class Mixtral(Family):
    def hf_moe(self, c: HFConfig) -> dict:
        return dict(**c.experts(), **c.expert_ffn_only(), norm_topk_prob=True, moe_layers=c.sparse_step_layers())


FAMILY = Mixtral("mixtral", ("mixtral",), "llama", gguf_norm_topk=True, gguf_expert_ffn_length=False,
                 hf_moe_prefix="block_sparse_moe.", hf_expert_names=("w1", "w3", "w2"))
