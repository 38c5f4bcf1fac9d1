"""Tiny random HF checkpoints of each MoE family (transformers + torch, test-only), shared by the parity tests."""

from __future__ import annotations

COMMON = dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=256, num_experts_per_tok=2, rms_norm_eps=1e-6)
FAMILIES = {
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(head_dim=16, num_experts=8, moe_intermediate_size=32, intermediate_size=96, norm_topk_prob=True,
                       decoder_sparse_step=1, mlp_only_layers=[1])),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                  dict(num_experts=8, moe_intermediate_size=32, intermediate_size=96, norm_topk_prob=False,
                       shared_expert_intermediate_size=64, decoder_sparse_step=1)),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=8, intermediate_size=32)),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", dict(num_experts=8, intermediate_size=32, norm_topk_prob=False)),
}


def make_checkpoint(family: str, path, seed: int = 0, **overrides):
    """Save a random ``family`` model to ``path`` (save_pretrained); returns the torch model (eval mode).

    Weights are scaled up from the 0.02 init so routing and logits are not all near zero."""
    from freetoken.testing.oracles import need

    torch, transformers = need("torch"), need("transformers")
    cfg_name, model_name, extra = FAMILIES[family]
    torch.manual_seed(seed)
    cfg = getattr(transformers, cfg_name)(**{**COMMON, **extra, **overrides})
    model = getattr(transformers, model_name)(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(5.0 if p.dim() > 1 else 1.0)
    model.save_pretrained(path)
    return model


def finish_gguf(writer, path):
    """Give a metadata-only GGUF writer one small dummy tensor (a valid file needs one), write it, return ``path``."""
    import numpy as np

    writer.add_tensor("output_norm.weight", np.ones(8, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
