"""Checkpoint conversion: HF MoE checkpoints to llama.cpp GGUF (``freetoken convert``)."""

from freetoken.convert.gguf_export import export_gguf

__all__ = ["export_gguf"]
