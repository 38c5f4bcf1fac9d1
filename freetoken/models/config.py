"""Model configuration of the supported MoE families, parsed from an HF ``config.json`` or a GGUF file's metadata.

One decoder serves every family; their differences are the flat fields of :class:`ModelConfig` (q/k norms per head
or over the projection, qkv and output biases, attention sinks, sliding windows per layer, multi-head latent
attention, shared experts with or without a gate, the router kind and its groups, top-k renormalisation, partial
rotary, experts with biases and the clamped SwiGLU, which layers are MoE, Gated DeltaNet layers). Which fields a
family has, and how its HF and GGUF configs name them, is the family's own module
(:mod:`freetoken.models.families`); :func:`from_hf` and :func:`from_gguf` read what every family shares and ask the
family for the rest.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from freetoken.models.families import BY_NAME as FAMILY_ROWS
from freetoken.models.families import GGUF_READS, HYBRID, MODEL_TYPES
from freetoken.models.families.base import GGUFConfig, HFConfig
from freetoken.models.families.gated_deltanet import LAYER_TYPES
from freetoken.models.fields import (
    MAX_EXPERTS,
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
    value and what was expected) before anything is allocated. ``where``: the file, for messages. What differs
    between families is read by the family's module (:meth:`freetoken.models.families.base.Family.hf_fields`)."""
    if not isinstance(cfg, dict):
        raise ConfigError(f"{where}: expected a JSON object, got {type(cfg).__name__}")
    mt = cfg.get("model_type")
    if not isinstance(mt, str) or mt not in FAMILIES:
        raise ConfigError(f"{where}: unsupported model_type {mt!r}; freetoken runs {', '.join(FAMILIES)}")
    family = FAMILY_ROWS[FAMILIES[mt]]
    cfg, where = family.hf_text_config(cfg, where)
    f = Fields(cfg.get, where)
    hidden = f.int("hidden_size", hi=MAX_HIDDEN)
    layers = f.int("num_hidden_layers", hi=MAX_LAYERS)
    heads = f.int("num_attention_heads", hi=MAX_HEADS)
    kv_heads = f.int("num_key_value_heads", default=heads, hi=MAX_HEADS)
    own = family.hf_fields(HFConfig(f, cfg, hidden, layers, heads))
    theta, scaling = _rope(f, cfg)
    if cfg.get("sliding_window") and f.bool("use_sliding_window", False):
        raise ConfigError(f"{where}: sliding-window attention is not supported yet")
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
    return _checked(where, lambda: ModelConfig(
        family=family.name, vocab_size=vocab, hidden=hidden, num_layers=layers, num_heads=heads,
        num_kv_heads=kv_heads, rms_eps=f.float("rms_norm_eps", default=1e-6, hi=0.5), rope_theta=theta,
        rope_scaling=scaling, tie_word_embeddings=f.bool("tie_word_embeddings", False),
        max_position=f.int("max_position_embeddings", default=32768, hi=MAX_POSITIONS),
        **_temperature_fields(f), **own,
    ))


def _temperature_fields(f: Fields) -> dict:
    """Llama 4's query temperature, when the config turns it on (transformers' defaults: scale 0.1, floor 8192)."""
    if not f.bool("attn_temperature_tuning", False):
        return {}
    return dict(attn_temperature_scale=f.float("attn_scale", default=0.1, lo=0.0, lo_open=False, hi=10.0),
                attn_temperature_floor=f.int("floor_scale", default=8192, hi=MAX_POSITIONS))


def _checked(where: str, make) -> ModelConfig:
    """``make()`` with :meth:`ModelConfig.__post_init__`'s errors naming the file."""
    try:
        return make()
    except ConfigError as e:
        msg = str(e)
        raise ConfigError(msg if msg.startswith(where) else f"{where}: {msg}") from None


#: GGUF ``general.architecture`` -> family (``llama`` with experts is Mixtral's layout in llama.cpp).
GGUF_FAMILIES = GGUF_READS

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


