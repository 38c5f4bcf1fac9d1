"""The MoE decoder of the Qwen3-MoE / Qwen2-MoE / Mixtral / OLMoE families on any device.

Non-expert matrices are :class:`freetoken.models.linear.Linear` projections (q/k/v, and a shared expert's
gate/up/sigmoid, as one matrix) held in the narrowest exact storage (bf16, f16 or float32) on every device: the
dense GEMV kernel (cuda/dense.cu) for decode on gpu/emu, multithreaded Numba kernels on cpu, as are RMSNorm, RoPE
(tables made once) and routing there. Routed
experts are record banks in an expert format (``freetoken.formats``), run by :func:`freetoken.ops.moe_experts`.
On gpu/emu every routed expert lives in the host pool and goes through the expert cache: decode admits each
layer's routed ids (hits, LRU misses copied in, ids rewritten to slots); a prefill too large for one admission
streams whole layers through the cache's two borrowed buffers, copying layer m+1 while layer m computes. On cpu
the Numba kernels read every layer's banks in place.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from freetoken import formats, ops
from freetoken.cpu_kernels.gemv import softmax_topk_rows
from freetoken.device.blas import single_threaded_blas
from freetoken.formats import RecordLayout
from freetoken.models.config import ModelConfig
from freetoken.models.layers import apply_rope, attention, rms_norm, rope_tables
from freetoken.models.linear import Linear
from freetoken.models.qmatrix import QuantizedMatrix
from freetoken.models.weights import HFWeights, Weights
from freetoken.ops.moe_experts import MoeWorkspace, moe_experts

#: Next-layer prefetch stays on for a layer while its predictions are at least this precise (after
#: PREFETCH_MIN_SAMPLES predicted experts): below it the wasted copies and evictions outweigh the hits.
PREFETCH_MIN_PRECISION = 0.3
PREFETCH_MIN_SAMPLES = 64


def _matrix(w):
    """A dense projection's matrix as Linear takes it: a QuantizedMatrix as is, else float32 C-contiguous."""
    return w if isinstance(w, QuantizedMatrix) else np.ascontiguousarray(w, dtype=np.float32)


