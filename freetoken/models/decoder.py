"""The MoE decoder of the Qwen3-MoE / Qwen2-MoE / Mixtral / OLMoE families on any device.

Non-expert weights live on the device as float32; routed experts are record banks in an expert format
(``freetoken.formats``), run by :func:`freetoken.ops.moe_experts`. On gpu/emu every routed expert lives in the host
pool and goes through the expert cache: decode admits each layer's routed ids (hits, LRU misses copied in, ids
rewritten to slots); a prefill too large for one admission streams whole layers through the cache's two borrowed
buffers, copying layer m+1 while layer m computes. On cpu the Numba kernels read every layer's banks in place.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from freetoken import formats, ops
from freetoken.device.blas import single_threaded_blas
from freetoken.formats import RecordLayout
from freetoken.models.config import ModelConfig
from freetoken.models.layers import apply_rope, attention, rms_norm, rope_tables
from freetoken.models.weights import HFWeights, Weights
from freetoken.ops.moe_experts import moe_experts


class MoeDecoder:
    """Forward pass with a KV cache. ``get(name)`` returns a checkpoint tensor as a float32 NumPy array."""

    def __init__(self, cfg: ModelConfig, weights: Weights | Callable[[str], np.ndarray], device,
                 expert_format: str | None = None, max_len: int = 1024, progress: bool = False,
                 cache_slots: int | None = None, max_decode_tokens: int = 16):
        self.cfg, self.dev, self.xp = cfg, device, device.xp
        if not isinstance(weights, Weights):  # a plain ``get(hf_name)``: an HF checkpoint held in memory
            weights = HFWeights(cfg, weights)
        self.weights = weights
        up = lambda key, layer=None: device.asarray(np.ascontiguousarray(weights.get(key, layer), dtype=np.float32))
        self.embed = np.ascontiguousarray(weights.get("embed"), dtype=np.float32)  # gathered on the host
        self.norm = up("norm")
        self.lm_head = up("lm_head")
        fmt = expert_format or weights.native_expert_format or "bf16"
        self.layout = RecordLayout(formats.get(fmt), cfg.hidden, cfg.moe_inter)
        self.moe_index = [sum(cfg.moe_layers[:i]) for i in range(cfg.num_layers)]  # MoE layer -> pool layer
        n_moe = sum(cfg.moe_layers)
        self.cache = None
        if device.kind != "cpu" and n_moe:
            from freetoken.cache import ExpertCache, HostPool

            pool = HostPool(device, self.layout, n_moe, cfg.num_experts)  # filled layer by layer below
            self.cache = ExpertCache(pool, cache_slots or max(n_moe * cfg.num_experts, 2 * cfg.num_experts),
                                     max_active=min(1024, max_decode_tokens * cfg.top_k))
        self.layers = []
        layer_iter = range(cfg.num_layers)
        if progress:
            from tqdm import tqdm

            layer_iter = tqdm(layer_iter, desc="loading layers", unit="layer", leave=False)
        for i in layer_iter:
            keys = ["attn_norm", "mlp_norm", "q_proj", "k_proj", "v_proj", "o_proj"]
            keys += ["q_bias", "k_bias", "v_bias"] if cfg.qkv_bias else []
            keys += ["q_norm", "k_norm"] if cfg.qk_norm != "none" else []
            if cfg.is_moe(i):
                keys.append("router")
                keys += ["shared_gate", "shared_up", "shared_down", "shared_sigmoid"] if cfg.shared_inter else []
            else:
                keys += ["mlp_gate", "mlp_up", "mlp_down"]
            lay = {k: up(k, i) for k in keys}
            if cfg.is_moe(i):
                banks = weights.expert_banks(i, self.layout)
                if self.cache is None:
                    lay["experts"] = banks
                else:
                    self.cache.pool.write_layer(self.moe_index[i], banks)  # host pool: the authoritative copy
            self.layers.append(lay)
        self.max_len = max_len
        self.max_decode_tokens = max_decode_tokens
        shape = (max_len, cfg.num_kv_heads, cfg.head_dim)
        self.k_cache = [self.xp.zeros(shape, np.float32) for _ in range(cfg.num_layers)]
        self.v_cache = [self.xp.zeros(shape, np.float32) for _ in range(cfg.num_layers)]
        self.length = 0
        self.last_routing: list = []

    def reset(self) -> None:
        self.length = 0

    # ---- blocks -----------------------------------------------------------------------------------------------
    def _attention(self, lay, x, start):
        cfg, xp = self.cfg, self.xp
        t = x.shape[0]
        q, k, v = (x @ lay[f"{n}_proj"].T for n in "qkv")
        if cfg.qkv_bias:
            q, k, v = q + lay["q_bias"], k + lay["k_bias"], v + lay["v_bias"]
        if cfg.qk_norm == "full":
            q, k = rms_norm(xp, q, lay["q_norm"], cfg.rms_eps), rms_norm(xp, k, lay["k_norm"], cfg.rms_eps)
        q = q.reshape(t, cfg.num_heads, cfg.head_dim)
        k = k.reshape(t, cfg.num_kv_heads, cfg.head_dim)
        v = v.reshape(t, cfg.num_kv_heads, cfg.head_dim)
        if cfg.qk_norm == "head":
            q, k = rms_norm(xp, q, lay["q_norm"], cfg.rms_eps), rms_norm(xp, k, lay["k_norm"], cfg.rms_eps)
        cos, sin = rope_tables(xp, np.arange(start, start + t), cfg.head_dim, cfg.rope_theta)
        q, k = apply_rope(xp, q, cos, sin), apply_rope(xp, k, cos, sin)
        return q, k, v

    def route(self, logits):
        """Router logits [T, E] -> (expert ids int32 [T, k], weights float32 [T, k]) as the family routes."""
        xp, cfg = self.xp, self.cfg
        z = logits - logits.max(axis=-1, keepdims=True)
        probs = xp.exp(z)
        probs /= probs.sum(axis=-1, keepdims=True)
        ids, w = ops.topk(xp.ascontiguousarray(probs, dtype=np.float32), cfg.top_k, device=self.dev)
        if cfg.norm_topk_prob:
            w = w / w.sum(axis=-1, keepdims=True)
        return ids, xp.ascontiguousarray(w, dtype=np.float32)

    def _mlp(self, i, lay, h):
        cfg, xp = self.cfg, self.xp
        silu = lambda a: a / (1.0 + xp.exp(-a))
        if not cfg.is_moe(i):
            return (silu(h @ lay["mlp_gate"].T) * (h @ lay["mlp_up"].T)) @ lay["mlp_down"].T
        ids, w = self.route(h @ lay["router"].T)
        self.last_routing.append(ids)
        h = xp.ascontiguousarray(h)
        if self.cache is None:
            y = moe_experts(h, ids, w, lay["experts"], self.layout, device=self.dev)
        else:
            y = self._cached_experts(self.moe_index[i], h, ids, w)
        if cfg.shared_inter:
            s = (silu(h @ lay["shared_gate"].T) * (h @ lay["shared_up"].T)) @ lay["shared_down"].T
            y = y + s / (1.0 + xp.exp(-(h @ lay["shared_sigmoid"].T)))
        return y

    def _cached_experts(self, m: int, h, ids, w):
        """Routed experts of pool layer ``m`` through the expert cache (decode admission or prefill streaming)."""
        cache = self.cache
        if not self._streaming:
            slots = ids.copy()  # admission rewrites in place; ``ids`` stays the routing record
            cache.admit(m, slots)
            cache.copy_missing()
            return moe_experts(h, slots, w, cache.slot_banks, self.layout, device=self.dev, validate=False)
        if m + 1 < cache.num_layers:
            cache.prefetch_layer(m + 1)  # overlaps this layer's compute
        first = cache.wait_layer(m)
        y = moe_experts(h, ids + np.int32(first), w, cache.slot_banks, self.layout, device=self.dev, validate=False)
        cache.release_layer(m)
        return y

    def _attend(self, q, i: int, start: int):
        """Causal GQA of the new queries against layer ``i``'s KV cache: the decode-attention kernel on gpu/emu for
        decode-sized batches, array ops otherwise (the cpu device, and long prompts)."""
        if self.dev.kind == "cpu" or q.shape[0] > self.max_decode_tokens:
            return attention(self.xp, q, self.k_cache[i], self.v_cache[i], start)
        return ops.attention_decode(self.xp.ascontiguousarray(q), self.k_cache[i], self.v_cache[i], start,
                                    device=self.dev)

    # ---- forward ----------------------------------------------------------------------------------------------
    def forward(self, token_ids) -> np.ndarray:
        """Append ``token_ids`` to the sequence; returns float32 logits [T, vocab] on the host."""
        if self.dev.kind == "gpu":
            return self._forward(token_ids)
        with single_threaded_blas():  # the host kernels' thread pool gets the cores (see freetoken.device.blas)
            return self._forward(token_ids)

    def _forward(self, token_ids) -> np.ndarray:
        cfg, xp = self.cfg, self.xp
        tokens = np.asarray(token_ids, np.int64).reshape(-1)
        if tokens.size == 0:
            return np.zeros((0, cfg.vocab_size), np.float32)
        if ((tokens < 0) | (tokens >= cfg.vocab_size)).any():
            raise ValueError(f"token ids must be in [0, {cfg.vocab_size})")
        start = self.length
        if start + tokens.size > self.max_len:
            raise ValueError(f"sequence of {start + tokens.size} tokens exceeds max_len={self.max_len}")
        self.last_routing = []
        # A prompt whose routed pairs exceed one admission streams every MoE layer through the prefill buffers.
        self._streaming = self.cache is not None and tokens.size * cfg.top_k > self.cache.max_active
        if self._streaming:
            self.cache.begin_prefill()
            self.cache.prefetch_layer(0)
        x = xp.asarray(self.embed[tokens])
        for i, lay in enumerate(self.layers):
            h = rms_norm(xp, x, lay["attn_norm"], cfg.rms_eps)
            q, k, v = self._attention(lay, h, start)
            self.k_cache[i][start:start + tokens.size] = k
            self.v_cache[i][start:start + tokens.size] = v
            x = x + self._attend(q, i, start) @ lay["o_proj"].T
            x = x + self._mlp(i, lay, rms_norm(xp, x, lay["mlp_norm"], cfg.rms_eps))
        self.length = start + tokens.size
        logits = rms_norm(xp, x, self.norm, cfg.rms_eps) @ self.lm_head.T
        return self.dev.to_host(logits).astype(np.float32)
