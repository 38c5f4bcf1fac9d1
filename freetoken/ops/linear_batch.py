"""Gated DeltaNet's two sequence ops over a batch of sequences in one call (continuous batching):
:func:`short_conv_batch` and :func:`gated_delta_rule_batch` advance each sequence's state by its rows of a forward
pass whose rows belong to several sequences.

The states live in pools, one state after another (``[N, K - 1, C]`` for the convolution, ``[N, Hv, Dk, Dv]`` for
the rule: what :class:`freetoken.models.sequence.StateSlots` keeps for each linear-attention layer); sequence ``s``
owns state ``slots[s]`` of each pool and rows ``bounds[s] .. bounds[s + 1] - 1`` of the pass. One
:class:`StateBatch` describes that layout for every layer of a pass (its descriptors are made once). Each sequence's
result, and its state after the call, is what :func:`~freetoken.ops.linear_attention.short_conv` /
:func:`~freetoken.ops.linear_attention.gated_delta_rule` give it alone on its state.

gpu/emu: one launch of ``short_conv_f32`` and one of ``gated_delta_rule_f32`` (the single-sequence kernels in their
batch mode, ``width`` > 0) for the sequences of fewer than ``LINEAR_CHUNKED_MIN_TOKENS`` rows; a longer prompt chunk
runs the rule's chunked form on its own state. cpu: one Numba call for the rule (``gated_delta_rule_rows``, the
single op's kernel, given every sequence), one for the convolution of the sequences under ``PARALLEL_TOKENS``
rows (a longer one runs the single kernel, which spreads its rows over the threads).
"""

from __future__ import annotations

import numpy as np

from freetoken.device.constants import LINEAR_CHUNKED_MIN_TOKENS, LINEAR_COLUMNS, LINEAR_CONV_THREADS
from freetoken.ops._common import check_int32, cpu_module, cuda_kernel, prepare_out, resolve
from freetoken.ops.linear_attention import _run_conv, _run_rule, check_conv_inputs, check_rule_inputs


