"""A stand-in for :class:`freetoken.models.decoder.MoeDecoder` that emits a fixed byte sequence whatever its input:
each forward pass's last row of logits points at the script's next byte (then at ``eos``). It keeps real KV
sequences in a one-value pool, so the step loop's scheduling and the prefix cache and anchors have blocks to hold,
and it speaks the decoder's interface the engine uses (its own sequence, new sequences, ``forward_batch``)."""

from types import SimpleNamespace

import numpy as np

from freetoken.device import get_device
from freetoken.models.kv import KVPool, KVSequence


class ScriptedSequence:
    """A sequence's KV rows (:class:`KVSequence`) with the interface of a DecoderSequence the engine uses."""

    def __init__(self, pool: KVPool, ctx: int):
        self.kv = KVSequence(pool, ctx)

    @property
    def capacity(self):
        return self.kv.capacity

    @property
    def length(self):
        return self.kv.length

    @length.setter
    def length(self, n):
        if n != self.kv.length:
            self.kv.truncate(n)

    def prepare(self, start, count):
        self.kv.prepare(start, count)

    def reset(self):
        self.kv.reset()

    def resume_points(self):
        return list(range(self.length + 1))


class ScriptedDecoder:
    """``replay``: :meth:`reset` starts the script again (else it goes on where it was)."""

    def __init__(self, script: bytes, eos: int = 0, ctx: int = 1000, replay: bool = False):
        self.script, self.eos, self.i, self.replay = list(script), eos, 0, replay
        self.pool = KVPool(get_device("cpu"), 1, 1, 1, 16, "f32")
        self.max_ctx = min(int(ctx), self.pool.tokens)
        self.prefill_chunk, self.recurrent, self.snapshot_every, self.max_snapshots = 256, False, 0, 0
        self.dev = get_device("cpu")
        self.cfg = SimpleNamespace(script=bytes(script), vocab_size=256)
        self.embed = np.zeros((256, 1), np.float32)
        self.experts = SimpleNamespace(formats_name=lambda: "none", last_routing=[])
        self.seq = self.new_sequence()

    @property
    def ctx(self):
        return self.max_ctx

    @ctx.setter
    def ctx(self, n):
        self.max_ctx = int(n)

    @property
    def kv(self):
        return self.seq.kv

    @property
    def length(self):
        return self.seq.length

    @length.setter
    def length(self, n):
        self.seq.length = n

    def new_sequence(self):
        return ScriptedSequence(self.pool, self.max_ctx)

    def resume_points(self):
        return self.seq.resume_points()

    def reset(self):
        self.seq.reset()
        if self.replay:
            self.i = 0

    def _append(self, seq, ids):
        seq.prepare(seq.length, len(ids))
        seq.kv.length += len(ids)
        tok = self.script[self.i] if self.i < len(self.script) else self.eos
        self.i += 1
        logits = np.full((len(ids), 256), -10.0, np.float32)
        logits[-1, tok] = 10.0
        return logits

    def forward_batch(self, work):
        return np.stack([self._append(seq, ids)[-1] for seq, ids in work])

    def forward(self, ids, last_only=False):
        logits = self._append(self.seq, ids)
        return logits[-1:] if last_only else logits
