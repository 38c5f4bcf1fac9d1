"""DeepSeek's MoE structure, which GLM-4.5 took over: dense layers before the first MoE one
(``first_k_dense_replace``), shared experts counted in routed-expert widths (``n_shared_experts``), a router over
expert groups with a routed scaling factor, and multi-token-prediction layers after the decoder's (skipped).
The families built on it (GLM-4.5, DeepSeek-V3, DeepSeek-V2) differ in the defaults and the router's scores."""

from __future__ import annotations

from dataclasses import dataclass

from freetoken.models.families.base import Family, GGUFConfig, HFConfig
from freetoken.models.fields import MAX_EXPERTS, MAX_LAYERS, ConfigError

#: llama.cpp's ``{arch}.expert_gating_func`` values (enum llama_expert_gating_func_type).
GATING_NONE, GATING_SOFTMAX, GATING_SIGMOID = 0, 1, 2


@dataclass(frozen=True, eq=False)
class DeepSeekMoeFamily(Family):
    shared_expert: str = "plain"
    norm_topk_default: bool = True
    #: transformers' defaults of the config fields
    first_dense: int = 1
    n_group: int = 1
    topk_group: int = 1
    routed_scale: float = 1.0
    shared_count: int = 1
    #: a GGUF file without ``expert_gating_func`` scores with a sigmoid (llama.cpp's glm4moe) or a softmax
    gguf_default_sigmoid: bool = True
    #: the family a GGUF file with softmax scores is read as ("": such a file is refused)
    gguf_softmax_family: str = ""

    def hf_moe(self, c: HFConfig) -> dict:
        f = c.f
        out = dict(**c.experts(), **c.ffn_sizes(), norm_topk_prob=f.bool("norm_topk_prob", self.norm_topk_default))
        first = f.int("first_k_dense_replace", default=self.first_dense, lo=0, hi=c.layers)
        out["moe_layers"] = tuple(i >= first for i in range(c.layers))
        out["shared_inter"] = out["moe_inter"] * f.int("n_shared_experts", default=self.shared_count, lo=0, hi=64)
        return {**out, **self.hf_router(c)}

    def hf_router(self, c: HFConfig) -> dict:
        """DeepSeek-V3's router: sigmoid scores with a selection bias, top-k within the best groups."""
        for key, want in (("scoring_func", "sigmoid"), ("topk_method", "noaux_tc")):
            if c.raw.get(key) not in (None, want):
                c.f.fail(key, c.raw.get(key), f"{want!r} (a DeepSeek-V2 router is model_type deepseek_v2)")
        return self.hf_groups(c, "sigmoid_group", greedy=False)

    def hf_groups(self, c: HFConfig, router: str, greedy: bool) -> dict:
        f = c.f
        return dict(router=router,
                    n_group=1 if greedy else f.int("n_group", default=self.n_group, hi=MAX_EXPERTS),
                    topk_group=1 if greedy else f.int("topk_group", default=self.topk_group, hi=MAX_EXPERTS),
                    routed_scale=f.float("routed_scaling_factor", default=self.routed_scale, hi=1e4),
                    shared_gated=False,
                    mtp_layers=f.int("num_nextn_predict_layers", default=0, lo=0, hi=MAX_LAYERS))

    def gguf_router(self, g: GGUFConfig, scale: float, mtp: int) -> dict:
        m, arch = g.m, g.arch
        gating = m.int(f"{arch}.expert_gating_func", default=GATING_NONE, lo=0, hi=8)
        sigmoid = gating == GATING_SIGMOID or (gating == GATING_NONE and self.gguf_default_sigmoid)
        if not sigmoid and (not self.gguf_softmax_family or gating not in (GATING_NONE, GATING_SOFTMAX)):
            want = "sigmoid (DeepSeek-V3) or softmax (V2)" if self.gguf_softmax_family else "sigmoid"
            raise ConfigError(f"{g.where}: {arch}.expert_gating_func {gating}: not a router freetoken runs ({want})")
        n_group = m.int(f"{arch}.expert_group_count", default=1, lo=0, hi=MAX_EXPERTS) or 1
        # llama.cpp limits the choice to groups only when there are several (then it needs the used count). For
        # DeepSeek-V2 it scores a group by its top two probabilities, as for V3, where the model (transformers,
        # DeepSeek's own code) takes the largest one: freetoken runs the model's definition.
        topk_group = m.int(f"{arch}.expert_group_used_count", hi=n_group) if n_group > 1 else 1
        out = dict(router="sigmoid_group" if sigmoid else "softmax_group", n_group=n_group, topk_group=topk_group,
                   routed_scale=scale, shared_gated=False, mtp_layers=mtp)
        if not sigmoid:
            out["family"] = self.gguf_softmax_family
        return out

    def write_gguf(self, writer, cfg, rope_sections) -> None:
        # llama.cpp's glm4moe and deepseek2 read these (its converter writes them): the shared experts as a count of
        # routed-expert widths, the dense layers before the first MoE one, the router with its groups and scale, the
        # rotated head dims. The checkpoint's multi-token-prediction layers are not exported (freetoken skips them).
        from gguf import ExpertGatingFuncType

        writer.add_expert_shared_count(cfg.shared_inter // cfg.moe_inter)
        writer.add_leading_dense_block_count(next(i for i in range(cfg.num_layers) if cfg.is_moe(i)))
        # (DeepSeek-V2's groups: llama.cpp scores them by their top two probabilities, the model by its largest)
        writer.add_expert_gating_func(ExpertGatingFuncType.SOFTMAX if cfg.router == "softmax_group"
                                      else ExpertGatingFuncType.SIGMOID)
        writer.add_expert_weights_scale(cfg.routed_scale)
        writer.add_expert_group_count(cfg.n_group)
        writer.add_expert_group_used_count(cfg.topk_group)
        if not cfg.mla:
            writer.add_rope_dimension_count(cfg.rope_dim)
