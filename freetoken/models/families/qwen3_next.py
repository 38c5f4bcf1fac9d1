"""Qwen3-Next: the hybrid layers (:mod:`~freetoken.models.families.gated_deltanet`) with its HF checkpoints' fused
Gated DeltaNet input projections (``in_proj_qkvz``, ``in_proj_ba``: split into Qwen3.5's four when read)."""

from __future__ import annotations

from freetoken.models.families.gated_deltanet import HybridFamily

FAMILY = HybridFamily(
    "qwen3_next", ("qwen3_next",), "qwen3next", fused_linear_inputs=True,
    hf_layer_names={"lin_qkvz": "linear_attn.in_proj_qkvz.weight", "lin_ba": "linear_attn.in_proj_ba.weight"},
    gguf_layer_names={"mlp_norm": "post_attention_norm.weight"})
