"""Qwen3.5-MoE (and Qwen3.6): the hybrid layers (:mod:`~freetoken.models.families.gated_deltanet`); the released
checkpoints are image-text models whose language model's fields sit in ``text_config`` (the vision tower is not
read); the router always renormalises the top-k. llama.cpp's ``qwen35moe`` stores the linear layers' value heads in
tiled order and the multi-section RoPE's sections (``{arch}.rope.dimension_sections``)."""

from __future__ import annotations

from dataclasses import dataclass

from freetoken.models.families.base import HFConfig
from freetoken.models.families.gated_deltanet import HybridFamily

#: ``{arch}.rope.dimension_sections`` when the checkpoint names no ``mrope_section`` (llama.cpp's converter's).
ROPE_SECTIONS = (11, 11, 10, 0)


@dataclass(frozen=True, eq=False)
class Qwen35Moe(HybridFamily):
    def hf_text_config(self, cfg: dict, where: str) -> tuple[dict, str]:
        if not isinstance(cfg.get("text_config"), dict):
            return cfg, where
        text = dict(cfg["text_config"])
        for key in ("tie_word_embeddings", "eos_token_id"):
            if key not in text and key in cfg:
                text[key] = cfg[key]
        return {**text, "model_type": cfg.get("model_type")}, f"{where} text_config"

    def hf_moe(self, c: HFConfig) -> dict:
        return {**super().hf_moe(c), "norm_topk_prob": True}  # no config field: always renormalised

    def write_gguf(self, writer, cfg, rope_sections) -> None:
        super().write_gguf(writer, cfg, rope_sections)
        sections = list(rope_sections or ROPE_SECTIONS)
        writer.add_rope_dimension_sections((sections + [0] * 4)[:4])

    def llama_cpp_notes(self, cfg, rope_sections) -> list[str]:
        notes = super().llama_cpp_notes(cfg, rope_sections)
        sections = list(rope_sections or ROPE_SECTIONS)
        if sum(sections) > cfg.head_dim:
            notes.append(f"llama.cpp's multi-section RoPE needs the sections {sections} (mrope_section) to sum to at "
                         f"most the head dim {cfg.head_dim}: llama.cpp aborts on this file (freetoken runs it)")
        return notes


FAMILY = Qwen35Moe("qwen3_5_moe", ("qwen3_5_moe", "qwen3_5_moe_text"), "qwen35moe",
                   hf_model_prefixes=("model.language_model.", "model."),
                   gguf_layer_names={"mlp_norm": "post_attention_norm.weight"})
