"""What a family module declares, and the config reads the families share.

A family is one :class:`Family` object in its own module (``freetoken/models/families/<name>.py``), listed once in
the registry (:mod:`freetoken.models.families`). The object carries the family's names (HF ``model_type`` values,
the GGUF architecture, tensor names that differ from the common ones) and its knowledge as methods: which of an HF
``config.json``'s fields it reads and how (:meth:`Family.hf_fields`), the same from a GGUF file's metadata
(:meth:`Family.gguf_router` and the other ``gguf_*`` hooks), and what it writes into a GGUF file
(:meth:`Family.write_gguf`). The common parts of those readers stay in :mod:`freetoken.models.config`, which builds
the flat :class:`~freetoken.models.config.ModelConfig` the decoder runs from.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from freetoken.models.fields import MAX_EXPERTS, MAX_HEAD_DIM, MAX_INTERMEDIATE, MAX_LAYERS, ConfigError, Fields


@dataclass(frozen=True)
class HFConfig:
    """An HF config being read: its fields (``f``, naming the file), the raw dict and the sizes every family has."""

    f: Fields
    raw: dict
    hidden: int
    layers: int
    heads: int

    def head_dim(self) -> int:
        """``head_dim``, else ``hidden_size / num_attention_heads`` (which must then divide)."""
        f = self.f
        if self.raw.get("head_dim") is None and self.hidden % self.heads:
            f.fail("num_attention_heads", self.heads, f"a divisor of hidden_size {self.hidden} (no head_dim is given)")
        return f.int("head_dim", default=self.hidden // self.heads, hi=MAX_HEAD_DIM)

    def experts(self) -> dict:
        """The routed experts' count and how many a token uses."""
        experts = self.f.int("num_experts", "num_local_experts", "n_routed_experts", hi=MAX_EXPERTS)
        return dict(num_experts=experts, top_k=self.f.int("num_experts_per_tok", "experts_per_token", hi=experts))

    def ffn_sizes(self) -> dict:
        """An expert's FFN width (``moe_intermediate_size``) and a dense layer's (``intermediate_size``, 0 if none)."""
        f = self.f
        return dict(moe_inter=f.int("moe_intermediate_size", "intermediate_size", hi=MAX_INTERMEDIATE),
                    dense_inter=f.int("intermediate_size", default=0, lo=0, hi=MAX_INTERMEDIATE))

    def expert_ffn_only(self) -> dict:
        """Mixtral's and gpt-oss' sizes: ``intermediate_size`` is the experts' width, no layer is dense."""
        return dict(moe_inter=self.f.int("intermediate_size", hi=MAX_INTERMEDIATE), dense_inter=0)

    def sparse_step_layers(self) -> tuple[bool, ...]:
        """Which layers are MoE by ``decoder_sparse_step`` and ``mlp_only_layers`` (Qwen's fields)."""
        f, layers = self.f, self.layers
        step = f.int("decoder_sparse_step", default=1, lo=0, hi=MAX_LAYERS) or 1
        mlp_only = set(f.int_list("mlp_only_layers", 0, layers - 1))
        return tuple((i not in mlp_only) and (i + 1) % step == 0 for i in range(layers))

    def rotary_dim(self, head_dim: int, default_factor: float) -> int:
        """The rotated head dims of ``partial_rotary_factor`` (in ``rope_parameters`` or at the top level;
        ``default_factor`` when neither names one), 0 when every dim rotates."""
        factor = (self.f.dict("rope_parameters") or {}).get("partial_rotary_factor",
                                                            self.raw.get("partial_rotary_factor", default_factor))
        pf = Fields(lambda _: factor, self.f.where).float("partial_rotary_factor", hi=1.0)
        rotary = int(head_dim * pf)  # transformers' rounding
        if rotary < 2:
            self.f.fail("partial_rotary_factor", factor,
                        f"a factor that rotates at least 2 of the {head_dim} head dims")
        return 0 if rotary == head_dim else rotary


