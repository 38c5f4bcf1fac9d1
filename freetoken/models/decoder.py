"""The MoE decoder of the Qwen3-MoE, Qwen2-MoE, Mixtral, OLMoE, GLM-4.5, gpt-oss, DeepSeek-V2/V3, Qwen3-Next and
Qwen3.5-MoE families: embedding, layers, final norm, LM head.

A layer's token mixer is attention over the paged KV cache, or (Qwen3-Next / Qwen3.5) Gated DeltaNet over a
recurrent state: the pool holds KV rows for the attention layers only, and each sequence
(:class:`freetoken.models.sequence.DecoderSequence`) holds the linear layers' states with snapshots of them at the end
of each prompt and every :data:`STATE_SNAPSHOT_EVERY` tokens of a long one, since a recurrent state cannot be cut back
to an earlier length the way a KV cache can (:meth:`MoeDecoder.resume_points`).

Each layer's blocks (:mod:`freetoken.models.blocks`) are picked from the config once, here, at load time; a forward
pass then reads top to bottom (:meth:`MoeDecoder._pass`), over one sequence (:meth:`MoeDecoder.forward`, the
decoder's current sequence) or several at once (:meth:`MoeDecoder.forward_batch`: every token-wise step over all
their tokens, attention per sequence). Dense projections are :class:`Linear` matrices held in
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
    GatedDeltaNet,
    HeadNormQK,
    LatentAttention,
    LinearState,
    MoeMLP,
    PassBatch,
    PlainQK,
    ProjectionNormQK,
    SharedExpert,
    SigmoidGroupRouter,
    SoftmaxGroupRouter,
    SoftmaxTopKRouter,
    Span,
)
from freetoken.models.config import ModelConfig
from freetoken.models.embedding import BlockEmbedding
from freetoken.models.experts import ExpertRunner
from freetoken.models.kv import KVPool, KVSequence
from freetoken.models.linear import Linear
from freetoken.models.qmatrix import QuantizedMatrix
from freetoken.models.rope import partial_rotary_order, query_temperature, rope_tables
from freetoken.models.scratch import Scratch
from freetoken.models.sequence import DecoderSequence, StateSlots
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


def _head_rows(w, width: int, order: np.ndarray):
    """The rows of a projection (or its bias, or a per-head weight) made of heads of ``width`` rows, each head's rows
    reordered (``new[j] = old[order[j]]``); a q8_0/q4_0 matrix moves whole block rows (exact)."""
    rows = (np.arange(w.shape[0] // width)[:, None] * width + order[None, :]).reshape(-1)
    return w.rows(rows) if isinstance(w, QuantizedMatrix) else np.ascontiguousarray(w[rows])


def _rotary_rows(cfg: ModelConfig, w):
    """Partial rotary (``cfg.rotary_dim``): q or k rows with each head's dimensions in :func:`partial_rotary_order`,
    which the RoPE tables expect; as they are when every dimension rotates."""
    if cfg.rope_dim == cfg.head_dim:
        return w
    return _head_rows(w, cfg.head_dim, partial_rotary_order(cfg.head_dim, cfg.rope_dim))


def _rope_deinterleaved(width: int, rope: int) -> np.ndarray:
    """The reorder of a head of ``width`` dims ending in ``rope`` interleaved-pair rope dims (DeepSeek's layout: pair
    j at 2j, 2j + 1) that puts them in rotate-half's order (pair j at j, j + rope / 2). Applied to the query's and
    the shared key's rope rows alike, it leaves every q.k product unchanged."""
    order = np.arange(width)
    order[width - rope:] = width - rope + np.concatenate([np.arange(0, rope, 2), np.arange(1, rope, 2)])
    return order


