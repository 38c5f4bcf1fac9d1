"""The step loop's policy: which sequences the next forward pass holds, and how many of each one's tokens.

Continuous batching as vLLM's V1 engine and SGLang schedule it: a step is one forward pass over the next token of
every running sequence that is decoding and chunks of the prompts still being prefilled, at most ``step_tokens``
tokens in all, so a long prompt is cut into chunks that share steps with the running streams instead of stalling
them, and a request that arrives is admitted at the next step that has room (FIFO, at most ``max_seqs`` running).
One step then reads each routed expert once for every sequence in it.

KV blocks come from one :class:`freetoken.models.kv.KVPool`: each sequence holds a
:class:`freetoken.models.kv.KVSequence` (its block table; blocks shared with the prefix cache or other sequences by
reference count, copied on the first divergent write). When a step's tokens need more blocks than the pool has
free (after its reclaimers, the prefix cache's eviction, gave back what they could), the newest running sequence is
preempted: its blocks go back (or to whoever else holds them) and it waits at the head of the queue to be
recomputed from its prompt and the tokens it already produced. A sequence that cannot get its blocks while running
alone does not fit the pool at all: it finishes with ``finish_reason`` ``"kv"`` rather than waiting forever.

With ``share_prefills`` (an engine that reuses prompt rows through a prefix cache), a waiting sequence whose prompt
shares at least half of itself with the prompt of a running sequence that is still being prefilled waits until
that prefill is done, then adopts the shared rows instead of computing them a second time beside it (two agents
starting at once from the same system prompt, say). It waits behind one prefill at most: an unrelated request
sharing only a template's first tokens is not held.

The scheduler holds policy and bookkeeping only: :meth:`Scheduler.schedule` returns a :class:`StepPlan`, the
caller runs the forward pass it describes (writing rows ``chunk.start ..`` of each chunk's sequence) and hands the
sampled tokens to :meth:`Scheduler.finish_step`, which returns the sequences that ended.
"""

from __future__ import annotations

import enum
import itertools
from collections import deque
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field

from freetoken.models.kv import KVPool, KVSequence, OutOfKVBlocks
from freetoken.models.sequence import DecoderSequence


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


_numbers = itertools.count()


@dataclass(eq=False)
class Sequence:
    """One request's tokens: its ``prompt``, the ``output`` sampled so far, and ``kv``, the rows written so far
    (``kv.length`` of ``tokens``: a :class:`KVSequence`, or the engine's
    :class:`freetoken.models.sequence.DecoderSequence`; anything with ``length``, ``prepare`` and ``reset``);
    ``max_tokens`` outputs at most (0: the prompt only runs, for its rows; the sequence ends with ``"length"``
    once it has). ``arrival`` orders sequences (FIFO admission, newest preempted first)."""

    prompt: list[int]
    max_tokens: int
    stop_ids: Collection[int] = ()
    output: list[int] = field(default_factory=list)
    kv: KVSequence | DecoderSequence | None = None
    status: Status = Status.WAITING
    #: "stop" (a stop id), "length" (max_tokens), "context" (no position left), "kv" (its blocks do not fit the
    #: pool even alone), "aborted"; None while it runs
    finish_reason: str | None = None
    preemptions: int = 0
    arrival: int = field(default_factory=lambda: next(_numbers))
    #: positions at which a chunk must end (sorted): where the engine keeps a model's linear-attention states (a
    #: recurrent state holds the sequence at one length only, so it is copied between two chunks)
    cuts: tuple[int, ...] = ()

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    @property
    def length(self) -> int:
        """Tokens in all, prompt and output."""
        return len(self.prompt) + len(self.output)

    def ids(self, start: int, stop: int) -> list[int]:
        """``tokens[start:stop]`` without joining the whole history (a decode step takes one token of it)."""
        p = len(self.prompt)
        return self.prompt[start:stop] + self.output[max(start - p, 0):max(stop - p, 0)]

    @property
    def computed(self) -> int:
        """Tokens whose K/V rows are written."""
        return 0 if self.kv is None else self.kv.length

    @property
    def pending(self) -> int:
        """Tokens still to feed before the next one can be sampled (1 while decoding)."""
        return self.length - self.computed

    def clip(self, n: int) -> int:
        """``n`` tokens from :attr:`computed` on, or fewer: up to the first of :attr:`cuts` inside them."""
        start = self.computed
        return next((c - start for c in self.cuts if start < c < start + n), n)


