"""Model configuration of the supported MoE families, parsed from an HF ``config.json`` or a GGUF file's metadata.

One decoder serves Qwen3-MoE, Qwen2-MoE, Mixtral, OLMoE, GLM-4.5 (glm4_moe), gpt-oss, Qwen3-Next, Qwen3.5-MoE and
DeepSeek-V2/V3 (with Kimi-K2's model_type); their differences are flags here: q/k norms (per head for Qwen3 and
GLM's ``use_qk_norm``, over the whole projection for OLMoE), qkv biases (Qwen2, GLM's and gpt-oss'
``attention_bias``), an output bias and sinks (gpt-oss), sliding windows per layer (gpt-oss' ``layer_types``),
multi-head latent attention (DeepSeek's ``kv_lora_rank``...), a shared expert (Qwen2's with a sigmoid gate; GLM's
and DeepSeek's ``n_shared_experts`` without one), the router (softmax top-k, with a logit bias for gpt-oss;
DeepSeek-V3's sigmoid scores with a selection bias, expert groups and a routed scaling factor, which GLM has too;
DeepSeek-V2's softmax with group-limited greedy top-k), top-k renormalisation (always for Mixtral and gpt-oss,
``norm_topk_prob`` otherwise), partial rotary (GLM's ``partial_rotary_factor``), experts with biases and the clamped
SwiGLU (gpt-oss), and which layers are MoE (``decoder_sparse_step`` / ``mlp_only_layers``,
``first_k_dense_replace``). Qwen3-Next and Qwen3.5-MoE mix Gated DeltaNet linear-attention layers with full
attention (``layer_types``), gate the attention output with rows the q projection carries, rotate a quarter of each
head and store their norms zero-centred.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from freetoken.models.families import BY_NAME as FAMILY_ROWS
from freetoken.models.families import GGUF_READS, HYBRID, MODEL_TYPES
from freetoken.models.fields import (
    MAX_EXPERTS,
    MAX_HEAD_DIM,
    MAX_HEADS,
    MAX_HIDDEN,
    MAX_INTERMEDIATE,
    MAX_LAYERS,
    MAX_POSITIONS,
    MAX_VOCAB,
    ConfigError,
    Fields,
)

#: model_type -> family name used by freetoken (the family table's, :mod:`freetoken.models.families`).
FAMILIES = MODEL_TYPES
#: Families whose layers mix Gated DeltaNet linear attention with gated full attention (``layer_types``).
HYBRID_FAMILIES = HYBRID
#: Layer kinds of ``ModelConfig.layer_types``.
LAYER_TYPES = ("full_attention", "linear_attention")

#: Router blocks (freetoken.models.blocks): softmax over the experts then top-k, or DeepSeek-V3's sigmoid scores with
#: a selection bias and group-limited top-k (freetoken.ops.route_sigmoid_group_topk).
ROUTERS = ("softmax", "sigmoid_group", "softmax_group")


#: RoPE scaling variants the decoder implements (freetoken.models.rope.rope_frequencies).
ROPE_SCALINGS = ("linear", "yarn", "llama3")




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
    #: Per-layer sliding window: a query sees itself and the ``w - 1`` positions before it (0: the whole context);
    #: empty: no layer has one (gpt-oss' ``layer_types`` alternate windowed and full layers).
    sliding_windows: tuple[int, ...] = ()
    #: gpt-oss' attention sinks: a learned logit per query head (weight key ``attn_sinks`` ``[H]``) in each layer's
    #: softmax denominator.
    attention_sinks: bool = False
    #: Llama 4's attention temperature tuning (config ``attn_temperature_tuning``, ``attn_scale``, ``floor_scale``;
    #: GGUF ``{arch}.attention.temperature_scale`` / ``temperature_length``): the query at position ``p`` is scaled
    #: by ``1 + attn_temperature_scale * ln(1 + floor((p + 1) / attn_temperature_floor))``, which sharpens attention
    #: as the context grows past what training saw. 0: off.
    attn_temperature_scale: float = 0.0
    attn_temperature_floor: int = 8192
    #: "softmax" or "sigmoid_group" (:data:`ROUTERS`); the latter's expert groups, groups in play and weight scale.
    router: str = "softmax"
    n_group: int = 1
    topk_group: int = 1
    routed_scale: float = 1.0
    #: Whether the shared expert's output is scaled by a sigmoid gate (Qwen2-MoE) or added as is (GLM-4.5).
    shared_gated: bool = True
    #: Dimensions of each q/k head that RoPE rotates, the first ones (0: all; GLM's ``partial_rotary_factor``).
    rotary_dim: int = 0
    #: Multi-token-prediction layers stored after the decoder's (``num_nextn_predict_layers``): not run; their
    #: tensors are skipped when loading.
    mtp_layers: int = 0
    #: gpt-oss: a bias on the attention output projection (``o_bias``) and on the router's logits
    #: (``router_logit_bias``); routed experts with biases, run with the clamped activation (``expert_act``
    #: "gpt_oss", ``freetoken.device.constants.ACTIVATIONS``).
    o_bias: bool = False
    router_logit_bias: bool = False
    expert_bias: bool = False
    expert_act: str = "swiglu"
    #: DeepSeek-V3's multi-head latent attention (``kv_lora_rank`` > 0): queries through a low-rank ``q_lora_rank``
    #: projection (0: a plain ``q_proj``), keys and values from a ``kv_lora_rank`` latent plus one shared rope key of
    #: ``qk_rope_dim``; per head ``qk_nope_dim`` + ``qk_rope_dim`` query/key dims (``head_dim``) and ``v_head_dim``
    #: value dims. ``rope_interleave``: the checkpoint's rope dims are interleaved pairs (DeepSeek's own layout).
    kv_lora_rank: int = 0
    q_lora_rank: int = 0
    qk_nope_dim: int = 0
    qk_rope_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = False
    #: Qwen3-Next / Qwen3.5-MoE: each layer's token mixer (:data:`LAYER_TYPES`; empty: every layer full attention),
    #: the Gated DeltaNet dims of the linear layers (key/value heads and head dims, the short convolution's taps),
    #: a sigmoid output gate carried by the q projection (``attn_output_gate``), and RMSNorm weights stored
    #: zero-centred (``norm_offset``: the norm multiplies by ``1 + w``; folded into the weights at load).
    layer_types: tuple[str, ...] = ()
    linear_k_heads: int = 0
    linear_v_heads: int = 0
    linear_k_dim: int = 0
    linear_v_dim: int = 0
    linear_conv: int = 0
    attn_output_gate: bool = False
    norm_offset: bool = False

    @property
    def mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def rope_dim(self) -> int:
        """How many leading dimensions of a head RoPE rotates (MLA: the rope part, ``qk_rope_dim``)."""
        return self.qk_rope_dim if self.mla else self.rotary_dim or self.head_dim

    @property
    def kv_cache_heads(self) -> int:
        """Heads of a token's row in the KV pool (MLA: one latent row)."""
        return 1 if self.mla else self.num_kv_heads

    @property
    def kv_cache_dim(self) -> int:
        """Values per head of a token's row in the KV pool (MLA: the latent and the rope key)."""
        return self.kv_lora_rank + self.qk_rope_dim if self.mla else self.head_dim

    @property
    def kv_cache_values(self) -> bool:
        """Whether the pool stores values beside the keys (MLA: no: the values are the latent part of the row)."""
        return not self.mla

    @property
    def attention_scale(self) -> float:
        """The softmax scale of q.k: ``1 / sqrt(head_dim)``, times YaRN's ``mscale_all_dim`` factor squared for MLA
        (DeepSeek's, as transformers applies it)."""
        scale = self.head_dim ** -0.5
        sc = self.rope_scaling or {}
        if self.mla and sc.get("rope_type", sc.get("type")) == "yarn" and sc.get("mscale_all_dim"):
            factor = float(sc["factor"])
            m = 0.1 * float(sc["mscale_all_dim"]) * math.log(factor) + 1.0 if factor > 1 else 1.0
            scale *= m * m
        return scale

    def __post_init__(self):
        """The invariants every reader relies on (a parser names the file; a config built in code is checked too)."""
        def bad(what):
            raise ConfigError(f"model config: {what}")

        if self.num_kv_heads > self.num_heads or self.num_heads % self.num_kv_heads:
            bad(f"{self.num_heads} attention heads are not a multiple of {self.num_kv_heads} key/value heads")
        if self.num_experts and not 1 <= self.top_k <= self.num_experts:
            bad(f"{self.top_k} experts per token out of {self.num_experts}")
        if len(self.moe_layers) != self.num_layers:
            bad(f"{len(self.moe_layers)} MoE-layer flags for {self.num_layers} layers")
        if any(self.moe_layers) and not (self.num_experts and self.moe_inter):
            bad("MoE layers without experts or an expert FFN size")
        if not all(self.moe_layers) and not self.dense_inter:
            bad("dense layers without an FFN size (intermediate_size)")
        if self.sliding_windows and (len(self.sliding_windows) != self.num_layers
                                     or any(w < 0 for w in self.sliding_windows)):
            bad(f"{len(self.sliding_windows)} sliding windows for {self.num_layers} layers (each >= 0)")
        if self.head_dim % 2 and not self.mla:
            bad(f"head_dim {self.head_dim} is odd (RoPE rotates pairs)")
        if not (0.0 <= self.attn_temperature_scale <= 10.0 and 1 <= self.attn_temperature_floor <= MAX_POSITIONS):
            bad(f"attention temperature: scale {self.attn_temperature_scale} (in [0, 10]) and floor "
                f"{self.attn_temperature_floor} (in [1, {MAX_POSITIONS}])")
        if self.mla:
            from freetoken.device.constants import LATENT_MAX_DIM

            if self.qk_rope_dim % 2 or self.head_dim != self.qk_nope_dim + self.qk_rope_dim:
                bad(f"latent attention: qk_rope_head_dim {self.qk_rope_dim} must be even and head_dim "
                    f"{self.head_dim} = qk_nope_head_dim {self.qk_nope_dim} + qk_rope_head_dim")
            if self.kv_cache_dim > LATENT_MAX_DIM or self.qk_norm != "none" or self.qkv_bias:
                bad(f"latent attention: a cached row of kv_lora_rank + qk_rope_head_dim = {self.kv_cache_dim} "
                    f"(at most {LATENT_MAX_DIM}), no q/k norms, no biases")
        if self.rotary_dim and (self.rotary_dim % 2 or not 2 <= self.rotary_dim <= self.head_dim):
            bad(f"{self.rotary_dim} rotary dimensions of a head of {self.head_dim} (an even number in [2, head_dim])")
        if self.router not in ROUTERS:
            bad(f"router {self.router!r} (one of {', '.join(ROUTERS)})")
        if self.layer_types:
            if len(self.layer_types) != self.num_layers or any(t not in LAYER_TYPES for t in self.layer_types):
                bad(f"layer_types must list {self.num_layers} of {', '.join(LAYER_TYPES)}")
            if not self.kv_layers:
                bad("layer_types: at least one full_attention layer")
            if "linear_attention" in self.layer_types:
                from freetoken.device.constants import LINEAR_CONV_MAX_TAPS, LINEAR_MAX_HEAD_DIM

                dims = (self.linear_k_heads, self.linear_v_heads, self.linear_k_dim, self.linear_v_dim)
                if min(dims) < 1 or self.linear_v_heads % self.linear_k_heads:
                    bad(f"linear attention: {self.linear_v_heads} value heads must be a multiple of "
                        f"{self.linear_k_heads} key heads (both >= 1), head dims >= 1")
                if max(self.linear_k_dim, self.linear_v_dim) > LINEAR_MAX_HEAD_DIM:
                    bad(f"linear attention head dims {self.linear_k_dim}/{self.linear_v_dim}: at most "
                        f"{LINEAR_MAX_HEAD_DIM}")
                if not 2 <= self.linear_conv <= LINEAR_CONV_MAX_TAPS:
                    bad(f"linear_conv_kernel_dim {self.linear_conv}: 2 .. {LINEAR_CONV_MAX_TAPS}")
        if self.router in ("sigmoid_group", "softmax_group") and self.num_experts:
            from freetoken.ops.routing import check_groups

            try:
                check_groups(self.num_experts, self.top_k, self.n_group, self.topk_group)
            except ValueError as e:
                bad(f"expert groups: {e} (n_group, topk_group, num_experts_per_tok)")
        if not (math.isfinite(self.routed_scale) and self.routed_scale > 0):
            bad(f"routed_scaling_factor {self.routed_scale} is not a finite number > 0")
        if not (math.isfinite(self.rms_eps) and 0 < self.rms_eps < 1):
            bad(f"rms_norm_eps {self.rms_eps} is not in (0, 1)")
        if not (math.isfinite(self.rope_theta) and self.rope_theta > 0):
            bad(f"rope theta {self.rope_theta} is not a finite number > 0")

    def notes(self) -> list[str]:
        """What of the checkpoint the decoder leaves out, for ``run``/``chat`` to say at load."""
        if not self.mtp_layers:
            return []
        last = self.num_layers + self.mtp_layers - 1
        where = f"layer {last}" if self.mtp_layers == 1 else f"layers {self.num_layers}-{last}"
        return [f"the checkpoint's {self.mtp_layers} multi-token-prediction layer(s) ({where}, "
                "num_nextn_predict_layers) are skipped: generation runs one token per step"]

    def is_moe(self, layer: int) -> bool:
        return self.moe_layers[layer]

    def is_linear(self, layer: int) -> bool:
        """Whether layer ``layer`` mixes tokens with Gated DeltaNet (a recurrent state) instead of attention."""
        return bool(self.layer_types) and self.layer_types[layer] == "linear_attention"

    @property
    def kv_layers(self) -> tuple[int, ...]:
        """The layers that keep keys and values in the KV pool (every layer but the linear-attention ones)."""
        return tuple(i for i in range(self.num_layers) if not self.is_linear(i))

    @property
    def linear_conv_dim(self) -> int:
        """Channels of a linear layer's short convolution: its q, k and v heads."""
        return 2 * self.linear_k_heads * self.linear_k_dim + self.linear_v_heads * self.linear_v_dim

    def window(self, layer: int) -> int:
        """Layer ``layer``'s sliding window (0: none)."""
        return self.sliding_windows[layer] if self.sliding_windows else 0


