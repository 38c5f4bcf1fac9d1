"""Bundled default model for freetoken: a tiny Qwen3-MoE (Qwen3MoeForCausalLM) trained
on the Python standard library by scripts/train_default_model.py (see README.md)."""
