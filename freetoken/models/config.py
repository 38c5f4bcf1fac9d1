"""Model configuration of the supported MoE families, parsed from an HF ``config.json``.

One decoder serves Qwen3-MoE, Qwen2-MoE, Mixtral and OLMoE; their differences are flags here:
q/k norms (per head for Qwen3, over the whole projection for OLMoE), qkv biases (Qwen2), a shared expert with a
sigmoid gate (Qwen2), top-k renormalisation (always for Mixtral, ``norm_topk_prob`` otherwise) and which layers
are MoE (``decoder_sparse_step`` / ``mlp_only_layers``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

#: model_type -> family name used by freetoken.
FAMILIES = {"qwen3_moe": "qwen3_moe", "qwen2_moe": "qwen2_moe", "mixtral": "mixtral", "olmoe": "olmoe"}


#: RoPE scaling variants the decoder implements (freetoken.models.rope.rope_frequencies).
ROPE_SCALINGS = ("linear", "yarn", "llama3")


class ConfigError(ValueError):
    """A config.json freetoken cannot run: unknown architecture or a missing/invalid field (named)."""


@dataclass(frozen=True)
class ModelConfig:
    family: str
    vocab_size: int
    hidden: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_experts: int
    top_k: int
    moe_inter: int
    dense_inter: int
    norm_topk_prob: bool
    rms_eps: float
    rope_theta: float
    rope_scaling: dict | None = None
    qk_norm: str = "none"  # "none" | "head" (Qwen3: over head_dim) | "full" (OLMoE: over the projection)
    qkv_bias: bool = False
    shared_inter: int = 0  # Qwen2-MoE shared expert (with a sigmoid gate)
    moe_layers: tuple[bool, ...] = field(default=())
    tie_word_embeddings: bool = False
    max_position: int = 32768

    def is_moe(self, layer: int) -> bool:
        return self.moe_layers[layer]


def _get(cfg: dict, *names, default=None, required=True):
    for n in names:
        if n in cfg and cfg[n] is not None:
            return cfg[n]
    if required and default is None:
        raise ConfigError(f"config.json: missing field {names[0]!r}")
    return default


def _rope(cfg: dict) -> tuple[float, dict | None]:
    params = cfg.get("rope_parameters")  # transformers >= 5
    if isinstance(params, dict):
        theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
        kind = params.get("rope_type", "default")
        return theta, (None if kind == "default" else dict(params))
    scaling = cfg.get("rope_scaling")
    if scaling and scaling.get("rope_type", scaling.get("type", "default")) == "default":
        scaling = None
    return float(cfg.get("rope_theta", 10000.0)), scaling


def from_hf(cfg: dict) -> ModelConfig:
    """Parse an HF config dict; raises :class:`ConfigError` naming what is unsupported or missing."""
    mt = cfg.get("model_type")
    if mt not in FAMILIES:
        raise ConfigError(f"config.json: unsupported model_type {mt!r}; freetoken runs {', '.join(FAMILIES)}")
    family = FAMILIES[mt]
    hidden = int(_get(cfg, "hidden_size"))
    layers = int(_get(cfg, "num_hidden_layers"))
    heads = int(_get(cfg, "num_attention_heads"))
    head_dim = int(_get(cfg, "head_dim", default=hidden // heads, required=False))
    experts = int(_get(cfg, "num_experts", "num_local_experts"))
    if family == "mixtral":
        moe_inter, dense_inter, norm_topk = int(_get(cfg, "intermediate_size")), 0, True
    else:
        moe_inter = int(_get(cfg, "moe_intermediate_size", "intermediate_size"))
        dense_inter = int(_get(cfg, "intermediate_size", default=0, required=False))
        norm_topk = bool(cfg.get("norm_topk_prob", False))
    step = int(cfg.get("decoder_sparse_step", 1) or 1)
    mlp_only = set(cfg.get("mlp_only_layers") or [])
    moe_layers = tuple((i not in mlp_only) and experts > 0 and (i + 1) % step == 0 for i in range(layers))
    theta, scaling = _rope(cfg)
    if scaling is not None:
        kind = scaling.get("rope_type", scaling.get("type"))
        if kind not in ROPE_SCALINGS:
            raise ConfigError(f"config.json: rope scaling {kind!r} is not supported (supported: "
                              f"{', '.join(ROPE_SCALINGS)})")
        need = {"linear": ("factor",), "yarn": ("factor",), "llama3": ("factor", "low_freq_factor",
                                                                      "high_freq_factor")}[kind]
        missing = [k for k in need if scaling.get(k) is None]
        if missing:
            raise ConfigError(f"config.json: rope scaling {kind!r} without {', '.join(missing)}")
    if cfg.get("sliding_window") and cfg.get("use_sliding_window"):
        raise ConfigError("config.json: sliding-window attention is not supported yet")
    return ModelConfig(
        family=family, vocab_size=int(_get(cfg, "vocab_size")), hidden=hidden, num_layers=layers, num_heads=heads,
        num_kv_heads=int(_get(cfg, "num_key_value_heads", default=heads, required=False)), head_dim=head_dim,
        num_experts=experts, top_k=int(_get(cfg, "num_experts_per_tok")), moe_inter=moe_inter, dense_inter=dense_inter,
        norm_topk_prob=norm_topk, rms_eps=float(_get(cfg, "rms_norm_eps", default=1e-6, required=False)),
        rope_theta=theta, rope_scaling=scaling,
        qk_norm={"qwen3_moe": "head", "olmoe": "full"}.get(family, "none"),
        qkv_bias=family == "qwen2_moe" or bool(cfg.get("attention_bias", False)),
        shared_inter=int(cfg.get("shared_expert_intermediate_size") or 0) if family == "qwen2_moe" else 0,
        moe_layers=moe_layers, tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        max_position=int(cfg.get("max_position_embeddings", 32768)),
    )


#: GGUF ``general.architecture`` -> family (``llama`` with experts is Mixtral's layout in llama.cpp).
GGUF_FAMILIES = {"qwen3moe": "qwen3_moe", "qwen2moe": "qwen2_moe", "llama": "mixtral", "olmoe": "olmoe"}
#: Whether llama.cpp renormalises the top-k router weights of each family (it hard-codes this per architecture).
_GGUF_NORM_TOPK = {"qwen3_moe": True, "qwen2_moe": False, "mixtral": True, "olmoe": False}


def from_gguf(gf) -> ModelConfig:
    """The config of a :class:`freetoken.loaders.GGUFFile` from its ``{arch}.*`` metadata and tensor shapes;
    :class:`ConfigError` (naming the file) for architectures, layouts and RoPE variants the decoder lacks."""
    where = str(gf.path)
    family = GGUF_FAMILIES.get(gf.arch)
    if family is None:
        raise ConfigError(f"{where}: unsupported GGUF architecture {gf.arch!r}; freetoken runs "
                          f"{', '.join(GGUF_FAMILIES)}")

    def meta(key, default=None):
        v = gf.meta(f"{gf.arch}.{key}", None)
        if v is None and default is None:
            raise ConfigError(f"{where}: missing metadata key {gf.arch}.{key}")
        return default if v is None else v

    layers = int(meta("block_count"))
    hidden = int(meta("embedding_length"))
    heads = int(meta("attention.head_count"))
    kv = meta("attention.head_count_kv", heads)
    if not isinstance(kv, int):  # per-layer arrays exist in some files; one value is all this decoder supports
        vals = {int(v) for v in np.asarray(kv).reshape(-1)}
        if len(vals) != 1:
            raise ConfigError(f"{where}: per-layer KV head counts {sorted(vals)} are not supported")
        kv = vals.pop()
    experts = int(meta("expert_count", 0))
    if experts == 0:
        raise ConfigError(f"{where}: {gf.arch} model without experts ({gf.arch}.expert_count); freetoken runs "
                          "MoE models")
    moe_layers = tuple(gf.has(f"blk.{i}.ffn_gate_inp.weight") for i in range(layers))
    first = next((i for i, m in enumerate(moe_layers) if m), None)
    if first is None:
        raise ConfigError(f"{where}: no layer has a router (blk.N.ffn_gate_inp.weight)")
    if not gf.has(f"blk.{first}.ffn_gate_exps.weight"):
        raise ConfigError(f"{where}: experts stored per expert (blk.{first}.ffn_gate.0.weight, old llama.cpp "
                          "files) are not supported; re-convert with a current converter (merged *_exps tensors)")
    moe_inter = gf.info(f"blk.{first}.ffn_gate_exps.weight").shape[1]
    dense = next((i for i, m in enumerate(moe_layers) if not m), None)
    dense_inter = gf.info(f"blk.{dense}.ffn_gate.weight").shape[0] if dense is not None else 0
    shared_inter = 0
    if gf.has(f"blk.{first}.ffn_gate_shexp.weight"):
        if family != "qwen2_moe":
            raise ConfigError(f"{where}: shared experts in a {gf.arch} model are not supported")
        shared_inter = gf.info(f"blk.{first}.ffn_gate_shexp.weight").shape[0]
    kind = gf.meta(f"{gf.arch}.rope.scaling.type", None)
    rope_scaling = None
    if kind not in (None, "none"):
        if kind not in ("linear", "yarn"):
            raise ConfigError(f"{where}: rope scaling {kind!r} is not supported (supported: linear, yarn)")
        factor = gf.meta(f"{gf.arch}.rope.scaling.factor", None)
        if factor is None:
            raise ConfigError(f"{where}: rope scaling {kind!r} without {gf.arch}.rope.scaling.factor")
        rope_scaling = {"rope_type": kind, "factor": float(factor),
                        "original_max_position_embeddings": gf.meta(f"{gf.arch}.rope.scaling.original_context_length",
                                                                    None)}
    scale = float(meta("expert_weights_scale", 1.0))
    if scale != 1.0:
        raise ConfigError(f"{where}: expert_weights_scale {scale} is not supported")
    vocab = int(meta("vocab_size", 0)) or gf.info("token_embd.weight").shape[0]
    qk_norm = "none"
    if gf.has("blk.0.attn_q_norm.weight"):
        qk_norm = "full" if family == "olmoe" else "head"
    return ModelConfig(
        family=family, vocab_size=vocab, hidden=hidden, num_layers=layers, num_heads=heads, num_kv_heads=int(kv),
        head_dim=int(meta("attention.key_length", hidden // heads)), num_experts=experts,
        top_k=int(meta("expert_used_count")), moe_inter=int(moe_inter), dense_inter=int(dense_inter),
        norm_topk_prob=bool(meta("expert_weights_norm", _GGUF_NORM_TOPK[family])),
        rms_eps=float(meta("attention.layer_norm_rms_epsilon", 1e-6)), rope_theta=float(meta("rope.freq_base", 1e4)),
        rope_scaling=rope_scaling,
        qk_norm=qk_norm, qkv_bias=gf.has("blk.0.attn_q.bias"), shared_inter=int(shared_inter),
        moe_layers=moe_layers, tie_word_embeddings=not gf.has("output.weight"),
        max_position=int(meta("context_length", 32768)),
    )