def _rope(f: Fields, cfg: dict) -> tuple[float, dict | None]:
    """(theta, scaling or None) of an HF config: ``rope_parameters`` (transformers >= 5) or ``rope_theta`` +
    ``rope_scaling``; a scaling variant the decoder lacks, or one without its parameters, is refused by name."""
    params = f.dict("rope_parameters")
    if params is not None:
        theta = Fields(params.get, f.where, "rope_parameters field").float("rope_theta", default=None) \
            if params.get("rope_theta") is not None else f.float("rope_theta", default=10000.0)
        scaling = None if params.get("rope_type", "default") == "default" else dict(params)
    else:
        theta = f.float("rope_theta", default=10000.0)
        scaling = f.dict("rope_scaling")
        if scaling and scaling.get("rope_type", scaling.get("type", "default")) == "default":
            scaling = None
    if scaling is not None:
        kind = scaling.get("rope_type", scaling.get("type"))
        if not isinstance(kind, str) or kind not in ROPE_SCALINGS:
            raise ConfigError(f"{f.where}: rope scaling {kind!r} is not supported (supported: "
                              f"{', '.join(ROPE_SCALINGS)})")
        need = {"linear": ("factor",), "yarn": ("factor",), "llama3": ("factor", "low_freq_factor",
                                                                      "high_freq_factor")}[kind]
        missing = [k for k in need if scaling.get(k) is None]
        if missing:
            raise ConfigError(f"{f.where}: rope scaling {kind!r} without {', '.join(missing)}")
        sf = Fields(scaling.get, f.where, "rope scaling field")
        for k in need:
            sf.float(k, hi=1e6)
        for k in ("attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim"):
            if scaling.get(k) is not None:
                sf.float(k, lo=0.0, hi=1e6, lo_open=False)
        if scaling.get("original_max_position_embeddings") is not None:
            sf.int("original_max_position_embeddings", hi=MAX_POSITIONS)
    return theta, scaling


