"""The MoE decoder of the Qwen3-MoE / Qwen2-MoE / Mixtral / OLMoE families: embedding, layers, final norm, LM head.

Each layer's blocks (:mod:`freetoken.models.blocks`) are picked from the config once, here, at load time; a forward
pass then reads top to bottom (:meth:`MoeDecoder.forward`). Dense projections are :class:`Linear` matrices held in
their exact storage; the routed experts run through the :class:`freetoken.models.experts.ExpertRunner` the decoder
is given (whether they are cached on a GPU, split with the CPU or read in place is the runner's concern).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from freetoken import ops
from freetoken.models.blocks import (
    Attention,
    DecoderLayer,
    DenseMLP,
    HeadNormQK,
    MoeMLP,
    PlainQK,
    ProjectionNormQK,
    SharedExpert,
    SoftmaxTopKRouter,
)
from freetoken.models.config import ModelConfig
from freetoken.models.experts import ExpertRunner
from freetoken.models.kv import KVCache
from freetoken.models.linear import Linear
from freetoken.models.qmatrix import QuantizedMatrix
from freetoken.models.rope import rope_tables
from freetoken.models.scratch import Scratch
from freetoken.models.weights import HFWeights, Weights


class _Tensors:
    """A weight source read for one device: vectors as device float32 arrays, host float32 arrays, and dense
    projections as :class:`Linear` takes them (a GGUF-quantized matrix stays a :class:`QuantizedMatrix`)."""

    def __init__(self, weights: Weights, device):
        self.weights, self.dev = weights, device

    def host(self, key: str, layer: int | None = None) -> np.ndarray:
        return np.ascontiguousarray(self.weights.get(key, layer), dtype=np.float32)

    def vector(self, key: str, layer: int | None = None):
        return self.dev.asarray(self.host(key, layer))

    def matrix(self, key: str, layer: int | None = None):
        w = self.weights.get_matrix(key, layer)
        return w if isinstance(w, QuantizedMatrix) else np.ascontiguousarray(w, dtype=np.float32)

    def linear(self, keys: tuple[str, ...], layer: int | None = None, bias_keys: tuple[str, ...] | None = None):
        mats = [self.matrix(k, layer) for k in keys]
        biases = None if bias_keys is None else [self.host(k, layer) for k in bias_keys]
        if len(mats) == 1:
            return Linear(mats[0], self.dev, None if biases is None else biases[0])
        return Linear.concat(mats, self.dev, biases)


def _attention(cfg: ModelConfig, t: _Tensors, i: int, dev, scratch: Scratch) -> Attention:
    qkv = t.linear(("q_proj", "k_proj", "v_proj"), i, ("q_bias", "k_bias", "v_bias") if cfg.qkv_bias else None)
    shape = (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
    if cfg.qk_norm == "head":
        qk = HeadNormQK(*shape, t.host("q_norm", i), t.host("k_norm", i), cfg.rms_eps, dev)
    elif cfg.qk_norm == "full":
        qk = ProjectionNormQK(*shape, t.host("q_norm", i), t.host("k_norm", i), cfg.rms_eps, dev)
    else:
        qk = PlainQK(*shape)
    return Attention(qkv, qk, t.linear(("o_proj",), i), dev, scratch)


def _mlp(cfg: ModelConfig, t: _Tensors, i: int, dev, experts: ExpertRunner, moe_index: int):
    if not cfg.is_moe(i):
        return DenseMLP(t.linear(("mlp_gate", "mlp_up"), i), t.linear(("mlp_down",), i), dev)
    router = SoftmaxTopKRouter(t.linear(("router",), i), cfg.top_k, cfg.norm_topk_prob, dev)
    shared = None
    if cfg.shared_inter:
        shared = SharedExpert(t.linear(("shared_gate", "shared_up", "shared_sigmoid"), i),
                              t.linear(("shared_down",), i), dev)
    experts.load_layer(moe_index, t.weights.expert_banks(i, experts.layout))
    return MoeMLP(router, experts, moe_index, shared, dev)


class MoeDecoder:
    """Forward pass with a KV cache over ``max_len`` positions.

    ``weights``: a :class:`freetoken.models.weights.Weights` source, or ``get(hf_name)`` returning a checkpoint
    tensor (an HF checkpoint held in memory). ``experts``: the runner of the routed experts, which receives every
    MoE layer's expert records while the decoder loads."""

    def __init__(self, cfg: ModelConfig, weights: Weights | Callable[[str], np.ndarray], device,
                 experts: ExpertRunner, max_len: int = 1024, progress: bool = False):
        self.cfg, self.dev, self.xp, self.experts = cfg, device, device.xp, experts
        if not isinstance(weights, Weights):
            weights = HFWeights(cfg, weights)
        self.weights = weights
        t = _Tensors(weights, device)
        self.embed = t.host("embed")  # gathered on the host
        self.norm = t.vector("norm")
        # tied: the embedding itself (in its GGUF blocks when quantized)
        if cfg.tie_word_embeddings:
            head = weights.get_matrix("embed") if weights.quantized_kind("embed") else self.embed
        else:
            head = t.matrix("lm_head")
        self.lm_head = Linear(head, device)
        moe_index = [sum(cfg.moe_layers[:i]) for i in range(cfg.num_layers)]  # model layer -> MoE layer
        layer_iter = range(cfg.num_layers)
        if progress:
            from tqdm import tqdm

            layer_iter = tqdm(layer_iter, desc="loading layers", unit="layer", leave=False)
        self.scratch = Scratch(device)  # the blocks' work buffers, shared by every layer
        self.layers = [DecoderLayer(t.vector("attn_norm", i), _attention(cfg, t, i, device, self.scratch),
                                    t.vector("mlp_norm", i), _mlp(cfg, t, i, device, experts, moe_index[i]),
                                    cfg.rms_eps, device, self.scratch)
                       for i in layer_iter]
        self.routers = [layer.mlp.router for layer in self.layers if isinstance(layer.mlp, MoeMLP)]
        self.rope_cos, self.rope_sin = rope_tables(self.xp, np.arange(max_len), cfg.head_dim, cfg.rope_theta,
                                                   cfg.rope_scaling, cfg.max_position)
        self.kv = KVCache(self.xp, cfg.num_layers, max_len, cfg.num_kv_heads, cfg.head_dim)

    # the sequence: rows [0, length) of the KV cache hold it; max_len bounds it
    length = property(lambda self: self.kv.length, lambda self, n: setattr(self.kv, "length", int(n)))
    max_len = property(lambda self: self.kv.max_len, lambda self, n: setattr(self.kv, "max_len", int(n)))

    def reset(self) -> None:
        self.length = 0

    def route(self, moe_layer: int, h):
        """MoE layer ``moe_layer``'s routing of hidden states ``h`` (what its router block computes)."""
        return self.routers[moe_layer](h)

    def forward(self, token_ids) -> np.ndarray:
        """Append ``token_ids`` to the sequence; returns float32 logits ``[T, vocab]`` on the host."""
        cfg, xp = self.cfg, self.xp
        tokens = np.asarray(token_ids, np.int64).reshape(-1)
        if tokens.size == 0:
            return np.zeros((0, cfg.vocab_size), np.float32)
        if tokens.min() < 0 or tokens.max() >= cfg.vocab_size:
            raise ValueError(f"token ids must be in [0, {cfg.vocab_size})")
        start = self.length
        if start + tokens.size > self.max_len:
            raise ValueError(f"sequence of {start + tokens.size} tokens exceeds max_len={self.max_len}")
        with self.dev.kernel_scope():
            self.experts.begin(tokens.size)
            x = xp.asarray(self.embed[tokens])
            for layer, kv in zip(self.layers, self.kv.layers, strict=True):
                layer(x, kv, start, self.rope_cos, self.rope_sin)
            self.experts.end()
            self.length = start + tokens.size
            h = ops.rms_norm(x, self.norm, cfg.rms_eps, out=self.scratch.get("h", x.shape), device=self.dev,
                             checked=True)
            # the lm_head's output is a new array (on the cpu device to_host returns it as is): no second copy
            return self.dev.to_host(self.lm_head(h)).astype(np.float32, copy=False)
