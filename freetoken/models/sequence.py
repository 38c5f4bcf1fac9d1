"""One sequence's state in a decoder: its KV rows, its linear-attention states and their snapshots.

A decoder runs many sequences (:meth:`freetoken.models.decoder.MoeDecoder.forward_batch`): each holds its own
:class:`DecoderSequence`, made by :meth:`~freetoken.models.decoder.MoeDecoder.new_sequence` in the decoder's KV pool.
The attention layers' rows live in the pool under the sequence's block table (:class:`freetoken.models.kv.KVSequence`);
a Gated DeltaNet layer carries the sequence in a recurrent state instead (a slot of the layer's state pool in
:class:`StateSlots`, so one call advances every sequence of a pass), and since such a state cannot be cut back to an
earlier length the way a KV cache can, the sequence keeps copies of it at earlier lengths (snapshots) to resume from
(:meth:`DecoderSequence.resume_points`).
"""

from __future__ import annotations

import weakref
from collections import OrderedDict

import numpy as np

from freetoken.models.blocks import PooledLinearState
from freetoken.models.kv import KVPool, KVSequence

#: Slots a :class:`StateSlots` starts with; it grows by half when they are all taken.
INITIAL_STATE_SLOTS = 4


class StateSlots:
    """The linear-attention states of every sequence of a decoder: per Gated DeltaNet layer ``i`` one pool
    ``conv[i]`` [N, K - 1, C] and one ``rec[i]`` [N, Hv, Dk, Dv] (device float32), a sequence holding the same slot
    of each. Pooled, one call advances the states of every sequence of a pass (:func:`freetoken.ops.
    short_conv_batch`, :func:`freetoken.ops.gated_delta_rule_batch`). ``mixers``: the decoder's token mixers in
    layer order (a Gated DeltaNet block has ``state_shapes``); no pools for a model without one."""

    def __init__(self, mixers, device, capacity: int = INITIAL_STATE_SLOTS):
        self.dev = device
        self.shapes = {i: m.state_shapes for i, m in enumerate(mixers) if hasattr(m, "state_shapes")}
        self.capacity = int(capacity) if self.shapes else 0
        self.conv = {i: device.zeros((self.capacity, *c), np.float32) for i, (c, _) in self.shapes.items()}
        self.rec = {i: device.zeros((self.capacity, *r), np.float32) for i, (_, r) in self.shapes.items()}
        self._free = list(range(self.capacity - 1, -1, -1))  # popped from the end: the lowest slot first

    @property
    def taken(self) -> int:
        return self.capacity - len(self._free)

    @property
    def nbytes(self) -> int:
        """Bytes of the pools (every slot, taken or free)."""
        return sum(int(a.nbytes) for pools in (self.conv, self.rec) for a in pools.values())

    def take(self) -> int:
        """A free slot, its states zeroed (the pools grow by half when every slot is taken)."""
        if not self._free:
            self._grow(max(self.capacity + 1, self.capacity * 3 // 2))
        slot = self._free.pop()
        for i in self.shapes:
            self.conv[i][slot].fill(0)
            self.rec[i][slot].fill(0)
        return slot

    def give_back(self, slot: int) -> None:
        self._free.append(int(slot))

    def state(self, layer: int, slot: int) -> PooledLinearState:
        return PooledLinearState(self, layer, slot)

    def _grow(self, capacity: int) -> None:
        old = self.capacity
        for pools in (self.conv, self.rec):
            for i, arr in pools.items():
                grown = self.dev.zeros((capacity, *arr.shape[1:]), np.float32)
                grown[:old] = arr
                pools[i] = grown
        self._free = list(range(capacity - 1, old - 1, -1)) + self._free
        self.capacity = capacity


class DecoderSequence:
    """A sequence of up to ``ctx`` tokens in ``pool``. ``mixers``: the decoder's token mixers in layer order;
    ``kv_layers``: the model layers whose KV rows the pool holds, in the pool's layer order; ``slots``: the decoder's
    linear-attention states, of which the sequence holds one slot (given back when it is dropped); ``device``: where
    the states live."""

    def __init__(self, mixers, kv_layers, pool: KVPool, ctx: int, device, slots: StateSlots):
        self.dev = device
        self.kv = KVSequence(pool, ctx)
        self.recurrent = bool(slots.shapes)
        self.slot = None
        if self.recurrent:
            self.slot = slots.take()
            weakref.finalize(self, slots.give_back, self.slot)
        self.states = [slots.state(i, self.slot) if i in slots.shapes else None for i in range(len(mixers))]
        slot = {layer: j for j, layer in enumerate(kv_layers)}
        # what each layer's token mixer reads and writes: its KV rows in the pool (views; the block table updates in
        # place), or a linear-attention layer's state
        self.layer_kv = [st if st is not None else self.kv.layer(slot[i]) for i, st in enumerate(self.states)]
        self._snapshots: OrderedDict[int, list] = OrderedDict()
        self._periodic: set[int] = set()  # the lengths of the snapshots taken every snapshot_every tokens

    @property
    def capacity(self) -> int:
        """The most tokens (prompt and generated) the sequence may hold."""
        return self.kv.capacity

    @property
    def length(self) -> int:
        """Tokens of the sequence (positions ``0 .. length - 1``)."""
        return self.kv.length

    @length.setter
    def length(self, n: int) -> None:
        """Roll the sequence back to its first ``n`` tokens (their blocks stay, the rest go back to the pool). With
        linear-attention layers ``n`` must be the current length, 0, or a length in :meth:`resume_points`
        (ValueError otherwise)."""
        n = int(n)
        kv = self.kv
        if self.recurrent and n not in (0, kv.length):
            snap = self._snapshots.get(n)
            if snap is None:
                raise ValueError(f"the linear-attention layers' state at {n} tokens is not kept (resumable lengths: "
                                 f"{self.resume_points()})")
            for st, saved in zip(self.states, snap, strict=True):
                if st is not None:
                    st.copy_from(saved)
        elif self.recurrent and n == 0:
            self.reset_states()
        if self.recurrent and n < kv.length:  # later snapshots hold tokens the sequence no longer has
            for k in [k for k in self._snapshots if k > n]:
                del self._snapshots[k]
                self._periodic.discard(k)
        kv.truncate(n)

    def prepare(self, start: int, count: int) -> None:
        """Make positions ``start .. start + count - 1`` writable (:meth:`freetoken.models.kv.KVSequence.prepare`)."""
        self.kv.prepare(start, count)

    def resume_points(self) -> list[int]:
        """The lengths the sequence can be rolled back to without recomputing: any for a pure-attention model (this
        returns the current length), else 0, the snapshots' lengths and the current length."""
        if not self.recurrent:
            return [self.length]
        return sorted({0, self.length, *self._snapshots})

    def snapshot(self, limit: int, periodic: bool = False) -> None:
        """Keep a copy of the linear-attention states at the current length, up to ``limit`` copies (the oldest
        periodic one dropped first, else the oldest); nothing for a pure-attention model. ``periodic``: one of a long
        prompt's regular snapshots (:data:`freetoken.models.decoder.STATE_SNAPSHOT_EVERY`)."""
        n = self.length
        if not self.recurrent or n == 0 or limit < 1:
            return
        if n in self._snapshots:
            self._snapshots.move_to_end(n)
            for st, saved in zip(self.states, self._snapshots[n], strict=True):
                if st is not None:
                    saved.copy_from(st)
            if not periodic:
                self._periodic.discard(n)
            return
        while len(self._snapshots) >= limit:
            old = next((k for k in self._snapshots if k in self._periodic), next(iter(self._snapshots)))
            del self._snapshots[old]
            self._periodic.discard(old)
        self._snapshots[n] = [None if st is None else st.copy() for st in self.states]
        if periodic:
            self._periodic.add(n)

    @property
    def kept_snapshots(self) -> int:
        """How many snapshots of the linear-attention states the sequence holds now."""
        return len(self._snapshots)

    def export_states(self, length: int | None = None) -> dict[str, np.ndarray]:
        """Host copies of the linear-attention states at ``length`` tokens (default: the current length; else a
        kept snapshot's length), as ``{"conv.I": [K - 1, C], "rec.I": [Hv, Dk, Dv]}`` for each linear layer I: what
        the prefix caches and anchors keep to resume there. Empty for a pure-attention model. ValueError when the
        states at ``length`` are not kept."""
        n = self.length if length is None else int(length)
        if not self.recurrent:
            return {}
        if n == self.length:
            states = self.states
        elif n in self._snapshots:
            states = self._snapshots[n]
        else:
            raise ValueError(f"the linear-attention layers' state at {n} tokens is not kept (kept: "
                             f"{self.resume_points()})")
        out = {}
        for i, st in enumerate(states):
            if st is not None:  # copied once into new arrays (to_host without out= is the live array on cpu)
                for name, a in ((f"conv.{i}", st.conv), (f"rec.{i}", st.rec)):
                    out[name] = self.dev.to_host(a, out=np.empty(a.shape, np.float32))
        return out

    def import_states(self, arrays: dict[str, np.ndarray]) -> None:
        """Make :meth:`export_states`' arrays the live linear-attention states (the KV rows of the same prefix are
        the caller's to put in place: :meth:`freetoken.models.kv.KVSequence.adopt`); the snapshots go. ValueError
        naming the first array whose name, dtype or shape does not fit this model (nothing is changed then)."""
        want = {}
        for i, st in enumerate(self.states):
            if st is not None:
                want[f"conv.{i}"], want[f"rec.{i}"] = tuple(st.conv.shape), tuple(st.rec.shape)
        if set(arrays) != set(want):
            missing, extra = sorted(set(want) - set(arrays)), sorted(set(arrays) - set(want))
            raise ValueError(f"linear-attention states do not fit this model (missing {missing}, unexpected {extra})")
        for name, shape in want.items():
            a = arrays[name]
            if a.dtype != np.float32 or tuple(a.shape) != shape:
                raise ValueError(f"linear-attention state {name}: {a.dtype} {list(a.shape)}, this model holds "
                                 f"float32 {list(shape)}")
        self._snapshots.clear()
        self._periodic.clear()
        for i, st in enumerate(self.states):
            if st is not None:
                st.conv[...] = self.dev.asarray(arrays[f"conv.{i}"])
                st.rec[...] = self.dev.asarray(arrays[f"rec.{i}"])

    def state_bytes(self) -> int:
        """Bytes of the live linear-attention states (each snapshot costs as much)."""
        return sum(st.nbytes for st in self.states if st is not None)

    def reset_states(self) -> None:
        """Zero the live linear-attention states and forget the snapshots."""
        for st in self.states:
            if st is not None:
                st.reset()
        self._snapshots.clear()
        self._periodic.clear()

    def reset(self) -> None:
        """An empty sequence: every KV block back to the pool, the states zeroed, the snapshots gone."""
        self.kv.reset()
        self.reset_states()