@dataclass(frozen=True)
class Chunk:
    """Tokens ``ids`` of ``seq`` fed at positions ``start ..``; ``samples``: they end at its last token, so a token
    is sampled from the last one's logits (False: a prompt chunk with more to come)."""

    seq: Sequence
    start: int
    ids: list[int]
    samples: bool


@dataclass
class StepPlan:
    """One forward pass: ``chunks`` (decodes first, then prompt chunks, running sequences in arrival order), and the
    sequences ``preempted`` to make room for it."""

    chunks: list[Chunk]
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def tokens(self) -> int:
        return sum(len(c.ids) for c in self.chunks)

    @property
    def sampling(self) -> list[Sequence]:
        return [c.seq for c in self.chunks if c.samples]


class Scheduler:
    """Admits, batches and preempts sequences over ``pool`` (see the module doc). ``ctx``: positions a sequence may
    hold; ``step_tokens``: the token budget of one step (at least ``max_seqs``, so every running sequence decodes
    each step); ``max_seqs``: sequences running at once. ``attach(seq)``, called when a sequence is admitted (again,
    after a preemption), may give it a :class:`KVSequence` that already holds a prefix (the prefix cache's blocks);
    by default it gets an empty one. ``detach(seq)``, called when a sequence ends or is preempted, disposes of its
    blocks (default: released; an engine hands them to its prefix cache first)."""

    def __init__(self, pool: KVPool, ctx: int, step_tokens: int, max_seqs: int,
                 attach: Callable[[Sequence], None] | None = None,
                 detach: Callable[[Sequence], None] | None = None, share_prefills: bool = False):
        if max_seqs < 1:
            raise ValueError(f"max_seqs must be >= 1, got {max_seqs}")
        if step_tokens < max_seqs:
            raise ValueError(f"step_tokens ({step_tokens}) must hold one decode token of each of the max_seqs "
                             f"({max_seqs}) running sequences")
        self.pool, self.ctx = pool, int(ctx)
        self.step_tokens, self.max_seqs = int(step_tokens), int(max_seqs)
        self._attach = attach or (lambda seq: setattr(seq, "kv", KVSequence(self.pool, self.ctx)))
        self._detach = detach or (lambda seq: seq.kv.reset())
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.preemptions = 0
        self.share_prefills = share_prefills

    # ---- requests --------------------------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        """Queue ``seq`` (ValueError when its prompt is empty or longer than the context)."""
        if not seq.prompt:
            raise ValueError("a sequence needs at least one prompt token")
        if len(seq.prompt) > self.ctx:
            raise ValueError(f"the prompt has {len(seq.prompt)} tokens; the context holds {self.ctx}")
        if seq.max_tokens < 0:
            raise ValueError(f"max_tokens must be >= 0, got {seq.max_tokens}")
        seq.status = Status.WAITING
        self.waiting.append(seq)

    def abort(self, seq: Sequence, reason: str = "aborted") -> None:
        """End ``seq`` now, waiting or running, with ``finish_reason`` ``reason`` (default: a client that left; the
        engine's "stop" for a grammar that is complete); its blocks go back."""
        if seq.status is Status.FINISHED:
            return
        if seq in self.waiting:
            self.waiting.remove(seq)
        if seq in self.running:
            self.running.remove(seq)
        self._end(seq, reason)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- one step --------------------------------------------------------------------------------------------
    def schedule(self) -> StepPlan:
        """The next step: the running sequences' tokens (each decodes, or takes the next chunk of its prompt, in
        arrival order, while the budget lasts), then waiting sequences admitted in order while the budget, the
        ``max_seqs`` cap and the pool allow. No admission in a step that had to preempt."""
        plan = StepPlan(chunks=[])
        # decodes first (each needs one token), so a prompt chunk never starves a stream of its step; a preemption
        # voids the victim's chunk, so the budget left is counted from the plan each time
        for seq in sorted(self.running, key=lambda s: (s.pending > 1, s.arrival)):
            budget = self.step_tokens - plan.tokens
            if seq.status is not Status.RUNNING or budget == 0:
                continue
            n = seq.clip(min(seq.pending, budget))
            if self._reserve(seq, n, plan):
                plan.chunks.append(self._chunk(seq, n))
        while (self.waiting and self.step_tokens > plan.tokens and len(self.running) < self.max_seqs
               and not plan.preempted):
            seq = self.waiting[0]
            if self.share_prefills and self._shares_a_prefill(seq):
                break  # admitted once that prompt's rows are computed (and in the engine's prefix cache)
            try:  # (attach may allocate too: the engine copies a shared, partly filled last block of a prefix)
                self._attach(seq)
                n = seq.clip(min(seq.pending, self.step_tokens - plan.tokens))
                seq.kv.prepare(seq.computed, n)
            except OutOfKVBlocks:
                self._drop_kv(seq)
                if not self.running:  # alone and still short: it never fits
                    self.waiting.popleft()
                    self._end(seq, "kv")
                    continue
                break  # it waits until a running sequence ends
            self.waiting.popleft()
            seq.status = Status.RUNNING
            self.running.append(seq)
            plan.chunks.append(self._chunk(seq, n))
        return plan

    def finish_step(self, plan: StepPlan, sampled: Mapping[Sequence, int]) -> list[Sequence]:
        """Account a step run as ``plan`` said: each chunk's rows are written, and each sampling sequence gets its
        token from ``sampled`` (none for a sequence of ``max_tokens`` 0: it ends once its prompt has run). Returns
        the sequences that ended (their ``finish_reason`` set, blocks given back)."""
        ended = []
        for chunk in plan.chunks:
            seq = chunk.seq
            if seq.status is not Status.RUNNING:  # aborted while the step ran
                continue
            seq.kv.length = chunk.start + len(chunk.ids)
            if not chunk.samples:
                continue
            if seq.max_tokens == 0:
                self.running.remove(seq)
                self._end(seq, "length")
                ended.append(seq)
                continue
            token = int(sampled[seq])
            seq.output.append(token)
            reason = ("stop" if token in seq.stop_ids else "length" if len(seq.output) >= seq.max_tokens
                      else "context" if seq.length > self.ctx else None)
            if reason is not None:
                self.running.remove(seq)
                self._end(seq, reason)
                ended.append(seq)
        return ended

    # ---- internals -------------------------------------------------------------------------------------------
    def _shares_a_prefill(self, seq: Sequence) -> bool:
        """Whether a running sequence is still prefilling a prompt that starts with at least half of ``seq``'s
        (see the module doc)."""
        want = len(seq.prompt)
        for r in self.running:
            if r.computed >= len(r.prompt) or r.prompt[0] != seq.prompt[0]:
                continue
            half = -(-want // 2)
            if len(r.prompt) >= half and r.prompt[:half] == seq.prompt[:half]:
                return True
        return False

    def _chunk(self, seq: Sequence, n: int) -> Chunk:
        start = seq.computed
        return Chunk(seq, start, seq.ids(start, start + n), samples=start + n == seq.length)

    def _reserve(self, seq: Sequence, n: int, plan: StepPlan) -> bool:
        """Blocks for ``n`` more tokens of running ``seq``, preempting the newest running sequences while short;
        False when ``seq`` itself was preempted (or ended: it does not fit alone)."""
        while True:
            try:
                seq.kv.prepare(seq.computed, n)
                return True
            except OutOfKVBlocks:
                victim = max(self.running, key=lambda s: s.arrival)
                if victim is seq and len(self.running) == 1:
                    self.running.remove(seq)
                    self._end(seq, "kv")
                    return False
                self._preempt(victim, plan)
                if victim is seq:
                    return False

    def _preempt(self, seq: Sequence, plan: StepPlan) -> None:
        self.running.remove(seq)
        self._drop_kv(seq)
        seq.status = Status.WAITING
        seq.preemptions += 1
        self.preemptions += 1
        # the head of the queue, ahead of later arrivals, behind sequences preempted earlier that arrived earlier
        at = next((i for i, w in enumerate(self.waiting) if w.arrival > seq.arrival), len(self.waiting))
        self.waiting.insert(at, seq)
        plan.preempted.append(seq)
        # a chunk this step already planned for it is void
        plan.chunks[:] = [c for c in plan.chunks if c.seq is not seq]

    def _drop_kv(self, seq: Sequence) -> None:
        """Hand ``seq``'s blocks to ``detach`` and forget them (a later admission attaches anew)."""
        if seq.kv is not None:
            self._detach(seq)
            seq.kv = None

    def _end(self, seq: Sequence, reason: str) -> None:
        seq.status = Status.FINISHED  # before detach: it may keep the rows of a sequence that ended
        seq.finish_reason = reason
        self._drop_kv(seq)