class MoeDecoder:
    """Forward pass with a KV cache. ``get(name)`` returns a checkpoint tensor as a float32 NumPy array."""

    def __init__(self, cfg: ModelConfig, weights: Weights | Callable[[str], np.ndarray], device,
                 expert_format: str | None = None, max_len: int = 1024, progress: bool = False,
                 cache_slots: int | None = None, max_decode_tokens: int = 16, moe_mode: str = "gpu",
                 oracle=None, future_value: float = 0.0, prefetch: bool = False):
        self.cfg, self.dev, self.xp = cfg, device, device.xp
        if not isinstance(weights, Weights):  # a plain ``get(hf_name)``: an HF checkpoint held in memory
            weights = HFWeights(cfg, weights)
        self.weights = weights
        up = lambda key, layer=None: device.asarray(np.ascontiguousarray(weights.get(key, layer), dtype=np.float32))
        host = lambda key, layer=None: np.ascontiguousarray(weights.get(key, layer), dtype=np.float32)
        # dense projections: a QuantizedMatrix (GGUF Q8_0 / Q4_0 blocks) or float32, as Linear takes them
        mat = lambda key, layer=None: _matrix(weights.get_matrix(key, layer))
        self.embed = host("embed")  # gathered on the host (dequantized)
        self.norm = up("norm")
        # tied (what both weight sources return for "lm_head" then): a cpu Linear kept in float32 shares the array;
        # a quantized embedding (GGUF Q8_0 / Q4_0) is multiplied in its blocks
        if cfg.tie_word_embeddings:
            head = weights.get_matrix("embed") if weights.quantized_kind("embed") else self.embed
        else:
            head = mat("lm_head")
        self.lm_head = Linear(head, device)
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
        self._init_policy(moe_mode, oracle, future_value, prefetch)
        self.layers = []
        layer_iter = range(cfg.num_layers)
        if progress:
            from tqdm import tqdm

            layer_iter = tqdm(layer_iter, desc="loading layers", unit="layer", leave=False)
        for i in layer_iter:
            lay = self._load_layer(i, up, host, mat)
            if cfg.is_moe(i):
                banks = weights.expert_banks(i, self.layout)
                if self.cache is None:
                    lay["experts"] = banks
                else:
                    self.cache.pool.write_layer(self.moe_index[i], banks)  # host pool: the authoritative copy
            self.layers.append(lay)
        self.max_len = max_len
        self.max_decode_tokens = max_decode_tokens
        self.rope_cos, self.rope_sin = rope_tables(self.xp, np.arange(max_len), cfg.head_dim, cfg.rope_theta,
                                                   cfg.rope_scaling, cfg.max_position)
        shape = (max_len, cfg.num_kv_heads, cfg.head_dim)
        self.k_cache = [self.xp.zeros(shape, np.float32) for _ in range(cfg.num_layers)]
        self.v_cache = [self.xp.zeros(shape, np.float32) for _ in range(cfg.num_layers)]
        self.length = 0
        self.last_routing: list = []

    def _load_layer(self, i: int, up, host, mat) -> dict:
        """Layer ``i``'s non-expert weights: norms and biases as device arrays, matrices as :class:`Linear`."""
        cfg, dev = self.cfg, self.dev
        lay = {k: up(k, i) for k in ("attn_norm", "mlp_norm")}
        lay["qkv"] = Linear.concat([mat(f"{n}_proj", i) for n in "qkv"], dev,
                                   [host(f"{n}_bias", i) for n in "qkv"] if cfg.qkv_bias else None)
        lay["o_proj"] = Linear(mat("o_proj", i), dev)
        if cfg.qk_norm == "full":
            lay["q_norm"], lay["k_norm"] = up("q_norm", i), up("k_norm", i)
        elif cfg.qk_norm == "head":  # q and k heads normed (and rotated) as one [T, H + Hkv, D] array
            qn, kn = host("q_norm", i).reshape(-1), host("k_norm", i).reshape(-1)
            lay["qk_norm"] = dev.asarray(np.concatenate([np.tile(qn, (cfg.num_heads, 1)),
                                                         np.tile(kn, (cfg.num_kv_heads, 1))]))
        if cfg.is_moe(i):
            lay["router"] = Linear(mat("router", i), dev)
            if cfg.shared_inter:  # gate, up and the sigmoid gate all read h: one matrix
                lay["shared_in"] = Linear.concat([mat(k, i) for k in ("shared_gate", "shared_up", "shared_sigmoid")],
                                                 dev)
                lay["shared_down"] = Linear(mat("shared_down", i), dev)
        else:
            lay["mlp_in"] = Linear.concat([mat("mlp_gate", i), mat("mlp_up", i)], dev)
            lay["mlp_down"] = Linear(mat("mlp_down", i), dev)
        return lay

    def reset(self) -> None:
        self.length = 0

    # ---- blocks -----------------------------------------------------------------------------------------------
    def _attention(self, lay, x, start):
        cfg, xp = self.cfg, self.xp
        t, heads, kv_heads, dim = x.shape[0], cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        qkv = lay["qkv"](x)  # [T, (H + 2 Hkv) D], biases included
        if cfg.qk_norm == "full":
            q, k, v = lay["qkv"].split(qkv)
            q, k = rms_norm(xp, q, lay["q_norm"], cfg.rms_eps), rms_norm(xp, k, lay["k_norm"], cfg.rms_eps)
            qk = xp.concatenate([q, k], axis=-1).reshape(t, heads + kv_heads, dim)
            v = v.reshape(t, kv_heads, dim)
        else:
            qkv = qkv.reshape(t, heads + 2 * kv_heads, dim)
            qk, v = qkv[:, :heads + kv_heads], qkv[:, heads + kv_heads:]
            if cfg.qk_norm == "head":
                qk = rms_norm(xp, qk, lay["qk_norm"], cfg.rms_eps)
        qk = apply_rope(xp, qk, self.rope_cos[start:start + t], self.rope_sin[start:start + t])
        return qk[:, :heads], qk[:, heads:], v

    def route(self, logits):
        """Router logits [T, E] -> (expert ids int32 [T, k], weights float32 [T, k]) as the family routes."""
        xp, cfg = self.xp, self.cfg
        if self.dev.kind == "cpu" and 1 <= cfg.top_k <= logits.shape[-1]:  # softmax, top-k, renorm: one Numba call
            logits = np.ascontiguousarray(logits, dtype=np.float32)
            ids = np.empty((logits.shape[0], cfg.top_k), np.int32)
            w = np.empty((logits.shape[0], cfg.top_k), np.float32)
            softmax_topk_rows(logits, cfg.top_k, cfg.norm_topk_prob, ids, w)
            return ids, w
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
            g, u = lay["mlp_in"].split(lay["mlp_in"](h))
            return lay["mlp_down"](silu(g) * u)
        ids, w = self.route(lay["router"](h))
        self.last_routing.append(ids)
        h = xp.ascontiguousarray(h)
        if self.cache is None:
            y = moe_experts(h, ids, w, lay["experts"], self.layout, device=self.dev, validate=False)  # ids: top-k
        else:
            y = self._cached_experts(self.moe_index[i], h, ids, w)
        if cfg.shared_inter:
            g, u, sg = lay["shared_in"].split(lay["shared_in"](h))
            y = y + lay["shared_down"](silu(g) * u) / (1.0 + xp.exp(-sg))
        return y

    def _cached_experts(self, m: int, h, ids, w):
        """Routed experts of pool layer ``m`` through the expert cache (decode admission or prefill streaming)."""
        cache = self.cache
        if not self._streaming:
            self._score_prediction(m, ids)
            if self.executor is not None:  # misses split between PCIe and the CPU (--moe-mode cpu/hybrid)
                return self.executor.run(m, h, ids, w, before_admit=self._wait_prefetch,
                                         after_admit=self._prefetch_next)
            slots = ids.copy()  # admission rewrites in place; ``ids`` stays the routing record
            self._wait_prefetch()
            cache.admit(m, slots)
            cache.copy_missing()
            self._prefetch_next(m, h)
            return moe_experts(h, slots, w, cache.slot_banks, self.layout, device=self.dev, validate=False,
                               workspace=self.workspace)
        if m + 1 < cache.num_layers:
            cache.prefetch_layer(m + 1)  # overlaps this layer's compute
        first = cache.wait_layer(m)
        y = moe_experts(h, ids + np.int32(first), w, cache.slot_banks, self.layout, device=self.dev, validate=False)
        cache.release_layer(m)
        return y

    # ---- miss policy: the q* executor, next-layer prefetch ---------------------------------------------------
    def _init_policy(self, moe_mode: str, oracle, future_value: float, prefetch: bool) -> None:
        self.executor, self.policy_note, self.workspace = None, "", None
        if self.cache is None:  # the cpu device: every expert runs on the CPU from host memory
            self.moe_mode = "cpu"
        else:
            from freetoken.policy.runtime import resolve_mode

            moe_mode, oracle, self.policy_note = resolve_mode(moe_mode, self.dev, self.layout.fmt.name, oracle)
            self.moe_mode = moe_mode
            # decode's plan and expert buffers, allocated once over the slot banks (see ops.moe_experts)
            self.workspace = MoeWorkspace(self.dev, self.layout, self.cache.slot_banks, self.cache.max_active)
            if moe_mode != "gpu":
                from freetoken.policy.hybrid import MoeExecutor

                self.executor = MoeExecutor(self.cache, self.layout, moe_mode, oracle, future_value,
                                            workspace=self.workspace)
        self.prefetch = bool(prefetch) and self.cache is not None
        self.prefetch_stats = {"predicted": 0, "correct": 0, "actual": 0}
        n_pool = self.cache.num_layers if self.cache is not None else 0
        self._prefetch_layer_stats = np.zeros((n_pool, 2), np.int64)  # per target layer: predicted, correct
        self.prefetch_off: list[int] = []  # target layers whose prediction did not pay (PREFETCH_MIN_PRECISION)
        self._predicted: dict[int, np.ndarray] = {}
        self._prefetch_event = None
        self._moe_layer_of_pool = [i for i in range(self.cfg.num_layers) if self.cfg.is_moe(i)]

    def _prefetch_next(self, m: int, h) -> None:
        """After pool layer ``m``'s admission: predict layer m+1's experts by applying its router to ``h`` (this
        layer's MLP input) and copy them in on the transfer stream while this layer computes. A prefetch admission
        is not counted in the cache's hit/miss statistics."""
        if not self.prefetch or m + 1 >= self.cache.num_layers or (m + 1) in self.prefetch_off:
            return
        nxt = self._moe_layer_of_pool[m + 1]
        pred, _ = self.route(self.layers[nxt]["router"](h))
        self._predicted[m + 1] = np.array(self.dev.to_host(pred))  # a copy: admission rewrites ids in place
        slots = pred.astype(np.int32, copy=True)
        cache = self.cache
        cache.admit(m + 1, slots, count=False)
        cache.copy_missing(stream=cache.transfer)
        self._prefetch_event = self.dev.event().record(cache.transfer)

    def _wait_prefetch(self) -> None:
        if self._prefetch_event is not None:
            self.dev.wait_event(self._prefetch_event, None)  # the prefetched slots are complete before use
            self._prefetch_event = None

    def _score_prediction(self, m: int, ids) -> None:
        """Precision/recall of the next-layer predictor: predicted vs routed experts of pool layer ``m``."""
        pred = self._predicted.pop(m, None)
        if pred is None:
            return
        actual = np.asarray(self.dev.to_host(ids))
        for p_row, a_row in zip(pred, actual, strict=True):
            ps, a_set = set(p_row.tolist()), set(a_row.tolist())
            self.prefetch_stats["predicted"] += len(ps)
            self.prefetch_stats["actual"] += len(a_set)
            self.prefetch_stats["correct"] += len(ps & a_set)
            self._prefetch_layer_stats[m] += (len(ps), len(ps & a_set))
        # keep prefetching a layer only where it pays: a wrong prediction spends PCIe time and evicts a resident
        # expert, so a layer whose precision stays below PREFETCH_MIN_PRECISION is no longer prefetched
        predicted, correct = self._prefetch_layer_stats[m]
        if predicted >= PREFETCH_MIN_SAMPLES and correct < PREFETCH_MIN_PRECISION * predicted:
            self.prefetch_off.append(m)

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
        self._predicted.clear()  # predictions never cross a forward call
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
            x += lay["o_proj"](self._attend(q, i, start))
            x += self._mlp(i, lay, rms_norm(xp, x, lay["mlp_norm"], cfg.rms_eps))
        self.length = start + tokens.size
        logits = self.lm_head(rms_norm(xp, x, self.norm, cfg.rms_eps))
        return self.dev.to_host(logits).astype(np.float32)