def from_hf(cfg: dict, where: str = "config.json") -> ModelConfig:
    """Parse an HF config dict; raises :class:`ConfigError` naming what is unsupported, missing or invalid (field,
    value and what was expected) before anything is allocated. ``where``: the file, for messages."""
    if not isinstance(cfg, dict):
        raise ConfigError(f"{where}: expected a JSON object, got {type(cfg).__name__}")
    mt = cfg.get("model_type")
    if mt == "qwen3_5_moe" and isinstance(cfg.get("text_config"), dict):
        # the released checkpoints are image-text models: the language model's fields sit in text_config (the
        # vision tower's weights are not read)
        text = dict(cfg["text_config"])
        for key in ("tie_word_embeddings", "eos_token_id"):
            if key not in text and key in cfg:
                text[key] = cfg[key]
        cfg, where, mt = {**text, "model_type": mt}, f"{where} text_config", mt
    f = Fields(cfg.get, where)
    if not isinstance(mt, str) or mt not in FAMILIES:
        raise ConfigError(f"{where}: unsupported model_type {mt!r}; freetoken runs {', '.join(FAMILIES)}")
    family = FAMILIES[mt]
    hybrid = family in HYBRID_FAMILIES
    hidden = f.int("hidden_size", hi=MAX_HIDDEN)
    layers = f.int("num_hidden_layers", hi=MAX_LAYERS)
    heads = f.int("num_attention_heads", hi=MAX_HEADS)
    kv_heads = f.int("num_key_value_heads", default=heads, hi=MAX_HEADS)
    ds = family in ("deepseek_v3", "deepseek_v2")
    mla = _mla_fields(f) if ds else {}
    if ds:  # transformers writes head_dim = qk_rope_head_dim for these: the query/key head is nope + rope
        head_dim = mla["qk_nope_dim"] + mla["qk_rope_dim"]
    else:
        if cfg.get("head_dim") is None and hidden % heads:
            f.fail("num_attention_heads", heads, f"a divisor of hidden_size {hidden} (no head_dim is given)")
        head_dim = f.int("head_dim", default=hidden // heads, hi=MAX_HEAD_DIM)
    experts = f.int("num_experts", "num_local_experts", "n_routed_experts", hi=MAX_EXPERTS)
    top_k = f.int("num_experts_per_tok", "experts_per_token", hi=experts)
    glm, oss = family == "glm4_moe", family == "gpt_oss"
    # DeepSeek-V3's router, shared experts, leading dense layers and MTP layers: GLM-4.5 took them over (with other
    # defaults in transformers' configs)
    v3_moe = {"glm4_moe": dict(first_dense=1, n_group=1, topk_group=1, scale=1.0),
              "deepseek_v3": dict(first_dense=3, n_group=8, topk_group=4, scale=2.5),
              "deepseek_v2": dict(first_dense=0, n_group=1, topk_group=1, scale=1.0)}.get(family)
    if family in ("mixtral", "gpt_oss"):  # gpt-oss: softmax over the top-k logits = the top-k renormalised
        moe_inter, dense_inter, norm_topk = f.int("intermediate_size", hi=MAX_INTERMEDIATE), 0, True
    else:
        moe_inter = f.int("moe_intermediate_size", "intermediate_size", hi=MAX_INTERMEDIATE)
        dense_inter = f.int("intermediate_size", default=0, lo=0, hi=MAX_INTERMEDIATE)
        # transformers' default: True for GLM and DeepSeek-V3 only
        norm_topk = f.bool("norm_topk_prob", v3_moe is not None and family != "deepseek_v2")
        if family == "qwen3_5_moe":  # its router always renormalises the top-k (no config field)
            norm_topk = True
    if v3_moe:
        first_dense = f.int("first_k_dense_replace", default=v3_moe["first_dense"], lo=0, hi=layers)
        moe_layers = tuple(i >= first_dense for i in range(layers))
    else:
        step = f.int("decoder_sparse_step", default=1, lo=0, hi=MAX_LAYERS) or 1
        mlp_only = set(f.int_list("mlp_only_layers", 0, layers - 1))
        moe_layers = tuple((i not in mlp_only) and (i + 1) % step == 0 for i in range(layers))
    theta, scaling = _rope(f, cfg)
    if cfg.get("sliding_window") and f.bool("use_sliding_window", False):
        raise ConfigError(f"{where}: sliding-window attention is not supported yet")
    shared = 0
    if family in ("qwen2_moe", "qwen3_next", "qwen3_5_moe"):
        shared = f.int("shared_expert_intermediate_size", default=0, lo=0, hi=MAX_INTERMEDIATE)
    elif v3_moe:
        shared = moe_inter * f.int("n_shared_experts", default=2 if family == "deepseek_v2" else 1, lo=0,
                                   hi=64)  # transformers' defaults
    rotary_dim = 0
    if glm or hybrid:
        # transformers' Glm4MoeConfig defaults the factor to 0.5 when a config names none (as GLM-4.5's own code),
        # Qwen3-Next's and Qwen3.5's configs to 0.25
        factor = (f.dict("rope_parameters") or {}).get("partial_rotary_factor",
                                                       cfg.get("partial_rotary_factor", 0.25 if hybrid else 0.5))
        pf = Fields(lambda _: factor, where).float("partial_rotary_factor", hi=1.0)
        rotary_dim = int(head_dim * pf)  # transformers' rounding
        if rotary_dim < 2:
            f.fail("partial_rotary_factor", factor, f"a factor that rotates at least 2 of the {head_dim} head dims")
        if rotary_dim == head_dim:
            rotary_dim = 0
    vocab = f.int("vocab_size", hi=MAX_VOCAB)
    for key in ("eos_token_id",):  # the loader stops generation on these
        v = cfg.get(key)
        if isinstance(v, list):
            if len(v) > 1024:
                f.fail(key, v, "a token id or a short list of token ids")
            for j, x in enumerate(v):
                f.whole(f"{key}[{j}]", x, 0, MAX_VOCAB - 1)
        elif v is not None:
            f.int(key, lo=0, hi=MAX_VOCAB - 1)
    groups = dict(mla)
    if v3_moe:
        router, greedy = "sigmoid_group", False
        if family == "deepseek_v2":  # softmax scores: plain greedy top-k, or limited to the best groups
            router, method = "softmax_group", cfg.get("topk_method") or "greedy"
            if method not in ("greedy", "group_limited_greedy"):
                f.fail("topk_method", method, "'greedy' or 'group_limited_greedy' (DeepSeek-V2's)")
            greedy = method == "greedy"  # its config may still name groups: they are not used
        else:
            for key, want in (("scoring_func", "sigmoid"), ("topk_method", "noaux_tc")):
                if cfg.get(key) not in (None, want):
                    f.fail(key, cfg.get(key), f"{want!r} (a DeepSeek-V2 router is model_type deepseek_v2)")
        groups.update(router=router,
                      n_group=1 if greedy else f.int("n_group", default=v3_moe["n_group"], hi=MAX_EXPERTS),
                      topk_group=1 if greedy else f.int("topk_group", default=v3_moe["topk_group"], hi=MAX_EXPERTS),
                      routed_scale=f.float("routed_scaling_factor", default=v3_moe["scale"], hi=1e4),
                      shared_gated=False,
                      mtp_layers=f.int("num_nextn_predict_layers", default=0, lo=0, hi=MAX_LAYERS))
    if oss:
        groups.update(_gpt_oss_fields(f, layers))
    if hybrid:
        groups.update(_hybrid_fields(f, layers))
    qk_norm = {"qwen3_moe": "head", "olmoe": "full", "qwen3_next": "head", "qwen3_5_moe": "head"}.get(family, "none")
    if glm:
        qk_norm = "head" if f.bool("use_qk_norm", False) else "none"
    return _checked(where, lambda: ModelConfig(
        family=family, vocab_size=vocab, hidden=hidden, num_layers=layers,
        num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, num_experts=experts, top_k=top_k,
        moe_inter=moe_inter, dense_inter=dense_inter, norm_topk_prob=norm_topk,
        rms_eps=f.float("rms_norm_eps", default=1e-6, hi=0.5), rope_theta=theta, rope_scaling=scaling,
        qk_norm=qk_norm, qkv_bias=family == "qwen2_moe" or f.bool("attention_bias", False), shared_inter=shared,
        moe_layers=moe_layers, tie_word_embeddings=f.bool("tie_word_embeddings", False),
        max_position=f.int("max_position_embeddings", default=32768, hi=MAX_POSITIONS), rotary_dim=rotary_dim,
        **_temperature_fields(f), **groups,
    ))


def _temperature_fields(f: Fields) -> dict:
    """Llama 4's query temperature, when the config turns it on (transformers' defaults: scale 0.1, floor 8192)."""
    if not f.bool("attn_temperature_tuning", False):
        return {}
    return dict(attn_temperature_scale=f.float("attn_scale", default=0.1, lo=0.0, lo_open=False, hi=10.0),
                attn_temperature_floor=f.int("floor_scale", default=8192, hi=MAX_POSITIONS))


def _mla_fields(f: Fields) -> dict:
    """DeepSeek-V3's multi-head latent attention dims (``q_lora_rank`` null: a plain q projection)."""
    if f.bool("attention_bias", False):
        f.fail("attention_bias", True, "false (biases on the latent projections are not supported)")
    q_rank = f.get("q_lora_rank")
    return dict(kv_lora_rank=f.int("kv_lora_rank", hi=MAX_HIDDEN),
                q_lora_rank=0 if q_rank is None else f.int("q_lora_rank", hi=MAX_HIDDEN),
                qk_nope_dim=f.int("qk_nope_head_dim", hi=MAX_HEAD_DIM),
                qk_rope_dim=f.int("qk_rope_head_dim", hi=MAX_HEAD_DIM),
                v_head_dim=f.int("v_head_dim", hi=MAX_HEAD_DIM),
                rope_interleave=f.bool("rope_interleave", True))


def _hybrid_fields(f: Fields, layers: int) -> dict:
    """Qwen3-Next's / Qwen3.5-MoE's layer kinds and Gated DeltaNet dims (transformers' defaults: every 4th layer full
    attention, ``full_attention_interval``), the gated attention output and the zero-centred norms."""
    types = f.get("layer_types")
    if types is None:
        every = f.int("full_attention_interval", default=4, hi=MAX_LAYERS)
        types = ["full_attention" if (i + 1) % every == 0 else "linear_attention" for i in range(layers)]
    if not isinstance(types, list) or len(types) != layers or any(t not in LAYER_TYPES for t in types):
        f.fail("layer_types", types, f"a list of {layers} of {', '.join(LAYER_TYPES)}")
    if f.bool("attention_bias", False):
        f.fail("attention_bias", True, "false (biases on a gated q projection are not supported)")
    return dict(layer_types=tuple(types),
                linear_k_heads=f.int("linear_num_key_heads", hi=MAX_HEADS),
                linear_v_heads=f.int("linear_num_value_heads", hi=MAX_HEADS),
                linear_k_dim=f.int("linear_key_head_dim", hi=MAX_HEAD_DIM),
                linear_v_dim=f.int("linear_value_head_dim", hi=MAX_HEAD_DIM),
                linear_conv=f.int("linear_conv_kernel_dim", default=4, hi=64),
                attn_output_gate=True, norm_offset=True)


#: What every gpt-oss model has, whatever file it comes from.
_GPT_OSS = dict(attention_sinks=True, o_bias=True, router_logit_bias=True, expert_bias=True, expert_act="gpt_oss")


def _gpt_oss_fields(f: Fields, layers: int) -> dict:
    """gpt-oss' config fields beyond the common ones: alternating sliding-window and full layers (``layer_types``,
    ``sliding_window``; transformers' default: even layers windowed), sinks, the output and router biases, experts
    with biases and the clamped SwiGLU, whose constants the kernels hold (``swiglu_limit`` 7, ``swiglu_alpha``
    1.702: other values are refused by name)."""
    from freetoken.device.constants import GPT_OSS_ALPHA, GPT_OSS_LIMIT

    for key, want in (("swiglu_limit", GPT_OSS_LIMIT), ("swiglu_alpha", GPT_OSS_ALPHA)):
        got = f.float(key, default=want)
        if got != want:
            f.fail(key, got, f"{want:g} (the expert kernels' constant)")
    window = f.int("sliding_window", default=128, lo=0, hi=MAX_POSITIONS)
    types = f.get("layer_types")
    if types is None:
        types = ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(layers)]
    if not isinstance(types, list) or len(types) != layers or \
            any(t not in ("sliding_attention", "full_attention") for t in types):
        f.fail("layer_types", types, f"a list of {layers} 'sliding_attention' / 'full_attention'")
    return dict(sliding_windows=tuple(window if t == "sliding_attention" else 0 for t in types), **_GPT_OSS)


