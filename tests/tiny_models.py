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
    # GLM-4.5: a dense first layer, DeepSeek-V3's router (2 groups of 4, one in play, scaled), a shared expert,
    # q/k norms, qkv biases, half the head dims rotated
    "glm4_moe": ("Glm4MoeConfig", "Glm4MoeForCausalLM",
                 dict(num_hidden_layers=3, head_dim=16, n_routed_experts=8, moe_intermediate_size=32,
                      intermediate_size=96, n_shared_experts=1, n_group=2, topk_group=1, first_k_dense_replace=1,
                      routed_scaling_factor=2.5, norm_topk_prob=True, use_qk_norm=True, attention_bias=True,
                      partial_rotary_factor=0.5)),
    # gpt-oss: sinks, alternating windowed (shorter than the parity prompt) and full layers, q/k/v/o biases, a
    # router bias, experts with biases and the clamped SwiGLU, YaRN
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM",
                dict(head_dim=16, num_local_experts=8, intermediate_size=32, sliding_window=6,
                     rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
                                      "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 64})),
    # DeepSeek-V3: latent attention (low-rank q, interleaved rope dims, YaRN with DeepSeek's mscale), a dense first
    # layer, the sigmoid group router (2 groups of 4, one in play, scaled), a shared expert
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM",
                    dict(num_hidden_layers=3, num_key_value_heads=4, n_routed_experts=8, moe_intermediate_size=32,
                         intermediate_size=96, n_shared_experts=1, n_group=2, topk_group=1, first_k_dense_replace=1,
                         routed_scaling_factor=2.5, kv_lora_rank=32, q_lora_rank=24, qk_nope_head_dim=16,
                         qk_rope_head_dim=8, v_head_dim=16,
                         rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "mscale": 1.0,
                                          "mscale_all_dim": 1.0, "original_max_position_embeddings": 64,
                                          "beta_fast": 32.0, "beta_slow": 1.0})),
    # DeepSeek-V2: latent attention (plain q, as V2-Lite), softmax router limited to the best 2 of 4 groups, scaled,
    # two shared experts, no dense layer
    "deepseek_v2": ("DeepseekV2Config", "DeepseekV2ForCausalLM",
                    dict(num_key_value_heads=4, n_routed_experts=8, moe_intermediate_size=32, intermediate_size=96,
                         n_shared_experts=2, n_group=4, topk_group=2, topk_method="group_limited_greedy",
                         routed_scaling_factor=1.5, kv_lora_rank=32, q_lora_rank=None, qk_nope_head_dim=16,
                         qk_rope_head_dim=8, v_head_dim=16, first_k_dense_replace=0)),
    # Qwen3-Next: Gated DeltaNet layers (fused qkvz / ba projections, GQA 2 key heads -> 4 value heads) and a gated
    # full-attention layer (partial rotary, zero-centred norms), a dense layer among the MoE ones, a gated shared
    # expert
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM",
                   dict(num_hidden_layers=4, head_dim=16, num_experts=8, moe_intermediate_size=32,
                        intermediate_size=96, shared_expert_intermediate_size=48, norm_topk_prob=True,
                        mlp_only_layers=[2], linear_num_key_heads=2, linear_num_value_heads=4,
                        linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4,
                        layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"])),
    # Qwen3.5-MoE (its text model): separate in_proj_qkv / z / b / a, three linear layers per full one
    "qwen3_5_moe": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM",
                    dict(num_hidden_layers=4, head_dim=16, num_experts=8, moe_intermediate_size=32,
                         shared_expert_intermediate_size=48, linear_num_key_heads=2, linear_num_value_heads=4,
                         linear_key_head_dim=16, linear_value_head_dim=24, linear_conv_kernel_dim=4)),
    # MiniMax-M2: q/k norms over the whole projection with half of each head rotated (rotary_dim), Mixtral's
    # layout routed by sigmoid scores with a selection bias, top-k renormalised
    "minimax_m2": ("MiniMaxM2Config", "MiniMaxM2ForCausalLM",
                   dict(head_dim=16, num_local_experts=8, intermediate_size=32, rotary_dim=8, bos_token_id=0,
                        eos_token_id=1, scoring_func="sigmoid")),
}