def from_gguf(gf) -> ModelConfig:
    """The config of a :class:`freetoken.loaders.GGUFFile` from its ``{arch}.*`` metadata and tensor shapes;
    :class:`ConfigError` (naming the file) for architectures, layouts and RoPE variants the decoder lacks. What
    differs between families is read by the family's module (the ``gguf_*`` hooks of
    :class:`freetoken.models.families.base.Family`)."""
    where = str(gf.path)
    name = GGUF_FAMILIES.get(gf.arch)
    if name is None:
        raise ConfigError(f"{where}: unsupported GGUF architecture {gf.arch!r}; freetoken runs "
                          f"{', '.join(GGUF_FAMILIES)}")
    family = FAMILY_ROWS[name]
    m = Fields(lambda key: gf.meta(key, None), where, "metadata key")
    arch = gf.arch

    blocks = m.int(f"{arch}.block_count", hi=MAX_LAYERS)
    # multi-token-prediction layers come after the decoder's and count in block_count (llama.cpp's converter)
    mtp = m.int(f"{arch}.nextn_predict_layers", default=0, lo=0, hi=blocks - 1)
    layers = blocks - mtp
    g = GGUFConfig(gf, m, arch, layers, blocks)
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
    kinds = family.gguf_layer_kinds(g)
    # the layers with attention (q/k/v projections, their norms and biases): all but the linear-attention ones
    attn_layers = [i for i in range(layers) if kinds.get("layer_types", ("full_attention",) * layers)[i]
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
        if not family.shared_expert:
            raise ConfigError(f"{where}: shared experts in a {gf.arch} model are not supported")
        if shared_gated != (family.shared_expert == "gated"):
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
    router = family.gguf_router(g, scale, mtp)
    family = FAMILY_ROWS[router.pop("family", family.name)]  # (a deepseek2 file with softmax scores: DeepSeek-V2)
    attention = {"num_kv_heads": int(kv), **family.gguf_attention(g, hidden, heads)}
    rope_scaling = family.gguf_rope_scaling(g, rope_scaling)
    vocab = m.int(f"{arch}.vocab_size", default=0, lo=0, hi=MAX_VOCAB) or \
        m.whole("token_embd.weight rows", gf.info("token_embd.weight").shape[0], 1, MAX_VOCAB)
    qk_norm = "none"
    a0 = attn_layers[0] if attn_layers else 0
    if gf.has(f"blk.{a0}.attn_q_norm.weight"):  # then every attention layer has both norms (checked above)
        qk_norm = family.gguf_qk_norm
    qkv_bias = gf.has(f"blk.{a0}.attn_q.bias")
    family.gguf_check_attention(g, a0, qk_norm, qkv_bias)
    return _checked(where, lambda: ModelConfig(
        family=family.name, vocab_size=vocab, hidden=hidden, num_layers=layers, num_heads=heads,
        num_experts=experts, top_k=m.int(f"{arch}.expert_used_count", hi=experts),
        moe_inter=m.whole("ffn_gate_exps rows", int(moe_inter), 1, MAX_INTERMEDIATE),
        dense_inter=m.whole("ffn_gate rows", int(dense_inter), 0, MAX_INTERMEDIATE),
        norm_topk_prob=m.bool(f"{arch}.expert_weights_norm", family.gguf_norm_topk),
        rms_eps=m.float(f"{arch}.attention.layer_norm_rms_epsilon", default=1e-6, hi=0.5),
        rope_theta=m.float(f"{arch}.rope.freq_base", default=1e4),
        rope_scaling=rope_scaling,
        qk_norm=qk_norm, qkv_bias=qkv_bias, shared_inter=int(shared_inter),
        moe_layers=moe_layers, tie_word_embeddings=not gf.has("output.weight"),
        max_position=m.int(f"{arch}.context_length", default=32768, hi=MAX_POSITIONS), **router, **attention,
        **kinds,
        attn_temperature_scale=m.float(f"{arch}.attention.temperature_scale", default=0.0, lo=0.0, lo_open=False,
                                       hi=10.0),
        attn_temperature_floor=m.int(f"{arch}.attention.temperature_length", default=8192, hi=MAX_POSITIONS),
    ))
