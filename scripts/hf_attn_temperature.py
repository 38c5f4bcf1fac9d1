"""HF transformers' Qwen3-MoE attention with the query temperature freetoken applies at far positions.

The bundled model's config carries Llama 4's attention temperature tuning (``attn_temperature_tuning``,
``floor_scale``, ``attn_scale``): every query at position ``p`` is multiplied by
``1 + attn_scale * ln(1 + floor((p + 1) / floor_scale))`` before the softmax (see ``freetoken.models.rope.
query_temperature``). Transformers' Llama 4 applies it only to its no-RoPE layers, and its Qwen3-MoE not at all,
so Qwen3-MoE loads such a config and ignores the keys: without this patch transformers' logits differ from
freetoken's from position ``floor_scale - 1`` on.

:func:`patch` replaces ``Qwen3MoeAttention.forward`` with one that scales the roped queries by that factor when the
layer's config enables it (positions counted from the cache's length, as Llama 4 counts them); it is the oracle of
the engine's long-context parity test, and the evaluation scripts use it so they score what the engine runs.
"""

from __future__ import annotations

import torch
from transformers.models.qwen3_moe import modeling_qwen3_moe as mod

_ORIGINAL = mod.Qwen3MoeAttention.forward


def temperature(positions: torch.Tensor, floor_scale: int, attn_scale: float) -> torch.Tensor:
    """The query factor at each position (float32)."""
    return torch.log1p(torch.floor((positions.float() + 1.0) / floor_scale)) * attn_scale + 1.0


def _forward(self, hidden_states, position_embeddings, attention_mask, cache=None, **kwargs):
    cfg = self.config
    if not getattr(cfg, "attn_temperature_tuning", False):
        return _ORIGINAL(self, hidden_states, position_embeddings, attention_mask, cache, **kwargs)
    input_shape = hidden_states.shape[:-1]
    hidden_shape = (*input_shape, -1, self.head_dim)
    q = self.q_norm(self.q_proj(hidden_states).view(hidden_shape)).transpose(1, 2)
    k = self.k_norm(self.k_proj(hidden_states).view(hidden_shape)).transpose(1, 2)
    v = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
    cos, sin = position_embeddings
    q, k = mod.apply_rotary_pos_emb(q, k, cos, sin)
    past = cache.get_seq_length(self.layer_idx) if cache is not None else 0
    positions = torch.arange(input_shape[-1], device=q.device) + past
    scale = temperature(positions, int(cfg.floor_scale), float(cfg.attn_scale))
    q = (q * scale.view(1, 1, -1, 1)).to(q.dtype)
    if cache is not None:
        k, v = cache.update(k, v, self.layer_idx, kwargs=kwargs)
    attend = mod.ALL_ATTENTION_FUNCTIONS.get_interface(cfg._attn_implementation, mod.eager_attention_forward)
    out, weights = attend(self, q, k, v, attention_mask, dropout=0.0 if not self.training else self.attention_dropout,
                          scaling=self.scaling, sliding_window=self.sliding_window, **kwargs)
    return self.o_proj(out.reshape(*input_shape, -1).contiguous()), weights


def patch() -> None:
    """Make every Qwen3-MoE attention layer honour its config's attention temperature (idempotent)."""
    mod.Qwen3MoeAttention.forward = _forward


def set_temperature(config, floor_scale: int, attn_scale: float) -> None:
    """Turn the temperature on in an HF config (``attn_scale`` 0 turns it off)."""
    config.attn_temperature_tuning = attn_scale > 0
    config.floor_scale = int(floor_scale)
    config.attn_scale = float(attn_scale)