#: Overrides for a checkpoint that goes through GGUF: GGUF has no key for YaRN's ``truncate`` and llama.cpp always
#: rounds the ramp's ends (HF's truncate=True), so a gpt-oss test checkpoint bound for GGUF uses that.
GGUF_OVERRIDES = {"gpt_oss": dict(rope_parameters={**FAMILIES["gpt_oss"][2]["rope_parameters"], "truncate": True})}
#: Overrides for a checkpoint that llama.cpp runs: DeepSeek-V2's group-limited routing is scored by llama.cpp as
#: V3's (top two probabilities of a group, not the largest): the plain greedy router both define alike.
#: And llama.cpp's deepseek2 wants a q_lora_rank unless the model has V2-Lite's 27 layers.
LLAMA_CPP_OVERRIDES = {"deepseek_v2": dict(topk_method="greedy", n_group=None, topk_group=None, q_lora_rank=24)}


#: Qwen3.5's RoPE parameters for llama.cpp: sections that fit a head of 16 (the released [11, 11, 10] need 32 dims).
QWEN35_ROPE = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25, "mrope_section": [1, 1, 0],
               "mrope_interleaved": True}


#: The random seed of a family's checkpoint where seed 0 leaves a router near-tie in the parity prompt (gpt_oss:
#: layer 1's 2nd and 3rd logits 0.004 apart at token 10, which bf16 experts flip: 0.1 NMSE on that one token).
#: minimax_m2: seeds 0 and 2 leave its sigmoid router (top 2 of 8 with a selection bias) a near-tie in the parity
#: prompt that bf16 rounding flips (seed 2 on cpu, seed 0 on emu after its bf16 prefill: NMSE 2e-3 / 1e-2, against
#: 1e-5 for seeds 1 and 3 on both devices).
SEEDS = {"gpt_oss": 1, "minimax_m2": 1}


def make_checkpoint(family: str, path, seed: int | None = None, **overrides):
    """Save a random ``family`` model to ``path`` (save_pretrained); returns the torch model (eval mode).

    Weights are scaled up from the 0.02 init so routing and logits are not all near zero; a DeepSeek-V3-style
    router's selection bias is random (it is zeros at init, which would leave its path untested)."""
    from freetoken.testing.oracles import need

    torch, transformers = need("torch"), need("transformers")
    cfg_name, model_name, extra = FAMILIES[family]
    torch.manual_seed(SEEDS.get(family, 0) if seed is None else seed)
    cfg = getattr(transformers, cfg_name)(**{**COMMON, **extra, **overrides})
    model = getattr(transformers, model_name)(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(5.0 if p.dim() > 1 else 1.0)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # zeros at init: give the selection bias work to do
                b.copy_(0.1 * torch.randn_like(b))
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


def to_gpt_oss_mxfp4(src, dst):
    """The tiny gpt-oss checkpoint at ``src`` as gpt-oss' release format at ``dst``: the routed experts in MXFP4
    (``*_blocks`` uint8 [E, rows, cols/32, 16], ``*_scales`` uint8 [E, rows, cols/32], gate and up rows
    interleaved in ``gate_up_proj``), everything else as it was, and the ``quantization_config`` saying so.
    Quantized with freetoken.formats.mxfp4 (the OCP rounding)."""
    import json
    import shutil
    from pathlib import Path

    import numpy as np
    from safetensors.numpy import load_file, save_file

    from freetoken.formats import mxfp4

    src, dst = Path(src), Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    tensors = load_file(str(src / "model.safetensors"))
    out = {}
    for name, t in tensors.items():
        if name.endswith("mlp.experts.gate_up_proj"):  # [E, H, 2I] input-major -> rows [E, 2I, H]
            banks = mxfp4.FORMAT.quantize(np.ascontiguousarray(t.transpose(0, 2, 1), np.float32))
            e, rows = banks["w"].shape[:2]
            out[name + "_blocks"] = banks["w"].reshape(e, rows, -1, 16)
            out[name + "_scales"] = banks["s"]
        elif name.endswith("mlp.experts.down_proj"):  # [E, I, H] -> rows [E, H, I]
            banks = mxfp4.FORMAT.quantize(np.ascontiguousarray(t.transpose(0, 2, 1), np.float32))
            e, rows = banks["w"].shape[:2]
            out[name + "_blocks"] = banks["w"].reshape(e, rows, -1, 16)
            out[name + "_scales"] = banks["s"]
        else:
            out[name] = t
    save_file(out, str(dst / "model.safetensors"))
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (dst / "config.json").write_text(json.dumps(cfg))
    for extra in ("generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        if (src / extra).is_file():
            shutil.copy(src / extra, dst / extra)
    return dst