class StateBatch:
    """The layout of one pass's rows over several sequences' states: ``slots`` (each sequence's state index in the
    pools, all different) and ``counts`` (its rows, > 0, in pass order), on ``device``."""

    def __init__(self, slots, counts, *, device=None):
        dev = resolve(device)
        self.dev = dev
        self.slots = tuple(int(s) for s in slots)
        self.counts = tuple(int(c) for c in counts)
        if len(self.slots) != len(self.counts):
            raise ValueError(f"{len(self.slots)} slots and {len(self.counts)} counts: one of each per sequence")
        if not self.counts or min(self.counts) < 1:
            raise ValueError("a batch needs at least one sequence, each with at least one row")
        if min(self.slots) < 0 or len(set(self.slots)) != len(self.slots):
            raise ValueError(f"slots must be distinct state indices >= 0, got {list(self.slots)}")
        self.bounds = tuple(int(b) for b in np.concatenate([[0], np.cumsum(self.counts)]))
        self.rows = check_int32("rows", self.bounds[-1])
        self._desc: dict = {}

    @property
    def size(self) -> int:
        return len(self.counts)

    def desc(self, seqs: tuple[int, ...]):
        """int32 ``[len(seqs), 3]``: (slot, first row, end row) of the sequences ``seqs``, on the device (made on
        first use and kept: every layer of the pass shares it)."""
        arr = self._desc.get(seqs)
        if arr is None:
            host = np.array([(self.slots[s], self.bounds[s], self.bounds[s + 1]) for s in seqs],
                            np.int32).reshape(-1, 3)
            arr = self._desc[seqs] = host if self.dev.kind == "cpu" else self.dev.asarray(host)
        return arr

    def split(self, threshold: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(the sequences of fewer than ``threshold`` rows, the others)."""
        short = tuple(s for s, n in enumerate(self.counts) if n < threshold)
        return short, tuple(s for s in range(self.size) if self.counts[s] >= threshold)


def _check_pool(dev, batch, states, ndim: int):
    """``states`` a float32 pool of ``ndim`` axes holding every slot of ``batch`` (a StateBatch of ``dev``)."""
    if not isinstance(batch, StateBatch):
        raise TypeError(f"batch must be a StateBatch, got {type(batch).__name__}")
    if batch.dev is not dev:
        raise ValueError(f"the batch was made for the {batch.dev.kind} device, not {dev.kind}")
    st = dev.as_array(states)
    if st.dtype != np.float32 or st.ndim != ndim or not st.flags.c_contiguous:
        raise ValueError(f"states must be a float32 pool of {ndim} axes, C-contiguous, got {st.dtype} "
                         f"{tuple(st.shape)}")
    if max(batch.slots) >= st.shape[0]:
        raise ValueError(f"slot {max(batch.slots)} is past the pool's {st.shape[0]} states")
    return st


def _check_rows(batch, t_count: int) -> None:
    if t_count != batch.rows:
        raise ValueError(f"{t_count} rows given for a batch of {batch.rows} ({batch.counts} per sequence)")


def short_conv_batch(x, weight, states, batch: StateBatch, *, out=None, device=None, checked: bool = False):
    """Each sequence's rows of ``x`` (float32 ``[T, C]``, T = ``batch.rows``) through the causal convolution with
    SiLU, continuing from its state ``states[slot]`` (float32 ``[N, K - 1, C]``, updated in place):
    :func:`~freetoken.ops.linear_attention.short_conv` for every sequence of ``batch`` at once. Returns float32
    ``[T, C]`` on the device (``out`` when given)."""
    if checked:
        dev = device
    else:
        dev = resolve(device)
        states = _check_pool(dev, batch, states, 3)
        x, weight = check_conv_inputs(dev, x, weight)
        _check_rows(batch, x.shape[0])
        want = (weight.shape[1] - 1, x.shape[1])
        if tuple(states.shape[1:]) != want:
            raise ValueError(f"states must be float32 [N, {want[0]}, {want[1]}], got {tuple(states.shape)}")
        out = prepare_out(dev, out, tuple(x.shape), np.float32)
    if out is None:
        out = dev.empty(tuple(x.shape), np.float32)
    if dev.kind != "cpu":  # every sequence in one launch (the kernel runs each channel's rows in order anyway)
        t, c = x.shape
        cuda_kernel(dev, "linear_attention.cu", "short_conv_f32")(
            (-(-c // LINEAR_CONV_THREADS), batch.size), (LINEAR_CONV_THREADS,),
            (x, weight, states, out, np.int32(t), np.int32(c), np.int32(weight.shape[1]),
             batch.desc(tuple(range(batch.size))), np.int32(batch.size)))
        return out
    kernels = cpu_module("linear_attention")
    short, long_ = batch.split(kernels.PARALLEL_TOKENS)  # a long chunk: the single kernel spreads its rows
    if short:
        kernels.short_conv_batch_rows(x, weight, states, batch.desc(short), out)
    for s in long_:
        lo, hi = batch.bounds[s], batch.bounds[s + 1]
        _run_conv(dev, x[lo:hi], weight, states[batch.slots[s]], out[lo:hi])
    return out


def gated_delta_rule_batch(qkv, g, beta, states, k_heads: int, batch: StateBatch, *, out=None, device=None,
                           checked: bool = False):
    """The gated delta rule over each sequence's rows of ``qkv`` / ``g`` / ``beta`` (T = ``batch.rows`` rows),
    continuing from its state ``states[slot]`` (float32 ``[N, Hv, Dk, Dv]``, updated in place):
    :func:`~freetoken.ops.linear_attention.gated_delta_rule` (mode "auto") for every sequence of ``batch`` at
    once. Returns float32 ``[T, Hv, Dv]`` on the device (``out`` when given)."""
    if checked:
        dev = device
    else:
        dev = resolve(device)
        states = _check_pool(dev, batch, states, 4)
        qkv, g, beta, k_heads = check_rule_inputs(dev, qkv, g, beta, states.shape[1:], k_heads)
        _check_rows(batch, qkv.shape[0])
        out = prepare_out(dev, out, (qkv.shape[0], states.shape[1], states.shape[3]), np.float32)
    hv, dk, dv = states.shape[1:]
    if out is None:
        out = dev.empty((qkv.shape[0], hv, dv), np.float32)
    k_heads = int(k_heads)
    if dev.kind == "cpu":
        cpu_module("linear_attention").gated_delta_rule_rows(qkv, g, beta, states, batch.desc(tuple(range(batch.size))),
                                                             k_heads, out)
        return out
    short, long_ = batch.split(LINEAR_CHUNKED_MIN_TOKENS)
    if short:
        dims = (np.int32(qkv.shape[0]), np.int32(k_heads), np.int32(hv), np.int32(dk), np.int32(dv))
        cuda_kernel(dev, "linear_attention.cu", "gated_delta_rule_f32")(
            (hv, -(-dv // LINEAR_COLUMNS), len(short)), (LINEAR_COLUMNS,),
            (qkv, g, beta, states, out, *dims, batch.desc(short), np.int32(len(short))))
    for s in long_:  # a prompt chunk: the chunked form on its own state
        lo, hi = batch.bounds[s], batch.bounds[s + 1]
        _run_rule(dev, qkv[lo:hi], g[lo:hi], beta[lo:hi], states[batch.slots[s]], k_heads, out[lo:hi])
    return out