def _checked(where: str, make) -> ModelConfig:
    """``make()`` with :meth:`ModelConfig.__post_init__`'s errors naming the file."""
    try:
        return make()
    except ConfigError as e:
        msg = str(e)
        raise ConfigError(msg if msg.startswith(where) else f"{where}: {msg}") from None


#: GGUF ``general.architecture`` -> family (``llama`` with experts is Mixtral's layout in llama.cpp).
GGUF_FAMILIES = GGUF_READS
#: llama.cpp's ``{arch}.expert_gating_func`` values (enum llama_expert_gating_func_type).
_GATING_NONE, _GATING_SOFTMAX, _GATING_SIGMOID = 0, 1, 2


def _same_in_every_layer(gf, where: str, layers, suffixes: tuple[str, ...]) -> None:
    """ConfigError unless the tensors ``blk.N.<suffix>`` are all present in every one of ``layers`` or in none:
    the decoder decides per model (q/k norms, qkv biases, shared experts), so a tensor missing from some layers
    would otherwise switch the feature off (or on) for every layer silently."""
    layers = list(layers)
    have = {sfx: [i for i in layers if gf.has(f"blk.{i}.{sfx}")] for sfx in suffixes}
    if all(len(v) == 0 for v in have.values()) or all(len(v) == len(layers) for v in have.values()):
        return
    for sfx, present in have.items():
        if len(present) < len(layers):
            missing = sorted(set(layers) - set(present))
            others = [s for s in suffixes if have[s]]
            raise ConfigError(f"{where}: blk.{missing[0]}.{sfx} is missing ({len(missing)} of {len(layers)} layers "
                              f"lack {sfx}) while other layers have {', '.join(others)}: a model has these in every "
                              "layer or in none")