@dataclass(frozen=True)
class GGUFConfig:
    """A GGUF file being read: the file, its metadata fields (``m``, naming it), its architecture and its layers
    (``layers`` decoder layers of ``blocks``, the rest multi-token-prediction blocks)."""

    gf: Any
    m: Fields
    arch: str
    layers: int
    blocks: int

    @property
    def where(self) -> str:
        return str(self.gf.path)


@dataclass(frozen=True, eq=False)
class Family:
    """One model family (see the module doc). The defaults are the plain MoE transformer every family starts from:
    softmax top-k router, no shared expert, every head dim rotated, no q/k norms."""

    name: str
    #: HF ``config.json`` ``model_type`` values read as this family
    model_types: tuple[str, ...]
    #: GGUF ``general.architecture`` written for it (llama.cpp's name; ``llama`` with experts is Mixtral's layout)
    gguf_arch: str
    #: a GGUF file of ``gguf_arch`` is read as this family (deepseek2 files are read as deepseek_v3, whose reader
    #: covers DeepSeek-V2's layout as well)
    reads_gguf: bool = True
    #: Gated DeltaNet linear-attention layers beside gated full attention (``layer_types``)
    hybrid: bool = False
    #: llama.cpp renormalises the top-k router weights when ``{arch}.expert_weights_norm`` is absent (it hard-codes
    #: this per architecture; glm4moe reads the key, default false)
    gguf_norm_topk: bool = False
    #: ``norm_topk_prob`` when an HF config does not name it (transformers' default for the family)
    norm_topk_default: bool = False
    #: the shared expert: "" none, "gated" (Qwen2-MoE's, scaled by a sigmoid gate; HF
    #: ``shared_expert_intermediate_size``), "plain" (DeepSeek's ``n_shared_experts`` routed-expert widths, added)
    shared_expert: str = ""
    #: the HF ``partial_rotary_factor`` when a config names none; 0: every head dim rotates and a GGUF file that
    #: rotates fewer is refused
    partial_rotary: float = 0.0
    #: the q/k norms a GGUF file's ``attn_q_norm`` / ``attn_k_norm`` are: "head" (over head_dim) or "full" (OLMoE's,
    #: over the whole projection)
    gguf_qk_norm: str = "head"
    #: llama.cpp's architecture reads ``{arch}.expert_feed_forward_length`` (its ``llama`` does not)
    gguf_expert_ffn_length: bool = True
    #: HF tensor names (relative to ``model.layers.N.``) that differ from the common ones
    #: (:data:`freetoken.models.weights.HF_LAYER_NAMES`)
    hf_layer_names: Mapping[str, str] = field(default_factory=dict)
    #: where the router and the routed experts sit in an HF layer (Mixtral: ``block_sparse_moe.``)
    hf_moe_prefix: str = "mlp."
    #: where an HF checkpoint keeps the language model (the first holding ``embed_tokens.weight``)
    hf_model_prefixes: tuple[str, ...] = ("model.",)
    #: an HF layer's routed experts may be stored stacked (``gate_up_proj`` [E, 2I, H], ``down_proj`` [E, H, I])
    hf_stacked_experts: bool = False
    #: gpt-oss' expert storage: ``gate_up_proj`` [E, H, 2I] with gate and up interleaved, input-major, with biases
    #: (:data:`freetoken.models.weights.GPT_OSS_EXPERTS`)
    hf_experts_interleaved: bool = False
    #: the Gated DeltaNet input projections are stored fused per key head (Qwen3-Next's ``lin_ba``, and in HF
    #: checkpoints ``lin_qkvz``), read out as the four separate ones
    fused_linear_inputs: bool = False
    #: an HF routed expert's gate, up and down projections
    hf_expert_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    #: GGUF tensor names (relative to ``blk.N.``) that differ from the common ones
    gguf_layer_names: Mapping[str, str] = field(default_factory=dict)

    # ---- HF config.json ----------------------------------------------------------------------------------------
    def hf_text_config(self, cfg: dict, where: str) -> tuple[dict, str]:
        """The dict holding the language model's fields (an image-text model nests them), and its name."""
        return cfg, where

    def hf_fields(self, c: HFConfig) -> dict:
        """The family's :class:`~freetoken.models.config.ModelConfig` fields of an HF config: attention, MoE
        structure, router, and whatever else the family has (the common ones, sizes, RoPE, vocabulary, are read
        by :func:`freetoken.models.config.from_hf`)."""
        return {**self.hf_attention(c), **self.hf_moe(c)}

    def hf_attention(self, c: HFConfig) -> dict:
        head_dim = c.head_dim()
        out = dict(head_dim=head_dim, qk_norm=self.hf_qk_norm(c), qkv_bias=c.f.bool("attention_bias", False))
        if self.partial_rotary:
            out["rotary_dim"] = c.rotary_dim(head_dim, self.partial_rotary)
        return out

    def hf_qk_norm(self, c: HFConfig) -> str:
        """"none", "head" or "full" (:attr:`ModelConfig.qk_norm`)."""
        return "none"

    def hf_moe(self, c: HFConfig) -> dict:
        out = dict(**c.experts(), **c.ffn_sizes(), norm_topk_prob=c.f.bool("norm_topk_prob", self.norm_topk_default),
                   moe_layers=c.sparse_step_layers())
        if self.shared_expert == "gated":
            out["shared_inter"] = c.f.int("shared_expert_intermediate_size", default=0, lo=0, hi=MAX_INTERMEDIATE)
        return out

    # ---- GGUF metadata -----------------------------------------------------------------------------------------
    def gguf_layer_kinds(self, g: GGUFConfig) -> dict:
        """The token mixer of each layer when the family mixes kinds (``layer_types`` and their dims), else {}."""
        return {}

    def gguf_router(self, g: GGUFConfig, scale: float, mtp: int) -> dict:
        """The router's fields (and ``family`` when the file is another family's variant) and the MTP layers'
        count. The plain router has no scale and the family no MTP layers."""
        if scale != 1.0:
            raise ConfigError(f"{g.where}: expert_weights_scale {scale} is not supported")
        if mtp:
            raise ConfigError(f"{g.where}: {g.arch}.nextn_predict_layers {mtp}: multi-token-prediction layers in a "
                              f"{g.arch} model are not supported")
        return {}

    def gguf_attention(self, g: GGUFConfig, hidden: int, heads: int) -> dict:
        """``head_dim`` and ``rotary_dim`` (and the latent attention's dims where the family has it) of a file."""
        m, arch = g.m, g.arch
        head_dim = m.int(f"{arch}.attention.key_length", default=hidden // heads, hi=MAX_HEAD_DIM)
        rotary = m.int(f"{arch}.rope.dimension_count", default=head_dim, lo=2, hi=head_dim)
        if rotary != head_dim and not self.partial_rotary:
            raise ConfigError(f"{g.where}: {arch}.rope.dimension_count {rotary} of a head of {head_dim}: partial "
                              f"rotary in a {arch} model is not supported")
        return dict(head_dim=head_dim, rotary_dim=0 if rotary == head_dim else rotary)

    def gguf_rope_scaling(self, g: GGUFConfig, scaling: dict | None) -> dict | None:
        """The RoPE scaling read from the common keys, completed with the family's own."""
        return scaling

    def gguf_check_attention(self, g: GGUFConfig, first_attention: int, qk_norm: str, qkv_bias: bool) -> None:
        """Refuse a file whose attention this family cannot have."""

    # ---- writing GGUF ------------------------------------------------------------------------------------------
    def write_gguf(self, writer, cfg, rope_sections: list[int] | None) -> None:
        """The family's own metadata keys (beyond those every architecture has)."""

    def llama_cpp_notes(self, cfg, rope_sections: list[int] | None) -> list[str]:
        """What of a model written as this family's GGUF architecture llama.cpp will not load or run."""
        return []
