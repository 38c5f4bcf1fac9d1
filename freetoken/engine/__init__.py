"""The model runner: sampling, generation, KV cache management."""
