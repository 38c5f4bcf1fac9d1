"""The blocks a decoder layer is made of, each chosen from the config once at load time.

* attention: a fused q/k/v projection, a q/k treatment (:class:`PlainQK`, Qwen3's per-head norms :class:`HeadNormQK`,
  OLMoE's whole-projection norms :class:`ProjectionNormQK`), RoPE, the append to the paged KV cache, causal GQA over
  it (with the layer's sliding window and sinks), the output projection; :class:`LatentAttention` (DeepSeek-V3's
  multi-head latent attention over a latent cache, absorbed); an optional sigmoid output gate (Qwen3-Next / Qwen3.5);
* :class:`GatedDeltaNet`: Qwen3-Next's / Qwen3.5's linear attention, a short convolution and the gated delta rule over
  a per-sequence :class:`LinearState`, in the place of attention;
* routers: :class:`SoftmaxTopKRouter` (softmax over the experts, top-k, optional renormalisation),
  :class:`SigmoidGroupRouter` (DeepSeek-V3 / GLM-4.5: sigmoid scores, a selection bias, group-limited top-k, a
  routed scaling factor), :class:`SoftmaxGroupRouter` (DeepSeek-V2: softmax, group-limited or plain greedy top-k,
  a routed scaling factor);
* MLPs: :class:`DenseMLP` (SwiGLU), :class:`MoeMLP` (router + routed experts through the model's expert runner +
  an optional :class:`SharedExpert`, with a sigmoid gate or without).

A new attention kind or router is a new block here and one line where :mod:`freetoken.models.decoder` picks blocks
from the config. Blocks compute with ``freetoken.ops`` (each op picks its implementation per device) and the
device's array module for elementwise arithmetic; none of them knows which device it runs on. Between the dense
projections a layer runs few ops, each one kernel on buffers of a :class:`freetoken.models.scratch.Scratch`
reused every step: RMSNorm, q/k norms + RoPE (:func:`freetoken.ops.rope_qkv_cache`), the KV append
(:func:`freetoken.ops.kv_store`), paged attention (:func:`freetoken.ops.paged_attention`),
the residual add + RMSNorm (:func:`freetoken.ops.add_rms_norm`), routing. The blocks hand the ops arguments they
made and checked at load time (``checked=True``: the ops check nothing again).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from freetoken import ops
from freetoken.models.experts import ExpertRunner
from freetoken.models.linear import Linear
from freetoken.models.qmatrix import QuantizedMatrix, fp8_transposed, stack
from freetoken.models.scratch import Scratch


def silu(xp, a):
    return a / (1.0 + xp.exp(-a))


def silu_mul(xp, g, u):
    """``silu(g) * u`` as a new C-contiguous array: the same float32 operations as ``silu(xp, g) * u``, in place in
    one buffer (g and u may be strided views)."""
    t = xp.negative(g)
    xp.exp(t, out=t)
    t += 1.0
    xp.divide(g, t, out=t)
    t *= u
    return t


def sigmoid_gate(xp, y, s):
    """``y / (1 + exp(-s))`` into ``y`` (in place; ``s`` may be a strided view)."""
    t = xp.negative(s)
    xp.exp(t, out=t)
    t += 1.0
    y /= t
    return y


class Span(NamedTuple):
    """One sequence's rows in a forward pass over several: rows ``lo .. hi - 1`` of the pass's tokens are that
    sequence's positions ``start ..``; ``kv`` is what the layer's token mixer keeps of it (an attention layer's
    :class:`freetoken.models.kv.LayerKV`, a linear-attention layer's :class:`LinearState`). Every token-wise step
    of a layer runs over all the pass's rows at once; the mixing along a sequence runs per span, or once for all
    the spans with a :class:`PassBatch`."""

    kv: object
    start: int
    lo: int
    hi: int


class PassBatch(NamedTuple):
    """What a forward pass over several sequences makes once and every layer shares: the attention layers' block
    tables (a :class:`freetoken.ops.PagedBatch`, None when no layer has a paged cache of its own) and the
    linear-attention layers' state slots (a :class:`freetoken.ops.StateBatch`, None when no layer has one). With
    it the mixing along each sequence runs once for all the spans; without it (one sequence), span by span."""

    paged: object | None
    states: object | None


# ---- attention ---------------------------------------------------------------------------------------------------
class PlainQK:
    """q and k heads as projected: ``qkv [T, (H + 2 Hkv) D]`` -> (q and k heads ``[T, H + Hkv, D]``, v ``[T, Hkv,
    D]``).

    ``per_head``: True where the treatment is a per-head norm with weight ``head_norm`` ``[H + Hkv, D]`` (None: no
    norm), which :func:`freetoken.ops.rope_qkv_cache` fuses with RoPE and the KV write."""

    per_head = True
    head_norm = None
    eps = 0.0

    def __init__(self, heads: int, kv_heads: int, head_dim: int):
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim

    def split(self, qkv):
        t = qkv.shape[0]
        qkv = qkv.reshape(t, self.heads + 2 * self.kv_heads, self.head_dim)
        return qkv[:, :self.heads + self.kv_heads], qkv[:, self.heads + self.kv_heads:]

    def __call__(self, qkv_proj: Linear, qkv):
        return self.split(qkv)


class HeadNormQK(PlainQK):
    """Qwen3: every q and k head RMS-normed over ``head_dim`` (q heads with ``q_norm``, k heads with ``k_norm``;
    both held as one ``[H + Hkv, D]`` weight so the q and k heads are normed in one call)."""

    def __init__(self, heads: int, kv_heads: int, head_dim: int, q_norm: np.ndarray, k_norm: np.ndarray, eps: float,
                 device):
        super().__init__(heads, kv_heads, head_dim)
        self.weight = device.asarray(np.concatenate([np.tile(q_norm.reshape(-1), (heads, 1)),
                                                     np.tile(k_norm.reshape(-1), (kv_heads, 1))]))
        self.eps, self.dev = eps, device
        self.head_norm = self.weight

    def __call__(self, qkv_proj: Linear, qkv):
        qk, v = self.split(qkv)
        return ops.rms_norm(qk, self.weight, self.eps, device=self.dev), v


class ProjectionNormQK(PlainQK):
    """OLMoE: the whole q projection and the whole k projection RMS-normed (over ``H * D`` and ``Hkv * D``)."""

    per_head = False

    def __init__(self, heads: int, kv_heads: int, head_dim: int, q_norm: np.ndarray, k_norm: np.ndarray, eps: float,
                 device):
        super().__init__(heads, kv_heads, head_dim)
        self.q_norm, self.k_norm = device.asarray(q_norm), device.asarray(k_norm)
        self.eps, self.dev = eps, device

    def __call__(self, qkv_proj: Linear, qkv):
        t, xp = qkv.shape[0], self.dev.xp
        q, k, v = qkv_proj.split(qkv)
        q = ops.rms_norm(q, self.q_norm, self.eps, device=self.dev)
        k = ops.rms_norm(k, self.k_norm, self.eps, device=self.dev)
        qk = xp.concatenate([q, k], axis=-1).reshape(t, self.heads + self.kv_heads, self.head_dim)
        return qk, v.reshape(t, self.kv_heads, self.head_dim)


class Attention:
    """Causal grouped-query self-attention with RoPE over the sequence's paged KV cache.

    ``window``: the layer's sliding window (0: the whole context); ``sinks``: gpt-oss' per-head logits ``[H]``
    (host float32) or None."""

    def __init__(self, qkv: Linear, qk, o_proj: Linear, device, scratch: Scratch | None = None, window: int = 0,
                 sinks: np.ndarray | None = None, out_gate: Linear | None = None):
        self.qkv, self.qk, self.o_proj, self.dev = qkv, qk, o_proj, device
        self.heads = qk.heads
        self.scratch = scratch if scratch is not None else Scratch(device)
        self.window = int(window)
        self.sinks = None if sinks is None else device.asarray(np.ascontiguousarray(sinks, np.float32).reshape(-1))
        self.out_gate = out_gate

    @property
    def nbytes(self) -> int:
        """Bytes of the block's weights."""
        qk = self.qk
        extra = (getattr(qk, "weight", None), getattr(qk, "q_norm", None), getattr(qk, "k_norm", None), self.sinks)
        gate = self.out_gate.nbytes if self.out_gate is not None else 0
        return self.qkv.nbytes + self.o_proj.nbytes + gate + sum(int(w.nbytes) for w in extra if w is not None)

    def __call__(self, x, spans: list[Span], cos, sin, q_scale=None, batch: PassBatch | None = None):
        """``x [T, hidden]``, the rows of ``spans`` (each a sequence's positions ``start ..``, its ``kv`` the layer's
        :class:`freetoken.models.kv.LayerKV` with those positions already allocated), ``cos``/``sin`` the rows'
        RoPE rows; appends each span's keys and values to its sequence and returns the output projection
        ``[T, hidden]``. ``q_scale`` ``[T]`` (device float32, or None): each roped query's factor
        (:func:`freetoken.models.rope.query_temperature`). ``batch``: the pass's :class:`PassBatch` (several
        sequences: the append and the attention run once for all of them), or None."""
        t, dev = x.shape[0], self.dev
        paged = batch.paged if batch is not None else None
        qkv = self.qkv(x)  # biases included
        qk = self.qk
        dim = qk.head_dim
        shape = (t, qk.kv_heads, dim)
        if qk.per_head:  # norms and RoPE in one kernel, the roped keys and the values into float32 scratch rows
            k, v = self.scratch.get("k", shape), self.scratch.get("v", shape)
            q = ops.rope_qkv_cache(qkv, qk.head_norm, qk.eps, cos, sin, k, v, 0,
                                   out=self.scratch.get("q", (t, self.heads, dim)), device=dev, checked=True)
        else:
            qk, v = qk(self.qkv, qkv)
            qk = ops.rope(qk, cos, sin, device=dev)
            q, k = qk[:, :self.heads], qk[:, self.heads:]
            xp = dev.xp
            q, k, v = xp.ascontiguousarray(q), xp.ascontiguousarray(k), xp.ascontiguousarray(v)
        if q_scale is not None:
            q *= q_scale[:, None, None]
        a = self.scratch.get("att", (t, self.heads * dim))
        if paged is not None:  # every span's kv is a view of the same layer pool, through its own block table
            kv = spans[0].kv
            ops.kv_store_batch(k, v, kv.k, kv.v, kv.k_scale, kv.v_scale, paged, device=dev, checked=True)
            ops.paged_attention_batch(q, kv.k, kv.v, kv.k_scale, kv.v_scale, paged, window=self.window,
                                      sinks=self.sinks, out=a, device=dev, checked=True)
        else:
            for kv, start, lo, hi in spans:  # (each span's rows are contiguous: slices of C-contiguous arrays)
                ops.kv_store(k[lo:hi], v[lo:hi], kv.k, kv.v, kv.k_scale, kv.v_scale, kv.block_table, start,
                             device=dev, checked=True)
                ops.paged_attention(q[lo:hi], kv.k, kv.v, kv.k_scale, kv.v_scale, kv.block_table, start,
                                    window=self.window, sinks=self.sinks, out=a[lo:hi], device=dev, checked=True)
        if self.out_gate is not None:  # Qwen3-Next / Qwen3.5: every output value scaled by sigmoid(gate . x)
            sigmoid_gate(dev.xp, a, self.out_gate(x))
        return self.o_proj(a)


class LinearState:
    """One sequence's state in a Gated DeltaNet layer: the short convolution's last K - 1 inputs ``conv`` [K - 1, C]
    and the recurrent state ``rec`` [Hv, Dk, Dv] (device float32, zeros at the start of a sequence). A sequence's
    live state is a :class:`PooledLinearState`; a snapshot (:meth:`copy`) holds arrays of its own."""

    def __init__(self, conv, rec):
        self._conv, self._rec = conv, rec

    @property
    def conv(self):
        return self._conv

    @property
    def rec(self):
        return self._rec

    @property
    def nbytes(self) -> int:
        return int(self.conv.nbytes) + int(self.rec.nbytes)

    def reset(self) -> None:
        self.conv.fill(0)
        self.rec.fill(0)

    def copy_from(self, other: LinearState) -> None:
        self.conv[...] = other.conv
        self.rec[...] = other.rec

    def copy(self) -> LinearState:
        """A second state with this one's values (new device arrays)."""
        return LinearState(self.conv.copy(), self.rec.copy())


class PooledLinearState(LinearState):
    """A sequence's live state: slot ``slot`` of a layer's pools ``[N, K - 1, C]`` / ``[N, Hv, Dk, Dv]`` in
    ``slots`` (a :class:`freetoken.models.sequence.StateSlots`), which one call advances for every sequence of a
    pass (:func:`freetoken.ops.gated_delta_rule_batch`). Read through the pools each time: they move when the
    slots grow."""

    def __init__(self, slots, layer: int, slot: int):
        self.slots, self.layer, self.slot = slots, layer, slot

    @property
    def conv_pool(self):
        return self.slots.conv[self.layer]

    @property
    def rec_pool(self):
        return self.slots.rec[self.layer]

    @property
    def conv(self):
        return self.slots.conv[self.layer][self.slot]

    @property
    def rec(self):
        return self.slots.rec[self.layer][self.slot]


class GatedDeltaNet:
    """Qwen3-Next's / Qwen3.5's linear attention: the input projections (q|k|v channels, the output gate z, the
    write strength b and the decay input a, as one matrix), the short causal convolution with SiLU over q|k|v
    (:func:`freetoken.ops.short_conv`), the gated delta rule over a per-head recurrent state
    (:func:`freetoken.ops.gated_delta_rule`, q and k L2-normalised inside) with ``beta = sigmoid(b)`` and decay
    ``g = ssm_a * softplus(a + dt_bias)`` (``ssm_a = -exp(A_log)``, the weights' ``lin_ssm_a``), a per-head RMSNorm
    gated by ``silu(z)``, the output projection.

    Called as an attention block, with the layer's :class:`LinearState` in place of its KV rows: the state carries
    the sequence, so positions (RoPE) play no part."""

    def __init__(self, inp: Linear, conv_w: np.ndarray, ssm_a: np.ndarray, dt_bias: np.ndarray, norm_w: np.ndarray,
                 out: Linear, k_heads: int, v_heads: int, k_dim: int, v_dim: int, eps: float, device,
                 scratch: Scratch | None = None):
        self.inp, self.out, self.dev = inp, out, device
        self.k_heads, self.v_heads, self.k_dim, self.v_dim, self.eps = k_heads, v_heads, k_dim, v_dim, eps
        self.channels = 2 * k_heads * k_dim + v_heads * v_dim
        self.conv_w = device.asarray(np.ascontiguousarray(np.asarray(conv_w, np.float32).reshape(self.channels, -1)))
        self.taps = int(self.conv_w.shape[1])
        self.neg_a = device.asarray(np.ascontiguousarray(ssm_a, np.float32).reshape(-1))  # -exp(A_log)
        self.dt_bias = device.asarray(np.ascontiguousarray(dt_bias, np.float32).reshape(-1))
        self.norm_w = device.asarray(np.ascontiguousarray(norm_w, np.float32).reshape(-1))
        self.scratch = scratch if scratch is not None else Scratch(device)

    @property
    def nbytes(self) -> int:
        vecs = (self.conv_w, self.neg_a, self.dt_bias, self.norm_w)
        return self.inp.nbytes + self.out.nbytes + sum(int(v.nbytes) for v in vecs)

    @property
    def state_shapes(self) -> tuple[tuple[int, int], tuple[int, int, int]]:
        """The shapes of one sequence's :class:`LinearState` in this layer: conv ``(K - 1, C)``, rec ``(Hv, Dk,
        Dv)``."""
        return (self.taps - 1, self.channels), (self.v_heads, self.k_dim, self.v_dim)

    @property
    def state_nbytes(self) -> int:
        """Bytes of one sequence's state in this layer (:class:`LinearState`: conv and recurrent, float32)."""
        return 4 * ((self.taps - 1) * self.channels + self.v_heads * self.k_dim * self.v_dim)

    def __call__(self, x, spans: list[Span], cos, sin, q_scale=None, batch: PassBatch | None = None):
        """The layer's output ``[T, hidden]``; each span's state (its ``kv``, a :class:`LinearState`) advances by its
        tokens: with ``batch`` (a pass over several sequences, its ``states`` their slots in the layer's
        :class:`freetoken.models.sequence.StateSlots`) in one call for all the spans, else span by span
        (``cos``/``sin``/``q_scale``: the attention layers' position rows, which a recurrence does not use)."""
        t, dev, xp = x.shape[0], self.dev, self.dev.xp
        c, hv, dv = self.channels, self.v_heads, self.v_dim
        proj = self.inp(x)  # [T, C + Hv*Dv + 2 Hv]: q|k|v, z, b, a
        conv_in = xp.ascontiguousarray(proj[:, :c])
        qkv = self.scratch.get("lin_qkv", (t, c))
        pooled = batch.states if batch is not None else None
        if pooled is not None:
            ops.short_conv_batch(conv_in, self.conv_w, spans[0].kv.conv_pool, pooled, out=qkv, device=dev,
                                 checked=True)
        else:
            for state, _, lo, hi in spans:
                ops.short_conv(conv_in[lo:hi], self.conv_w, state.conv, out=qkv[lo:hi], device=dev, checked=True)
        b = proj[:, c + hv * dv:c + hv * dv + hv]
        a = proj[:, c + hv * dv + hv:]
        beta = xp.negative(b)  # sigmoid(b), in one new contiguous array
        xp.exp(beta, out=beta)
        beta += 1.0
        xp.reciprocal(beta, out=beta)
        g = xp.logaddexp(np.float32(0.0), a + self.dt_bias)  # softplus(a + dt_bias): a new contiguous array
        g *= self.neg_a
        o = self.scratch.get("lin_o", (t, hv, dv))
        if pooled is not None:
            ops.gated_delta_rule_batch(qkv, g, beta, spans[0].kv.rec_pool, self.k_heads, pooled, out=o, device=dev,
                                       checked=True)
        else:
            for state, _, lo, hi in spans:
                ops.gated_delta_rule(qkv[lo:hi], g[lo:hi], beta[lo:hi], state.rec, self.k_heads, out=o[lo:hi],
                                     device=dev, checked=True)
        o = ops.rms_norm(o, self.norm_w, self.eps, out=self.scratch.get("lin_n", (t, hv, dv)), device=dev,
                         checked=True)
        z = proj[:, c:c + hv * dv].reshape(t, hv, dv)
        y = silu_mul(xp, z, o)  # silu(z) * norm(o), a new [T, Hv, Dv] array
        return self.out(y.reshape(t, hv * dv))


def _absorbed_fp8(kv_b: QuantizedMatrix, heads: int, nope: int, v_dim: int):
    """(W_uk^T rows [H*R, nope], W_uv rows [H*v, R]) of a block-FP8 ``kv_b_proj`` [H*(nope+v), R] as fp8_block
    matrices with the stored codes and scales, or None (another storage, or heads not on scale tiles)."""
    if kv_b.kind != "fp8_block":
        return None
    width = nope + v_dim
    uk = [fp8_transposed(kv_b, hd * width, nope) for hd in range(heads)]
    if any(m is None for m in uk):
        return None
    uv = kv_b.rows(np.concatenate([np.arange(hd * width + nope, (hd + 1) * width) for hd in range(heads)]))
    return stack(uk), uv


class LatentAttention:
    """DeepSeek-V3's multi-head latent attention over the paged latent cache, in the absorbed form.

    Each token's cache row is ``[c, k_rope]``: the normed ``kv_lora_rank``-wide latent ``c = norm(kv_a(x)[:R])`` and
    the one roped key ``k_rope`` all heads share (``R + P`` values, not ``2 H D``). Head h's key would be
    ``[W_uk_h c, k_rope]`` and its value ``W_uv_h c`` (``kv_b_proj`` rows); instead the query absorbs ``W_uk_h``
    (``q_lat = W_uk_h^T q_nope``, so ``q.k = [q_lat, q_rope] . [c, k_rope]``) and the output ``W_uv_h``
    (``o_h = W_uv_h sum_p a_p c_p``), so attention runs over the cached rows as they are
    (:func:`freetoken.ops.latent_attention`). The per-head products are batched matmuls of the device's array
    module, or, when ``kv_b`` is a block-FP8 matrix whose heads start on 128-row tiles (DeepSeek-V2/V3's releases),
    grouped fp8 GEMVs (:func:`freetoken.ops.dense_grouped`) over its codes and scales as stored: ``W_uk`` transposed
    exactly (:func:`freetoken.models.qmatrix.fp8_transposed`), ``W_uv`` its rows. ``q``: a plain ``q_proj``, or
    ``(q_a_proj, q_a_norm weight, q_b_proj)`` (the low-rank query)."""

    def __init__(self, q, kv_a: Linear, kv_a_norm: np.ndarray, kv_b, o_proj: Linear, heads: int,
                 nope: int, rope: int, rank: int, v_dim: int, eps: float, scale: float, device,
                 scratch: Scratch | None = None):
        self.dev, self.xp = device, device.xp
        if isinstance(q, tuple):
            self.q_a, q_a_norm, self.q_b = q
            self.q_a_norm, self.q_proj = device.asarray(np.ascontiguousarray(q_a_norm, np.float32)), None
        else:
            self.q_a = self.q_a_norm = self.q_b = None
            self.q_proj = q
        self.kv_a, self.o_proj = kv_a, o_proj
        self.kv_a_norm = device.asarray(np.ascontiguousarray(kv_a_norm, np.float32))
        self.heads, self.nope, self.rope, self.rank, self.v_dim = heads, nope, rope, rank, v_dim
        self.eps, self.scale = eps, float(scale)
        self.uk_rows = self.uv_rows = self.w_uk = self.w_uv_t = None
        fp8 = _absorbed_fp8(kv_b, heads, nope, v_dim) if isinstance(kv_b, QuantizedMatrix) else None
        if fp8 is not None:
            self.uk_rows, self.uv_rows = (device.asarray(np.ascontiguousarray(m.blocks)) for m in fp8)
        else:
            if isinstance(kv_b, QuantizedMatrix):
                kv_b = kv_b.dequantize()
            w = np.asarray(kv_b, np.float32).reshape(heads, nope + v_dim, rank)
            self.w_uk = device.asarray(np.ascontiguousarray(w[:, :nope]))  # [H, nope, R]
            self.w_uv_t = device.asarray(np.ascontiguousarray(w[:, nope:].transpose(0, 2, 1)))  # [H, R, v]
        self.scratch = scratch if scratch is not None else Scratch(device)

    @property
    def nbytes(self) -> int:
        """Bytes of the block's weights (``kv_b_proj`` held as its two absorbed halves)."""
        mats = [self.kv_a, self.o_proj] + ([self.q_proj] if self.q_proj is not None else [self.q_a, self.q_b])
        halves = [self.uk_rows, self.uv_rows] if self.uk_rows is not None else [self.w_uk, self.w_uv_t]
        vecs = [self.kv_a_norm, *halves] + ([] if self.q_a_norm is None else [self.q_a_norm])
        return sum(m.nbytes for m in mats) + sum(int(v.nbytes) for v in vecs)

    def __call__(self, x, spans: list[Span], cos, sin, q_scale=None, batch: PassBatch | None = None):
        """As :meth:`Attention.__call__`, with each span's ``kv`` the layer's latent pool (keys only) and
        ``cos``/``sin`` the rope part's RoPE rows (with ``batch``, the latent append and attention run once for all
        the spans)."""
        t, dev, xp = x.shape[0], self.dev, self.xp
        paged = batch.paged if batch is not None else None
        h, nope, rope, rank = self.heads, self.nope, self.rope, self.rank
        if self.q_proj is None:
            q = self.q_b(ops.rms_norm(self.q_a(x), self.q_a_norm, self.eps, device=dev))
        else:
            q = self.q_proj(x)
        q = q.reshape(t, h, nope + rope)
        ckv = self.kv_a(x)  # [T, R + P]
        c = ops.rms_norm(xp.ascontiguousarray(ckv[:, :rank]), self.kv_a_norm, self.eps, device=dev)
        # the query heads' rope parts and the shared rope key, rotated in one call
        qk_rope = xp.concatenate([q[:, :, nope:], ckv[:, None, rank:]], axis=1)  # [T, H + 1, P]
        qk_rope = ops.rope(qk_rope, cos, sin, device=dev)
        row = self.scratch.get("latent_row", (t, rank + rope))
        row[:, :rank], row[:, rank:] = c, qk_rope[:, h]
        if paged is not None:  # every span's kv is a view of the same latent pool, through its own block table
            ops.latent_store_batch(row, spans[0].kv.k, spans[0].kv.k_scale, paged, device=dev, checked=True)
        else:
            for kv, start, lo, hi in spans:
                ops.latent_store(row[lo:hi], kv.k, kv.k_scale, kv.block_table, start, device=dev, checked=True)
        q_cat = self.scratch.get("latent_q", (t, h, rank + rope))
        if self.uk_rows is not None:  # q_lat[t, h] = W_uk_h^T q_nope[t, h]: one grouped fp8 GEMV for all heads
            q_cat[:, :, :rank] = ops.dense_grouped(xp.ascontiguousarray(q[:, :, :nope]), self.uk_rows, "fp8_block",
                                                   device=dev)
        else:
            q_cat[:, :, :rank] = xp.matmul(q[:, :, :nope].transpose(1, 0, 2), self.w_uk).transpose(1, 0, 2)
        q_cat[:, :, rank:] = qk_rope[:, :h]
        if q_scale is not None:
            q_cat *= q_scale[:, None, None]
        a = self.scratch.get("latent_att", (t, h * rank))
        if paged is not None:
            ops.latent_attention_batch(q_cat, spans[0].kv.k, spans[0].kv.k_scale, paged, rank, scale=self.scale,
                                       out=a, device=dev, checked=True)
        else:
            for kv, start, lo, hi in spans:
                ops.latent_attention(q_cat[lo:hi], kv.k, kv.k_scale, kv.block_table, start, rank, scale=self.scale,
                                     out=a[lo:hi], device=dev, checked=True)
        if self.uv_rows is not None:
            o = ops.dense_grouped(a.reshape(t, h, rank), self.uv_rows, "fp8_block", device=dev)  # [T, H, v]
            return self.o_proj(o.reshape(t, h * self.v_dim))
        o = xp.matmul(a.reshape(t, h, rank).transpose(1, 0, 2), self.w_uv_t)  # [H, T, v]
        return self.o_proj(xp.ascontiguousarray(o.transpose(1, 0, 2)).reshape(t, h * self.v_dim))


# ---- routers -----------------------------------------------------------------------------------------------------
class SoftmaxTopKRouter:
    """Router logits (a linear gate), softmax over the experts, the top-k, renormalised when ``renormalize``."""

    def __init__(self, gate: Linear, top_k: int, renormalize: bool, device):
        self.gate, self.top_k, self.renormalize, self.dev = gate, top_k, renormalize, device

    def __call__(self, h):
        """``h [T, hidden]`` -> (expert ids int32 ``[T, k]``, weights float32 ``[T, k]``) on the device (new arrays:
        the routing record keeps them)."""
        t, dev = h.shape[0], self.dev
        return ops.route_softmax_topk(self.gate(h), self.top_k, self.renormalize,
                                      out_ids=dev.empty((t, self.top_k), np.int32),
                                      out_weights=dev.empty((t, self.top_k), np.float32), device=dev, checked=True)


class _GroupRouter:
    """What the group-limited routers share: a linear gate, top-k, ``n_group`` groups of which ``topk_group`` stay in
    play, renormalisation, a weight scale, new output arrays per call (the routing record keeps them)."""

    def __init__(self, gate: Linear, top_k: int, n_group: int, topk_group: int, renormalize: bool, scale: float,
                 device):
        self.gate, self.top_k, self.dev = gate, top_k, device
        self.n_group, self.topk_group, self.renormalize, self.scale = n_group, topk_group, renormalize, scale

    def _outputs(self, t: int) -> dict:
        dev = self.dev
        return dict(out_ids=dev.empty((t, self.top_k), np.int32), out_weights=dev.empty((t, self.top_k), np.float32),
                    device=dev, checked=True)


class SigmoidGroupRouter(_GroupRouter):
    """DeepSeek-V3's router (GLM-4.5 has it too): sigmoid scores of a linear gate, ``e_score_correction_bias`` added
    for the choice only, the best ``topk_group`` of ``n_group`` expert groups, the top-k among their experts, the
    unbiased scores as weights (renormalised when ``renormalize``) times ``scale``
    (:func:`freetoken.ops.route_sigmoid_group_topk`)."""

    def __init__(self, gate: Linear, bias: np.ndarray, top_k: int, n_group: int, topk_group: int,
                 renormalize: bool, scale: float, device):
        super().__init__(gate, top_k, n_group, topk_group, renormalize, scale, device)
        self.bias = device.asarray(np.ascontiguousarray(bias, np.float32).reshape(-1))

    def __call__(self, h):
        return ops.route_sigmoid_group_topk(self.gate(h), self.bias, self.top_k, self.n_group, self.topk_group,
                                            self.renormalize, self.scale, **self._outputs(h.shape[0]))


class SoftmaxGroupRouter(_GroupRouter):
    """DeepSeek-V2's router: softmax over the experts of a linear gate, the best ``topk_group`` of ``n_group``
    groups (scored by their largest probability; one group: plain greedy top-k), the top-k among their experts,
    renormalised when ``renormalize``, times ``scale`` (:func:`freetoken.ops.route_softmax_group_topk`)."""

    def __call__(self, h):
        return ops.route_softmax_group_topk(self.gate(h), self.top_k, self.n_group, self.topk_group,
                                            self.renormalize, self.scale, **self._outputs(h.shape[0]))


# ---- MLPs --------------------------------------------------------------------------------------------------------
class DenseMLP:
    """SwiGLU: ``down(silu(gate h) * up h)``, gate and up as one matrix."""

    def __init__(self, gate_up: Linear, down: Linear, device):
        self.gate_up, self.down, self.xp = gate_up, down, device.xp

    def __call__(self, h):
        g, u = self.gate_up.split(self.gate_up(h))
        return self.down(silu_mul(self.xp, g, u))


class SharedExpert:
    """A MoE layer's shared expert: a SwiGLU MLP every token runs. Qwen2-MoE's is scaled by ``sigmoid(w_gate . h)``
    (``gated``: gate, up and the sigmoid gate read ``h`` as one matrix); GLM-4.5's ``n_shared_experts`` are one
    ungated MLP of their summed width."""

    def __init__(self, inp: Linear, down: Linear, device, gated: bool = True):
        self.inp, self.down, self.xp, self.gated = inp, down, device.xp, gated

    def __call__(self, h):
        if not self.gated:
            g, u = self.inp.split(self.inp(h))
            return self.down(silu_mul(self.xp, g, u))
        g, u, sg = self.inp.split(self.inp(h))
        return sigmoid_gate(self.xp, self.down(silu_mul(self.xp, g, u)), sg)  # down's output: a new array


class MoeMLP:
    """A MoE layer's MLP: route, run the routed experts through the model's :class:`ExpertRunner` (MoE layer
    ``index``), add the shared expert when there is one."""

    def __init__(self, router, experts: ExpertRunner, index: int, shared: SharedExpert | None, device):
        self.router, self.experts, self.index, self.shared, self.xp = router, experts, index, shared, device.xp

    def __call__(self, h):
        ids, w = self.router(h)
        h = self.xp.ascontiguousarray(h)
        y = self.experts.run(self.index, h, ids, w)
        if self.shared is not None:
            y = y + self.shared(h)
        return y


class DecoderLayer:
    """Pre-norm residual layer: ``x += attention(norm(x)); x += mlp(norm(x))``."""

    def __init__(self, attn_norm, attention: Attention, mlp_norm, mlp, eps: float, device,
                 scratch: Scratch | None = None):
        self.attn_norm, self.attention, self.mlp_norm, self.mlp = attn_norm, attention, mlp_norm, mlp
        self.eps, self.dev = eps, device
        self.scratch = scratch if scratch is not None else Scratch(device)

    def __call__(self, x, spans: list[Span], cos, sin, q_scale=None, batch: PassBatch | None = None) -> None:
        """Updates the residual stream ``x [T, hidden]`` (float32, C-contiguous; the rows of ``spans``) in place;
        ``batch``: the pass's :class:`PassBatch` (several spans) or None."""
        dev = self.dev
        h = ops.rms_norm(x, self.attn_norm, self.eps, out=self.scratch.get("h", x.shape), device=dev, checked=True)
        a = self.attention(h, spans, cos, sin, q_scale, batch)
        ops.add_rms_norm(x, a, self.mlp_norm, self.eps, out=h, device=dev, checked=True)  # x += a; h = norm(x)
        x += self.mlp(h)