def _gguf_gpt_oss(gf, m: Fields, arch: str, layers: int) -> dict:
    """gpt-oss' fields of a GGUF file, as llama.cpp reads them: the window and which layers have it
    (``{arch}.attention.sliding_window_pattern``: a per-layer array, or every n-th layer full, default n = 2, so
    layer 0 is windowed), sinks, output and router biases, experts with biases and the clamped SwiGLU."""
    window = m.int(f"{arch}.attention.sliding_window", lo=0, hi=MAX_POSITIONS)
    pattern = gf.meta(f"{arch}.attention.sliding_window_pattern", None)
    if pattern is None or isinstance(pattern, (int, float)):
        n = 2 if pattern is None else m.int(f"{arch}.attention.sliding_window_pattern", hi=MAX_LAYERS)
        swa = [i % n < n - 1 for i in range(layers)]
    else:
        swa = [bool(x) for x in np.asarray(pattern).reshape(-1)]
        if len(swa) < layers:
            raise ConfigError(f"{gf.path}: {arch}.attention.sliding_window_pattern has {len(swa)} entries for "
                              f"{layers} layers")
    for name in ("attn_sinks.weight", "attn_output.bias", "ffn_gate_inp.bias", "ffn_gate_exps.bias",
                 "ffn_up_exps.bias", "ffn_down_exps.bias"):
        if not gf.has(f"blk.0.{name}"):
            raise ConfigError(f"{gf.path}: a gpt-oss file without blk.0.{name}")
    return dict(sliding_windows=tuple(window if swa[i] else 0 for i in range(layers)), **_GPT_OSS)