def _latent_attention(cfg: ModelConfig, t: _Tensors, i: int, dev, scratch: Scratch) -> LatentAttention:
    rank, rope, head = cfg.kv_lora_rank, cfg.qk_rope_dim, cfg.head_dim

    def rope_rows(key: str, width: int):
        w = t.matrix(key, i)  # a block-FP8 matrix stays in its rows (each row carries its scales: rows move exactly)
        return _head_rows(w, width, _rope_deinterleaved(width, rope)) if cfg.rope_interleave else w

    kv_a = rope_rows("kv_a_proj", rank + rope)
    if cfg.q_lora_rank:
        q = (t.linear(("q_a_proj",), i), t.host("q_a_norm", i), Linear(rope_rows("q_b_proj", head), dev))
    else:
        q = Linear(rope_rows("q_proj", head), dev)
    return LatentAttention(q, Linear(kv_a, dev), t.host("kv_a_norm", i), t.matrix("kv_b_proj", i),
                           t.linear(("o_proj",), i), cfg.num_heads, cfg.qk_nope_dim, rope, rank, cfg.v_head_dim,
                           cfg.rms_eps, cfg.attention_scale, dev, scratch)


def _linear_attention(cfg: ModelConfig, t: _Tensors, i: int, dev, scratch: Scratch) -> GatedDeltaNet:
    return GatedDeltaNet(t.linear(("lin_qkv", "lin_z", "lin_b", "lin_a"), i), t.host("lin_conv", i),
                         t.host("lin_ssm_a", i), t.host("lin_dt_bias", i), t.host("lin_norm", i),
                         t.linear(("lin_out",), i), cfg.linear_k_heads, cfg.linear_v_heads, cfg.linear_k_dim,
                         cfg.linear_v_dim, cfg.rms_eps, dev, scratch)


def _gated_query(cfg: ModelConfig, t: _Tensors, i: int):
    """(query rows, output-gate rows) of a q projection that carries the gate (Qwen3-Next / Qwen3.5: each head's
    ``head_dim`` query rows followed by its ``head_dim`` gate rows); the query rows in RoPE's order."""
    w, d = t.matrix("q_proj", i), cfg.head_dim
    q, g = (_head_rows(w, 2 * d, first + np.arange(d)) for first in (0, d))  # each head's first / second half
    return _rotary_rows(cfg, q), g


