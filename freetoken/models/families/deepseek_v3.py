"""DeepSeek-V3 (and Kimi-K2, which ships its config as ``kimi_k2``): multi-head latent attention (queries through a
low-rank projection, keys and values from a latent row plus one shared rope key) on DeepSeek's MoE with sigmoid
router scores. Its GGUF architecture ``deepseek2`` covers DeepSeek-V2 too: a file with softmax scores is read as
:mod:`~freetoken.models.families.deepseek_v2`."""

from __future__ import annotations

from dataclasses import dataclass

from freetoken.models.families.base import GGUFConfig, HFConfig
from freetoken.models.families.deepseek_moe import DeepSeekMoeFamily
from freetoken.models.fields import MAX_HEAD_DIM, MAX_HIDDEN


@dataclass(frozen=True, eq=False)
class LatentAttentionFamily(DeepSeekMoeFamily):
    """DeepSeek's latent attention over its MoE (V2 and V3)."""

    def hf_attention(self, c: HFConfig) -> dict:
        f = c.f
        if f.bool("attention_bias", False):
            f.fail("attention_bias", True, "false (biases on the latent projections are not supported)")
        q_rank = f.get("q_lora_rank")
        mla = dict(kv_lora_rank=f.int("kv_lora_rank", hi=MAX_HIDDEN),
                   q_lora_rank=0 if q_rank is None else f.int("q_lora_rank", hi=MAX_HIDDEN),
                   qk_nope_dim=f.int("qk_nope_head_dim", hi=MAX_HEAD_DIM),
                   qk_rope_dim=f.int("qk_rope_head_dim", hi=MAX_HEAD_DIM),
                   v_head_dim=f.int("v_head_dim", hi=MAX_HEAD_DIM),
                   rope_interleave=f.bool("rope_interleave", True))
        # transformers writes head_dim = qk_rope_head_dim for these: the query/key head is nope + rope
        return dict(head_dim=mla["qk_nope_dim"] + mla["qk_rope_dim"], qk_norm="none", qkv_bias=False, **mla)

    def gguf_attention(self, g: GGUFConfig, hidden: int, heads: int) -> dict:
        """The attention is stored as MQA over the latent (key_length R + P)."""
        m, arch = g.m, g.arch
        head_dim = m.int(f"{arch}.attention.key_length_mla", hi=MAX_HEAD_DIM)
        rope = m.int(f"{arch}.rope.dimension_count", lo=2, hi=head_dim - 1)
        return dict(head_dim=head_dim, rotary_dim=0, num_kv_heads=heads,
                    kv_lora_rank=m.int(f"{arch}.attention.kv_lora_rank", hi=MAX_HIDDEN),
                    q_lora_rank=m.int(f"{arch}.attention.q_lora_rank", default=0, lo=0, hi=MAX_HIDDEN),
                    qk_nope_dim=head_dim - rope, qk_rope_dim=rope,
                    v_head_dim=m.int(f"{arch}.attention.value_length_mla", hi=MAX_HEAD_DIM),
                    rope_interleave=True)  # llama.cpp rotates adjacent pairs here: DeepSeek's own layout

    def gguf_rope_scaling(self, g: GGUFConfig, scaling: dict | None) -> dict | None:
        """YaRN's attention factor: the converter writes 0.1 * mscale_all_dim; llama.cpp's mscale equals it."""
        ms = g.gf.meta(f"{g.arch}.rope.scaling.yarn_log_multiplier", None)
        if scaling is not None and ms:
            mscale = g.m.float(f"{g.arch}.rope.scaling.yarn_log_multiplier", hi=1e3) / 0.1
            scaling = {**scaling, "mscale": mscale, "mscale_all_dim": mscale}
        return scaling


FAMILY = LatentAttentionFamily(
    "deepseek_v3", ("deepseek_v3", "kimi_k2"), "deepseek2", first_dense=3, n_group=8, topk_group=4,
    routed_scale=2.5, gguf_default_sigmoid=False, gguf_softmax_family="deepseek_v2",
    hf_layer_names={f"shared_{w}": f"mlp.shared_experts.{w}_proj.weight" for w in ("gate", "up", "down")})