def _gguf_hybrid(gf, m: Fields, arch: str, layers: int, blocks: int) -> dict:
    """Qwen3-Next's / Qwen3.5-MoE's fields of a GGUF file, as llama.cpp reads them and its converter writes them.

    Which layers are Gated DeltaNet: ``{arch}.attention.recurrent_layers`` (one flag per block, the MTP blocks
    included; the converter writes it from the config's ``layer_types``), else every
    ``{arch}.full_attention_interval``-th layer (default 4) is full attention and the rest linear; each layer's
    tensors must agree (a linear layer has ``ssm_a``, a full one ``attn_q``). The linear layers' dims:
    ``ssm.group_count`` key heads, ``ssm.time_step_rank`` value heads, ``ssm.state_size`` the key head dim,
    ``ssm.inner_size`` value heads x value head dim, ``ssm.conv_kernel`` the convolution's taps. What every such
    model has: the sigmoid output gate in ``attn_q`` and zero-centred norms (stored as ``1 + w``, read as stored).
    Refused by name: qwen3next's older fused ``ssm_in`` and a fused ``attn_qkv`` in a full-attention layer."""
    where = str(gf.path)
    key = f"{arch}.attention.recurrent_layers"
    rec = gf.meta(key, None)
    if rec is not None:
        flags = [bool(x) for x in np.asarray(rec).reshape(-1)]
        if len(flags) == 1:  # one value for every block (llama.cpp's key-or-array)
            flags *= blocks
        if len(flags) != blocks:
            raise ConfigError(f"{where}: {key} has {len(flags)} entries for {blocks} blocks ({arch}.block_count)")
        source = key
    else:
        every = m.int(f"{arch}.full_attention_interval", default=4, hi=MAX_LAYERS)
        flags = [(i + 1) % every != 0 for i in range(blocks)]
        source = f"{arch}.full_attention_interval {every}"
    types = tuple("linear_attention" if flags[i] else "full_attention" for i in range(layers))
    for i, t in enumerate(types):
        linear = t == "linear_attention"
        if linear and gf.has(f"blk.{i}.ssm_in.weight") and not gf.has(f"blk.{i}.attn_qkv.weight"):
            raise ConfigError(f"{where}: blk.{i}.ssm_in.weight: the fused q|k|v|z projection of older qwen3next "
                              "conversions is not supported; re-convert with a current convert_hf_to_gguf.py "
                              "(attn_qkv + attn_gate)")
        if linear != gf.has(f"blk.{i}.ssm_a"):
            kind = "linear-attention (Gated DeltaNet)" if linear else "full-attention"
            raise ConfigError(f"{where}: {source} makes layer {i} a {kind} layer, but the file "
                              f"{'lacks' if linear else 'has'} blk.{i}.ssm_a")
        if not linear and gf.has(f"blk.{i}.attn_qkv.weight") and not gf.has(f"blk.{i}.attn_q.weight"):
            raise ConfigError(f"{where}: blk.{i}.attn_qkv.weight: a fused q|k|v projection in a full-attention layer "
                              "is not supported (attn_q, attn_k and attn_v, as the converter writes them by default)")
    dims = dict(linear_k_heads=0, linear_v_heads=0, linear_k_dim=0, linear_v_dim=0, linear_conv=0)
    if "linear_attention" in types:
        v_heads = m.int(f"{arch}.ssm.time_step_rank", hi=MAX_HEADS)
        inner = m.int(f"{arch}.ssm.inner_size", hi=MAX_HEADS * MAX_HEAD_DIM)
        if inner % v_heads:
            raise ConfigError(f"{where}: {arch}.ssm.inner_size {inner} is not a whole number of value heads "
                              f"({arch}.ssm.time_step_rank {v_heads})")
        dims = dict(linear_k_heads=m.int(f"{arch}.ssm.group_count", hi=MAX_HEADS), linear_v_heads=v_heads,
                    linear_k_dim=m.int(f"{arch}.ssm.state_size", hi=MAX_HEAD_DIM), linear_v_dim=inner // v_heads,
                    linear_conv=m.int(f"{arch}.ssm.conv_kernel", hi=64))
    return dict(layer_types=types, attn_output_gate=True, norm_offset=True, **dims)