def _attention(cfg: ModelConfig, t: _Tensors, i: int, dev, scratch: Scratch) -> Attention:
    if cfg.is_linear(i):
        return _linear_attention(cfg, t, i, dev, scratch)
    if cfg.mla:
        return _latent_attention(cfg, t, i, dev, scratch)
    out_gate = None
    if cfg.attn_output_gate:
        q, g = _gated_query(cfg, t, i)
        out_gate = Linear(g, dev)
        mats = [q, _rotary_rows(cfg, t.matrix("k_proj", i)), t.matrix("v_proj", i)]
        qkv = Linear.concat(mats, dev)
    elif cfg.rope_dim < cfg.head_dim:
        mats = [_rotary_rows(cfg, t.matrix(k, i)) for k in ("q_proj", "k_proj")] + [t.matrix("v_proj", i)]
        biases = [_rotary_rows(cfg, t.host(k, i)) for k in ("q_bias", "k_bias")] + [t.host("v_bias", i)] \
            if cfg.qkv_bias else None
        qkv = Linear.concat(mats, dev, biases)
    else:
        qkv = t.linear(("q_proj", "k_proj", "v_proj"), i, ("q_bias", "k_bias", "v_bias") if cfg.qkv_bias else None)
    shape = (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
    if cfg.qk_norm == "head":
        qk = HeadNormQK(*shape, _rotary_rows(cfg, t.host("q_norm", i)), _rotary_rows(cfg, t.host("k_norm", i)),
                        cfg.rms_eps, dev)
    elif cfg.qk_norm == "full":
        # (the RMS over a whole projection ignores the order of its dims; each weight moves with its dim)
        qk = ProjectionNormQK(*shape, _rotary_rows(cfg, t.host("q_norm", i)), _rotary_rows(cfg, t.host("k_norm", i)),
                              cfg.rms_eps, dev)
    else:
        qk = PlainQK(*shape)
    sinks = t.host("attn_sinks", i) if cfg.attention_sinks else None
    o_proj = t.linear(("o_proj",), i, ("o_bias",) if cfg.o_bias else None)
    return Attention(qkv, qk, o_proj, dev, scratch, window=cfg.window(i), sinks=sinks, out_gate=out_gate)


def _mlp(cfg: ModelConfig, t: _Tensors, i: int, dev, experts: ExpertRunner, moe_index: int):
    if not cfg.is_moe(i):
        return DenseMLP(t.linear(("mlp_gate", "mlp_up"), i), t.linear(("mlp_down",), i), dev)
    if cfg.router == "softmax_group":
        router = SoftmaxGroupRouter(t.linear(("router",), i), cfg.top_k, cfg.n_group, cfg.topk_group,
                                    cfg.norm_topk_prob, cfg.routed_scale, dev)
    elif cfg.router == "sigmoid_group":
        router = SigmoidGroupRouter(t.linear(("router",), i), t.host("router_bias", i), cfg.top_k, cfg.n_group,
                                    cfg.topk_group, cfg.norm_topk_prob, cfg.routed_scale, dev)
    else:
        gate = t.linear(("router",), i, ("router_logit_bias",) if cfg.router_logit_bias else None)
        router = SoftmaxTopKRouter(gate, cfg.top_k, cfg.norm_topk_prob, dev)
    shared = None
    if cfg.shared_inter:
        inp = ("shared_gate", "shared_up", "shared_sigmoid") if cfg.shared_gated else ("shared_gate", "shared_up")
        shared = SharedExpert(t.linear(inp, i), t.linear(("shared_down",), i), dev, gated=cfg.shared_gated)
    parts = experts.parts[moe_index]
    if not experts.reads_own_experts:  # (a host tier reads the records from the file when a step needs them)
        for g, (layout, ids) in enumerate(zip(parts.layouts, parts.experts, strict=True)):
            target = experts.load_target(moe_index, g) if getattr(t.weights, "fills_in_place", False) else None
            if target is not None:  # an FTW file's records copied straight into the runner's host arrays
                t.weights.expert_banks(i, layout, ids, out=target)
            elif not parts.mixed:
                experts.load_layer(moe_index, t.weights.expert_banks(i, layout))
            else:  # an FTW layer whose experts are in several formats: each part's records in its own layout
                experts.load_layer(moe_index, t.weights.expert_banks(i, layout, ids), part=g)
    return MoeMLP(router, experts, moe_index, shared, dev)


#: Prompt tokens per forward chunk unless the decoder is told otherwise (:meth:`MoeDecoder.set_context`).
DEFAULT_PREFILL_CHUNK = 1024
#: Snapshots of the linear-attention states a decoder keeps by default (:meth:`MoeDecoder.snapshot`): one is taken
#: at the end of every prompt, at the message boundaries generation is given and every :data:`STATE_SNAPSHOT_EVERY`
#: tokens of a long prompt, so the last few turns of a conversation can be resumed. Qwen3.5-35B-A3B's 30 linear
#: layers hold 63 MiB of state per snapshot.
MAX_STATE_SNAPSHOTS = 4
#: A long prompt also leaves a snapshot at the first chunk end at or past every multiple of this many tokens (so a
#: later prompt that departs from it midway resumes near there); these periodic ones are dropped before the others.
STATE_SNAPSHOT_EVERY = 4096


class ContextExceeded(ValueError):
    """A forward pass would take the sequence past the context it was given."""


class MoeDecoder:
    """Forward passes over sequences in a paged KV cache: the current one (:attr:`seq`, what :meth:`forward` and the
    single-sequence methods act on) or several at once (:meth:`forward_batch` over :meth:`new_sequence`'s).

    ``weights``: a :class:`freetoken.models.weights.Weights` source, or ``get(hf_name)`` returning a checkpoint
    tensor (an HF checkpoint held in memory). ``experts``: the runner of the routed experts, which receives every
    MoE layer's expert records while the decoder loads. :meth:`set_context` gives it the KV pool and the context
    length before the first forward pass (the engine sizes the pool after the weights, from what memory is left)."""

    def __init__(self, cfg: ModelConfig, weights: Weights | Callable[[str], np.ndarray], device,
                 experts: ExpertRunner, progress: bool = False):
        self.cfg, self.dev, self.xp, self.experts = cfg, device, device.xp, experts
        if not isinstance(weights, Weights):
            weights = HFWeights(cfg, weights)
        self.weights = weights
        t = _Tensors(weights, device)
        # gathered on the host: in its stored blocks when the file has it in a block type Linear runs (rows
        # dequantized per lookup), else float32
        stored = weights.get_matrix("embed") if weights.quantized_kind("embed") else None
        self.embed = BlockEmbedding(stored) if stored is not None else t.host("embed")
        self.norm = t.vector("norm")
        # tied: the embedding itself (the same blocks when quantized)
        if cfg.tie_word_embeddings:
            head = stored if stored is not None else self.embed
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
        self.pool: KVPool | None = None
        self.max_ctx = 0
        self.seq: DecoderSequence | None = None  # the sequence forward() appends to
        self.prefill_chunk = DEFAULT_PREFILL_CHUNK
        # Gated DeltaNet layers carry a sequence in a state instead of KV rows: each DecoderSequence holds a slot of
        # their state pools
        self.state_slots = StateSlots([layer.attention for layer in self.layers], device)
        self.recurrent = bool(self.state_slots.shapes)
        self.paged_layers = any(isinstance(layer.attention, (Attention, LatentAttention)) for layer in self.layers)
        self.max_snapshots = MAX_STATE_SNAPSHOTS
        self.snapshot_every = STATE_SNAPSHOT_EVERY

    def set_context(self, pool: KVPool, ctx: int, prefill_chunk: int = DEFAULT_PREFILL_CHUNK) -> None:
        """Hold sequences in ``pool`` (made for this model's layers and kv heads), up to ``ctx`` tokens each, and run
        prompts in forward chunks of ``prefill_chunk`` tokens. Forgets the current sequence and makes a new one."""
        cfg = self.cfg
        want = (len(cfg.kv_layers), cfg.kv_cache_heads, cfg.kv_cache_dim, cfg.kv_cache_values)
        if (pool.num_layers, pool.kv_heads, pool.head_dim, pool.values) != want:
            raise ValueError(f"a KV pool of {pool.num_layers} layers x {pool.kv_heads} heads x {pool.head_dim} "
                             f"(values: {pool.values}) does not fit this model ({want[0]} x {want[1]} x {want[2]}, "
                             f"values: {want[3]})")
        if not 1 <= ctx <= pool.tokens:
            raise ValueError(f"a context of {ctx} tokens does not fit the KV pool of {pool.tokens} tokens")
        if prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be >= 1, got {prefill_chunk}")
        if self.seq is not None:
            self.seq.reset()
        self.pool, self.max_ctx = pool, int(ctx)
        self.seq = self.new_sequence()
        self.prefill_chunk = int(prefill_chunk)
        if cfg.mla:  # the rope part of a latent-attention head is rotated whole
            self.rope_cos, self.rope_sin = rope_tables(self.xp, np.arange(ctx), cfg.qk_rope_dim, cfg.rope_theta,
                                                       cfg.rope_scaling, cfg.max_position)
        else:
            self.rope_cos, self.rope_sin = rope_tables(self.xp, np.arange(ctx), cfg.head_dim, cfg.rope_theta,
                                                       cfg.rope_scaling, cfg.max_position, cfg.rope_dim)
        self.query_scale = None  # Llama 4's attention temperature, when the model has it
        if cfg.attn_temperature_scale > 0:
            self.query_scale = self.xp.asarray(query_temperature(np.arange(ctx), cfg.attn_temperature_floor,
                                                                 cfg.attn_temperature_scale))

    def new_sequence(self, ctx: int | None = None) -> DecoderSequence:
        """An empty sequence of up to ``ctx`` tokens (default and at most: :meth:`set_context`'s) in the decoder's
        pool, for :meth:`forward_batch`; it holds blocks only once tokens are appended."""
        if self.pool is None:
            raise RuntimeError("the decoder has no KV pool yet: call set_context(pool, ctx) first")
        ctx = self.max_ctx if ctx is None else int(ctx)
        if not 1 <= ctx <= self.max_ctx:
            raise ValueError(f"a sequence of {ctx} tokens: the decoder's context is {self.max_ctx}")
        return DecoderSequence([layer.attention for layer in self.layers], self.cfg.kv_layers, self.pool, ctx, self.dev,
                               self.state_slots)

    def _sequence(self) -> DecoderSequence:
        if self.seq is None:
            raise RuntimeError("the decoder has no KV cache yet: call set_context(pool, ctx) first")
        return self.seq

    @property
    def kv(self) -> KVSequence | None:
        """The current sequence's KV rows (None before :meth:`set_context`)."""
        return None if self.seq is None else self.seq.kv

    @property
    def states(self) -> list[LinearState | None]:
        """The current sequence's live linear-attention states, one entry per layer (None for attention layers)."""
        return self._sequence().states

    @property
    def ctx(self) -> int:
        """The most tokens (prompt and generated) the sequence may hold."""
        return self._sequence().capacity

    @property
    def length(self) -> int:
        """Tokens of the sequence in the KV cache (positions ``0 .. length - 1``)."""
        return 0 if self.seq is None else self.seq.length

    @length.setter
    def length(self, n: int) -> None:
        """Roll the sequence back to its first ``n`` tokens (:attr:`DecoderSequence.length`)."""
        self._sequence().length = n

    def resume_points(self) -> list[int]:
        """The lengths the current sequence can be rolled back to without recomputing
        (:meth:`DecoderSequence.resume_points`)."""
        return [0] if self.seq is None else self.seq.resume_points()

    def snapshot(self, periodic: bool = False) -> None:
        """Keep a copy of the current sequence's linear-attention states at its length, up to :attr:`max_snapshots`
        (:meth:`DecoderSequence.snapshot`). Each costs :meth:`state_bytes`."""
        self._sequence().snapshot(self.max_snapshots, periodic)

    def export_states(self, length: int | None = None) -> dict[str, np.ndarray]:
        """:meth:`DecoderSequence.export_states` of the current sequence."""
        return self._sequence().export_states(length)

    def import_states(self, arrays: dict[str, np.ndarray]) -> None:
        """:meth:`DecoderSequence.import_states` into the current sequence."""
        self._sequence().import_states(arrays)

    @property
    def kept_snapshots(self) -> int:
        """How many snapshots of the linear-attention states the current sequence holds."""
        return 0 if self.seq is None else self.seq.kept_snapshots

    def state_bytes(self) -> int:
        """Bytes of one sequence's linear-attention states (the live ones; each snapshot costs as much)."""
        return sum(layer.attention.state_nbytes for layer in self.layers
                   if isinstance(layer.attention, GatedDeltaNet))

    def reset(self) -> None:
        """Forget the current sequence (its KV blocks, the linear-attention states and their snapshots)."""
        if self.seq is not None:
            self.seq.reset()

    @property
    def head_is_embedding(self) -> bool:
        """Whether the lm_head reads the embedding table's own memory (a tied head on the cpu device whose matrix
        was not copied: a float32 table NumPy placed in huge pages), so its bytes are counted once. On gpu/emu the
        head is a device copy."""
        table = self.embed.matrix.blocks if isinstance(self.embed, BlockEmbedding) else self.embed
        return self.dev.kind == "cpu" and self.lm_head.holds(table)

    def weight_bytes(self) -> dict[str, int]:
        """Bytes of the non-expert weights: the embedding table on the host, the rest on the device."""
        dense = 0 if self.head_is_embedding else self.lm_head.nbytes
        dense += int(self.norm.nbytes)
        for layer in self.layers:
            att, mlp = layer.attention, layer.mlp
            dense += int(layer.attn_norm.nbytes) + int(layer.mlp_norm.nbytes) + att.nbytes
            if isinstance(mlp, MoeMLP):
                dense += mlp.router.gate.nbytes + int(getattr(mlp.router, "bias", np.zeros(0)).nbytes)
                if mlp.shared is not None:
                    dense += mlp.shared.inp.nbytes + mlp.shared.down.nbytes
            else:
                dense += mlp.gate_up.nbytes + mlp.down.nbytes
        return {"embedding (host)": int(self.embed.nbytes), "dense weights": dense}

    def route(self, moe_layer: int, h):
        """MoE layer ``moe_layer``'s routing of hidden states ``h`` (what its router block computes)."""
        return self.routers[moe_layer](h)

    def _check_tokens(self, token_ids) -> np.ndarray:
        tokens = np.asarray(token_ids, np.int64).reshape(-1)
        if tokens.size and (tokens.min() < 0 or tokens.max() >= self.cfg.vocab_size):
            raise ValueError(f"token ids must be in [0, {self.cfg.vocab_size})")
        return tokens

    def _pass(self, work: list[tuple[DecoderSequence, np.ndarray]], first: bool, heads: str):
        """One forward pass over ``work``'s tokens, each item's appended to its sequence (blocks prepared by the
        caller). ``heads``: "all" (logits of every row), "last" (each item's last row), "none". Returns the host
        float32 logits ``[rows, vocab]`` or None."""
        cfg, xp, dev = self.cfg, self.xp, self.dev
        counts = [len(toks) for _, toks in work]
        bounds = np.concatenate([[0], np.cumsum(counts)]).astype(int)
        starts = [seq.length for seq, _ in work]
        self.experts.begin(int(bounds[-1]), first=first)
        tokens = work[0][1] if len(work) == 1 else np.concatenate([toks for _, toks in work])
        x = xp.asarray(self.embed[tokens])
        if len(work) == 1:  # one sequence: its rows of the tables, as slices
            s0, s1 = starts[0], starts[0] + counts[0]
            cos, sin = self.rope_cos[s0:s1], self.rope_sin[s0:s1]
            q_scale = None if self.query_scale is None else self.query_scale[s0:s1]
        else:  # several: each row's position gathered
            pos = xp.asarray(np.concatenate([np.arange(s, s + n) for s, n in zip(starts, counts, strict=True)]))
            cos, sin = self.rope_cos[pos], self.rope_sin[pos]
            q_scale = None if self.query_scale is None else self.query_scale[pos]
        batch = None
        if len(work) > 1:  # made once, shared by every layer
            states = ops.StateBatch([seq.slot for seq, _ in work], counts, device=dev) if self.recurrent else None
            batch = PassBatch(self._paged_batch(work, starts, counts), states)
        for i, layer in enumerate(self.layers):
            spans = [Span(seq.layer_kv[i], start, int(lo), int(hi))
                     for (seq, _), start, lo, hi in zip(work, starts, bounds[:-1], bounds[1:], strict=True)]
            layer(x, spans, cos, sin, q_scale, batch)
        self.experts.end()
        for (seq, _), start, n in zip(work, starts, counts, strict=True):
            seq.kv.length = start + n
        if heads == "none":
            return None
        h = x if heads == "all" else x[xp.asarray(bounds[1:] - 1)] if len(work) > 1 else x[-1:]
        h = ops.rms_norm(h, self.norm, cfg.rms_eps, out=self.scratch.get("h", h.shape), device=dev, checked=True)
        # the lm_head's output is a new array (on the cpu device to_host returns it as is): no second copy
        return dev.to_host(self.lm_head(h)).astype(np.float32, copy=False)

    def _paged_batch(self, work, starts: list[int], counts: list[int]):
        """The block tables of a pass over several sequences as one :class:`freetoken.ops.PagedBatch` (made once,
        shared by every attention layer), or None when no layer keeps a paged KV cache of its own."""
        if not self.paged_layers:
            return None
        bs = self.pool.block_size
        width = max(-(-(s + n) // bs) for s, n in zip(starts, counts, strict=True))
        tables = np.zeros((len(work), width), np.int32)
        for row, (seq, _) in enumerate(work):
            held = seq.kv.host_table[:width]
            tables[row, :held.size] = held
        return ops.PagedBatch(tables, starts, counts, device=self.dev)

    def forward_batch(self, work: list[tuple[DecoderSequence, object]]) -> np.ndarray:
        """One forward pass over several sequences: each ``(sequence, token_ids)`` item's tokens appended to its
        sequence (made by :meth:`new_sequence`; at most one item per sequence). Every token-wise step (projections,
        norms, routing, the routed experts: one expert read serves every sequence) runs over all the items' tokens at
        once; attention and the linear-attention recurrences run per sequence. Returns float32 logits
        ``[len(work), vocab]`` on the host: each item's last token's. No snapshot of linear-attention states is
        taken (the caller's :meth:`DecoderSequence.snapshot`). Raises :class:`ContextExceeded` (before any work)
        when an item does not fit its sequence, and lets the pool's allocation error through when blocks run short
        (items prepared before it keep their new blocks)."""
        items = [(seq, self._check_tokens(toks)) for seq, toks in work]
        if not items or any(t.size == 0 for _, t in items):
            raise ValueError("forward_batch needs at least one item, each with at least one token")
        if len({id(seq) for seq, _ in items}) != len(items):
            raise ValueError("forward_batch: a sequence appears in two items")
        for seq, toks in items:
            if seq.length + toks.size > seq.capacity:
                raise ContextExceeded(f"{seq.length} tokens in the context and {toks.size} new ones make "
                                      f"{seq.length + toks.size}, more than the context of {seq.capacity} tokens")
        for seq, toks in items:
            seq.kv.prepare(seq.length, toks.size)
        with self.dev.kernel_scope():
            return self._pass(items, first=True, heads="last")

    def forward(self, token_ids, last_only: bool = False) -> np.ndarray:
        """Append ``token_ids`` to the sequence; returns float32 logits ``[T, vocab]`` on the host (``last_only``:
        ``[1, vocab]``, the last token's: what generation needs, without a ``[T, vocab]`` array for a long prompt).

        A prompt longer than ``prefill_chunk`` runs as consecutive forward passes over chunks of it (each chunk's
        keys and values are appended before the next chunk attends to them): the activations of one pass stay
        bounded by the chunk, and each chunk is a forward pass for the expert runner (``begin``/``end``)."""
        seq = self._sequence()
        tokens = self._check_tokens(token_ids)
        if tokens.size == 0:
            return np.zeros((0, self.cfg.vocab_size), np.float32)
        start, n = seq.length, tokens.size
        if start + n > seq.capacity:
            raise ContextExceeded(f"{start} tokens in the context and {n} new ones make {start + n}, more than the "
                                  f"context of {seq.capacity} tokens")
        seq.kv.prepare(start, n)  # every block of the pass allocated up front: running out fails before any work
        logits = []
        with self.dev.kernel_scope():
            for c0 in range(0, n, self.prefill_chunk):
                c1 = min(n, c0 + self.prefill_chunk)
                heads = "none" if last_only and c1 < n else "last" if last_only else "all"
                out = self._pass([(seq, tokens[c0:c1])], first=c0 == 0, heads=heads)
                if out is not None:
                    logits.append(out)
                every = self.snapshot_every
                if self.recurrent and c1 < n and every > 0 and (start + c1) // every > (start + c0) // every:
                    self.snapshot(periodic=True)
        if n > 1:  # the end of a prompt: where a later prompt that repeats this one resumes
            self.snapshot()
        return logits[0] if len(logits) == 1 else np.concatenate(logits)