def from_gguf(gf) -> ModelConfig:
    """The config of a :class:`freetoken.loaders.GGUFFile` from its ``{arch}.*`` metadata and tensor shapes;
    :class:`ConfigError` (naming the file) for architectures, layouts and RoPE variants the decoder lacks."""
    where = str(gf.path)
    family = GGUF_FAMILIES.get(gf.arch)
    if family is None:
        raise ConfigError(f"{where}: unsupported GGUF architecture {gf.arch!r}; freetoken runs "
                          f"{', '.join(GGUF_FAMILIES)}")

    m = Fields(lambda key: gf.meta(key, None), where, "metadata key")
    arch = gf.arch

    blocks = m.int(f"{arch}.block_count", hi=MAX_LAYERS)
    # multi-token-prediction layers come after the decoder's and count in block_count (llama.cpp's converter)
    mtp = m.int(f"{arch}.nextn_predict_layers", default=0, lo=0, hi=blocks - 1)
    layers = blocks - mtp
    hidden = m.int(f"{arch}.embedding_length", hi=MAX_HIDDEN)
    heads = m.int(f"{arch}.attention.head_count", hi=MAX_HEADS)
    kv = gf.meta(f"{arch}.attention.head_count_kv", None)
    if kv is not None and not isinstance(kv, (int, float)):
        # per-layer arrays exist in some files; one value is all this decoder supports
        vals = {m.whole(f"{arch}.attention.head_count_kv[]", v, 1, MAX_HEADS) for v in np.asarray(kv).reshape(-1)}
        if len(vals) != 1:
            raise ConfigError(f"{where}: per-layer KV head counts {sorted(vals)} are not supported")
        kv = vals.pop()
    else:
        kv = m.int(f"{arch}.attention.head_count_kv", default=heads, hi=MAX_HEADS)
    experts = m.int(f"{arch}.expert_count", default=0, lo=0, hi=MAX_EXPERTS)
    if experts == 0:
        raise ConfigError(f"{where}: {gf.arch} model without experts ({gf.arch}.expert_count); freetoken runs "
                          "MoE models")
    hybrid = _gguf_hybrid(gf, m, arch, layers, blocks) if family in HYBRID_FAMILIES else {}
    # the layers with attention (q/k/v projections, their norms and biases): all but the linear-attention ones
    attn_layers = [i for i in range(layers) if hybrid.get("layer_types", ("full_attention",) * layers)[i]
                   == "full_attention"]
    moe_layers = tuple(gf.has(f"blk.{i}.ffn_gate_inp.weight") for i in range(layers))
    first = next((i for i, m in enumerate(moe_layers) if m), None)
    if first is None:
        raise ConfigError(f"{where}: no layer has a router (blk.N.ffn_gate_inp.weight)")
    if gf.has(f"blk.{first}.ffn_gate_up_exps.weight"):
        raise ConfigError(f"{where}: blk.{first}.ffn_gate_up_exps.weight: experts with gate and up fused in one tensor "
                          "(the converter's --fuse-gate-up-exps) are not supported; convert without it "
                          "(ffn_gate_exps + ffn_up_exps)")
    if not gf.has(f"blk.{first}.ffn_gate_exps.weight"):
        raise ConfigError(f"{where}: experts stored per expert (blk.{first}.ffn_gate.0.weight, old llama.cpp "
                          "files) are not supported; re-convert with a current converter (merged *_exps tensors)")
    gate_shape = gf.info(f"blk.{first}.ffn_gate_exps.weight").shape
    if len(gate_shape) != 3:
        raise ConfigError(f"{where}: blk.{first}.ffn_gate_exps.weight has shape {list(gate_shape)}, expected "
                          "[experts, expert FFN, hidden]")
    moe_inter = gate_shape[1]
    dense = next((i for i, m in enumerate(moe_layers) if not m), None)
    dense_inter = gf.info(f"blk.{dense}.ffn_gate.weight").shape[0] if dense is not None else 0
    for group in (("attn_q_norm.weight", "attn_k_norm.weight"), ("attn_q.bias", "attn_k.bias", "attn_v.bias")):
        _same_in_every_layer(gf, where, attn_layers, group)
    moe_ids = [i for i, x in enumerate(moe_layers) if x]
    _same_in_every_layer(gf, where, moe_ids, ("ffn_gate_shexp.weight", "ffn_up_shexp.weight",
                                              "ffn_down_shexp.weight"))
    _same_in_every_layer(gf, where, moe_ids, ("ffn_gate_inp_shexp.weight",))
    shared_inter = 0
    shared_gated = gf.has(f"blk.{first}.ffn_gate_inp_shexp.weight")
    if gf.has(f"blk.{first}.ffn_gate_shexp.weight"):
        if family not in ("qwen2_moe", "glm4_moe", "deepseek_v3", "deepseek_v2", *HYBRID_FAMILIES):
            raise ConfigError(f"{where}: shared experts in a {gf.arch} model are not supported")
        if shared_gated != (family in ("qwen2_moe", *HYBRID_FAMILIES)):
            raise ConfigError(f"{where}: a {gf.arch} shared expert {'with' if shared_gated else 'without'} a "
                              f"sigmoid gate (blk.{first}.ffn_gate_inp_shexp.weight) is not supported")
        shared_inter = gf.info(f"blk.{first}.ffn_gate_shexp.weight").shape[0]
    elif shared_gated:
        raise ConfigError(f"{where}: blk.{first}.ffn_gate_inp_shexp.weight without a shared expert")
    kind = m.str(f"{arch}.rope.scaling.type")
    rope_scaling = None
    if kind not in (None, "none"):
        if kind not in ("linear", "yarn"):
            raise ConfigError(f"{where}: rope scaling {kind!r} is not supported (supported: linear, yarn)")
        if gf.meta(f"{arch}.rope.scaling.factor", None) is None:
            raise ConfigError(f"{where}: rope scaling {kind!r} without {arch}.rope.scaling.factor")
        orig = gf.meta(f"{arch}.rope.scaling.original_context_length", None)
        rope_scaling = {"rope_type": kind, "factor": m.float(f"{arch}.rope.scaling.factor", hi=1e6),
                        "original_max_position_embeddings": None if orig is None else
                        m.int(f"{arch}.rope.scaling.original_context_length", hi=MAX_POSITIONS)}
        if kind == "yarn":  # llama.cpp floors/ceils the ramp's ends always: HF's truncate=True
            for key in ("beta_fast", "beta_slow"):
                v = m.float(f"{arch}.rope.scaling.yarn_{key}", default=0.0, lo=0.0, lo_open=False)
                if v:
                    rope_scaling[key] = v
    scale = m.float(f"{arch}.expert_weights_scale", default=1.0, lo=0.0, lo_open=False) or 1.0  # llama.cpp: 0 = 1
    router = {}
    if family in ("glm4_moe", "deepseek_v3"):
        gating = m.int(f"{arch}.expert_gating_func", default=_GATING_NONE, lo=0, hi=8)
        # llama.cpp takes none as sigmoid for glm4moe, and as softmax for deepseek2 (DeepSeek-V2's files)
        sigmoid = gating == _GATING_SIGMOID or (gating == _GATING_NONE and family == "glm4_moe")
        if not sigmoid and (family == "glm4_moe" or gating not in (_GATING_NONE, _GATING_SOFTMAX)):
            raise ConfigError(f"{where}: {arch}.expert_gating_func {gating}: not a router freetoken runs "
                              f"({'sigmoid' if family == 'glm4_moe' else 'sigmoid (DeepSeek-V3) or softmax (V2)'})")
        if not sigmoid:
            family = "deepseek_v2"
        n_group = m.int(f"{arch}.expert_group_count", default=1, lo=0, hi=MAX_EXPERTS) or 1
        # llama.cpp limits the choice to groups only when there are several (then it needs the used count). For
        # DeepSeek-V2 it scores a group by its top two probabilities, as for V3, where the model (transformers,
        # DeepSeek's own code) takes the largest one: freetoken runs the model's definition.
        topk_group = m.int(f"{arch}.expert_group_used_count", hi=n_group) if n_group > 1 else 1
        router = dict(router="sigmoid_group" if sigmoid else "softmax_group", n_group=n_group, topk_group=topk_group,
                      routed_scale=scale, shared_gated=False, mtp_layers=mtp)
    elif family == "gpt_oss":
        router = _gguf_gpt_oss(gf, m, arch, layers)
    elif scale != 1.0:
        raise ConfigError(f"{where}: expert_weights_scale {scale} is not supported")
    elif family in HYBRID_FAMILIES:
        # Qwen3-Next's / Qwen3.5's MTP block(s) after the decoder's (nextn): not run, as for DeepSeek-V3
        router = dict(mtp_layers=mtp)
    elif mtp:
        raise ConfigError(f"{where}: {arch}.nextn_predict_layers {mtp}: multi-token-prediction layers in a "
                          f"{arch} model are not supported")
    mla = {}
    if family in ("deepseek_v3", "deepseek_v2"):  # the attention is stored as MQA over the latent: key_length R + P
        head_dim = m.int(f"{arch}.attention.key_length_mla", hi=MAX_HEAD_DIM)
        rope = m.int(f"{arch}.rope.dimension_count", lo=2, hi=head_dim - 1)
        mla = dict(kv_lora_rank=m.int(f"{arch}.attention.kv_lora_rank", hi=MAX_HIDDEN),
                   q_lora_rank=m.int(f"{arch}.attention.q_lora_rank", default=0, lo=0, hi=MAX_HIDDEN),
                   qk_nope_dim=head_dim - rope, qk_rope_dim=rope,
                   v_head_dim=m.int(f"{arch}.attention.value_length_mla", hi=MAX_HEAD_DIM),
                   rope_interleave=True)  # llama.cpp rotates adjacent pairs here: DeepSeek's own layout
        kv = heads
        ms = gf.meta(f"{arch}.rope.scaling.yarn_log_multiplier", None)
        if rope_scaling is not None and ms:  # the converter writes 0.1 * mscale_all_dim; llama.cpp's mscale equals it
            mscale = m.float(f"{arch}.rope.scaling.yarn_log_multiplier", hi=1e3) / 0.1
            rope_scaling.update(mscale=mscale, mscale_all_dim=mscale)
        rotary_dim = head_dim
    else:
        head_dim = m.int(f"{arch}.attention.key_length", default=hidden // heads, hi=MAX_HEAD_DIM)
        rotary_dim = m.int(f"{arch}.rope.dimension_count", default=head_dim, lo=2, hi=head_dim)
    if rotary_dim != head_dim and family not in ("glm4_moe", *HYBRID_FAMILIES):
        raise ConfigError(f"{where}: {arch}.rope.dimension_count {rotary_dim} of a head of {head_dim}: partial rotary "
                          f"in a {arch} model is not supported")
    vocab = m.int(f"{arch}.vocab_size", default=0, lo=0, hi=MAX_VOCAB) or \
        m.whole("token_embd.weight rows", gf.info("token_embd.weight").shape[0], 1, MAX_VOCAB)
    qk_norm = "none"
    a0 = attn_layers[0] if attn_layers else 0
    if gf.has(f"blk.{a0}.attn_q_norm.weight"):  # then every attention layer has both norms (checked above)
        qk_norm = "full" if family == "olmoe" else "head"
    qkv_bias = gf.has(f"blk.{a0}.attn_q.bias")
    if family in HYBRID_FAMILIES and (qk_norm != "head" or qkv_bias):
        raise ConfigError(f"{where}: a {arch} model's attention has q/k norms (blk.{a0}.attn_q_norm.weight) and no "
                          f"biases; this file {'has biases (attn_q.bias)' if qkv_bias else 'lacks the norms'}")
    return _checked(where, lambda: ModelConfig(
        family=family, vocab_size=vocab, hidden=hidden, num_layers=layers, num_heads=heads, num_kv_heads=int(kv),
        head_dim=head_dim, rotary_dim=0 if rotary_dim == head_dim else rotary_dim,
        num_experts=experts, top_k=m.int(f"{arch}.expert_used_count", hi=experts),
        moe_inter=m.whole("ffn_gate_exps rows", int(moe_inter), 1, MAX_INTERMEDIATE),
        dense_inter=m.whole("ffn_gate rows", int(dense_inter), 0, MAX_INTERMEDIATE),
        norm_topk_prob=m.bool(f"{arch}.expert_weights_norm", FAMILY_ROWS[family].gguf_norm_topk),
        rms_eps=m.float(f"{arch}.attention.layer_norm_rms_epsilon", default=1e-6, hi=0.5),
        rope_theta=m.float(f"{arch}.rope.freq_base", default=1e4),
        rope_scaling=rope_scaling,
        qk_norm=qk_norm, qkv_bias=qkv_bias, shared_inter=int(shared_inter),
        moe_layers=moe_layers, tie_word_embeddings=not gf.has("output.weight"),
        max_position=m.int(f"{arch}.context_length", default=32768, hi=MAX_POSITIONS), **router, **mla, **hybrid,
        attn_temperature_scale=m.float(f"{arch}.attention.temperature_scale", default=0.0, lo=0.0, lo_open=False,
                                       hi=10.0),
        attn_temperature_floor=m.int(f"{arch}.attention.temperature_length", default=8192, hi=MAX_POSITIONS),
    ))
