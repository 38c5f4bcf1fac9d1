"""The step loop: many generation requests share each forward pass (continuous batching).

A :class:`StepLoop` holds a :class:`~freetoken.engine.batching.scheduler.Scheduler` over the model's KV pool and runs
each step it plans as one :meth:`~freetoken.models.decoder.MoeDecoder.forward_batch`: the decode token of every running
request and chunks of the prompts being prefilled, so the routed experts of a layer are read once for all of them.
Each request keeps its own sampler (parameters, seed, grammar) and stop ids; :meth:`StepLoop.step` returns what each
request produced in that step as values (:class:`StepEvent`), and a request's tokens and end are on its
:class:`Request`.

KV reuse as ``Model.generate`` does it (``Model.adopt_prefix``): a request admitted adopts the longest prefix of its
tokens that the radix prefix cache holds, or an anchor (the one it names, or the longest at one of its message
boundaries, verified) when that holds more; once its prompt has run, the prompt's full blocks enter the prefix cache
(a request arriving meanwhile with the same start shares them) and anchors are made at its boundaries; a sequence
that ends or is preempted leaves all its rows in the prefix cache (``Model.retire_sequence``; a preempted one
usually finds them again when it is readmitted).

A model with linear-attention layers (Qwen3-Next, Qwen3.5) resumes only where their recurrent states were kept as
well, since a state holds the sequence at one length: a request's prompt chunks end at its message boundaries and
every ``decoder.snapshot_every`` tokens (the scheduler's ``cuts``), the states are copied there and at the prompt's
end (the sequence's snapshots; at a boundary also for its anchor), and a sequence that leaves puts them, with its
current length's, into the model's state cache, where the next request of the conversation (or the sequence itself,
readmitted after a preemption) finds them beside the prefix cache's KV rows.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Collection, Iterable
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

import numpy as np

from freetoken.engine.batching.scheduler import Scheduler, Sequence, Status
from freetoken.engine.decoding.sampling import Sampler, SamplingParams
from freetoken.engine.decoding.stats import GenerationStats

#: Running sequences at once unless told otherwise.
DEFAULT_MAX_SEQS = 16
#: Upper bounds of the step histograms' buckets (the last bucket takes everything above): sequences in a step, and
#: tokens in a step.
BATCH_SIZE_BOUNDS = (1, 2, 4, 8, 16, 32, 64)
STEP_TOKEN_BOUNDS = (1, 4, 16, 64, 256, 1024, 4096)


@dataclass
class StepStats:
    """What the loop's steps held, in constant space (a server runs for days): steps run, their tokens and
    sequences, the largest step, and per-bucket counts of sequences per step and tokens per step (bucket ``i``:
    values up to ``BOUNDS[i]`` and above the one before; the last bucket: above every bound)."""

    steps: int = 0
    tokens: int = 0
    sequences: int = 0
    most_tokens: int = 0
    batch_sizes: list[int] = field(default_factory=lambda: [0] * (len(BATCH_SIZE_BOUNDS) + 1))
    step_tokens: list[int] = field(default_factory=lambda: [0] * (len(STEP_TOKEN_BOUNDS) + 1))

    def record(self, sequences: int, tokens: int) -> None:
        self.steps += 1
        self.tokens += tokens
        self.sequences += sequences
        self.most_tokens = max(self.most_tokens, tokens)
        self.batch_sizes[bisect_left(BATCH_SIZE_BOUNDS, sequences)] += 1
        self.step_tokens[bisect_left(STEP_TOKEN_BOUNDS, tokens)] += 1


@dataclass(eq=False)
class Request:
    """One generation request in the loop: its scheduler ``seq`` (prompt, output, finish reason), ``sampler``, the
    ``anchor`` it asks to resume from and its message ``boundaries`` (anchors looked up and made there), and
    ``stats`` (as ``Model.generate`` keeps them: prompt tokens prefilled and reused, anchors used, refused and made,
    tokens generated, the finish reason)."""

    seq: Sequence
    sampler: Sampler
    anchor: object = None
    boundaries: Seq[int] = ()
    stats: GenerationStats = field(default_factory=GenerationStats)
    #: the caller's own sequence (``Model.generate``'s: the decoder's), holding the prefix its caller reused; it is
    #: attached as it is and keeps its rows when the request ends (None: the loop makes one and retires it)
    sequence: object = None
    #: the prompt's full blocks go into the prefix cache once it has run
    share: bool = True
    prompt_ran: bool = False  # its prompt has run once (the cache and anchors had what they take of it)
    #: with linear-attention layers: the states at each boundary the prompt has reached, for the anchors made there
    states_at: dict = field(default_factory=dict)

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens whose K/V rows were reused (prefix cache or anchor) when the request was first admitted."""
        return self.stats.cached_tokens

    @property
    def output(self) -> list[int]:
        return self.seq.output

    @property
    def finished(self) -> bool:
        return self.seq.status is Status.FINISHED

    @property
    def finish_reason(self) -> str | None:
        return self.seq.finish_reason


@dataclass(frozen=True)
class StepEvent:
    """What one step gave ``request``: a new ``token`` (None when it only ended), and ``finish_reason`` when it
    ended in this step (``"stop"``, ``"length"``, ``"context"``, ``"kv"``)."""

    request: Request
    token: int | None
    finish_reason: str | None


class StepLoop:
    """Runs requests on ``model`` (a :class:`freetoken.engine.generation.generate.Model`) in batched steps.

    ``max_seqs``: requests running at once (the rest wait, first come first served); ``step_tokens``: tokens in one
    forward pass (default: the decoder's prompt chunk, which its activation buffers are sized for, and at least
    ``max_seqs``); ``reuse``: share K/V rows through the model's prefix cache (see the module doc). The loop owns
    the sequences it makes in the decoder's pool; the decoder's own sequence (``Model.generate``'s) is left alone
    but shares the pool's blocks."""

    def __init__(self, model, max_seqs: int = DEFAULT_MAX_SEQS, step_tokens: int | None = None, reuse: bool = True):
        dec = model.decoder
        if dec.pool is None:
            raise RuntimeError("the model's decoder has no KV pool yet")
        self.model, self.decoder = model, dec
        self.cache = model.prefix_cache if reuse else None
        self.recurrent = bool(dec.recurrent)
        step_tokens = max(dec.prefill_chunk, max_seqs) if step_tokens is None else int(step_tokens)
        self.scheduler = Scheduler(dec.pool, dec.max_ctx, step_tokens, max_seqs, attach=self._attach,
                                   detach=self._detach, share_prefills=self.cache is not None)
        self.requests: dict[Sequence, Request] = {}
        self.stats = StepStats()

    def _attach(self, seq: Sequence) -> None:
        req = self.requests[seq]
        seq.kv = self.decoder.new_sequence() if req.sequence is None else req.sequence
        if seq.preemptions:  # recomputed: whatever of it the prefix caches still hold
            if self.cache is not None:
                self.model.adopt_prefix(seq.kv, seq.tokens, None, (), GenerationStats())
            return
        st = req.stats
        if self.cache is not None and req.sequence is None:
            self.model.adopt_prefix(seq.kv, seq.prompt, req.anchor, req.boundaries, st)
        st.cached_tokens = seq.computed
        st.prompt_tokens = len(seq.prompt) - seq.computed
        if self.recurrent and seq.computed in req.boundaries:  # the anchor there takes the states at hand
            req.states_at[seq.computed] = seq.kv.export_states()

    def _detach(self, seq: Sequence) -> None:
        req = self.requests.get(seq)
        if req is not None and req.sequence is not None and seq.status is Status.FINISHED:
            return  # the caller's own sequence keeps the rows it ran
        if self.cache is not None:
            self.model.retire_sequence(seq.kv, seq.tokens)
        seq.kv.reset()

    def submit(self, prompt: Iterable[int], max_tokens: int, sampling: SamplingParams | None = None,
               constraint=None, stop_ids: Collection[int] | None = None, anchor=None,
               boundaries: Seq[int] = (), sequence=None, share: bool = True,
               stats: GenerationStats | None = None) -> Request:
        """Queue a request: ``prompt`` token ids, at most ``max_tokens`` new ones, its own ``sampling`` parameters
        and seed, a :class:`freetoken.engine.decoding.grammar.TokenConstraint` (the request ends when its grammar is
        complete), ``stop_ids`` (default: the model's end-of-sequence ids), an ``anchor`` to resume from and the
        prompt's message ``boundaries`` (see the module doc). ``max_tokens`` 0: the prompt runs (its rows, the
        cache's share of them, its anchors) and nothing is sampled.

        ``sequence``: the caller's own :class:`freetoken.models.sequence.DecoderSequence`, holding a prefix of
        ``prompt`` that the caller reused itself (``Model.generate``: the decoder's sequence, resumed where its last
        request left it); the request runs on it (no prefix of the cache adopted, ``anchor`` ignored) and leaves its
        rows in it when it ends (preempted, it is emptied and recomputed like any other). ``share``: the prompt's
        full blocks enter the prefix cache once it has run. ``stats``: the object to fill in (default a new one).
        ValueError for an empty prompt, one longer than the context, or ``max_tokens`` < 0."""
        ids = [int(i) for i in prompt]
        vocab = self.decoder.cfg.vocab_size
        if any(not 0 <= i < vocab for i in ids):
            raise ValueError(f"token ids must be in [0, {vocab})")
        stop = set(self.model.eos_ids if stop_ids is None else (int(i) for i in stop_ids))
        marks = sorted({int(b) for b in boundaries if 0 < int(b) <= len(ids)})
        seq = Sequence(ids, int(max_tokens), stop_ids=stop)
        if self.recurrent and self.cache is not None:  # where the states are kept (see the module doc)
            every = self.decoder.snapshot_every
            periodic = range(every, len(ids), every) if every > 0 else ()
            seq.cuts = tuple(sorted({*(b for b in marks if b < len(ids)), *periodic}))
        self.scheduler.add(seq)
        req = Request(seq, Sampler(sampling, constraint), anchor, marks, GenerationStats() if stats is None else stats,
                      sequence, share)
        req.stats.prompt_tokens = len(ids)
        self.requests[seq] = req
        return req

    def abort(self, request: Request) -> None:
        """End ``request`` now (its client left): dropped from the queue, or out of the next step; blocks back."""
        self.scheduler.abort(request.seq)
        self.requests.pop(request.seq, None)

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    @property
    def steps(self) -> int:
        return self.stats.steps

    @property
    def preemptions(self) -> int:
        """Sequences preempted (their blocks given back to make room; recomputed when readmitted)."""
        return self.scheduler.preemptions

    @property
    def running(self) -> int:
        return len(self.scheduler.running)

    @property
    def waiting(self) -> int:
        return len(self.scheduler.waiting)

    def step(self) -> list[StepEvent]:
        """Run one step: schedule, one forward pass over its chunks, a token sampled for every request whose chunk
        ends at its last token. Returns the step's events (empty when there was nothing to run)."""
        sch = self.scheduler
        plan = sch.schedule()
        events = [StepEvent(self.requests.pop(seq), None, seq.finish_reason)
                  for seq in list(self.requests) if seq.status is Status.FINISHED]  # ended while scheduling ("kv")
        if not plan.chunks:
            return events
        logits = self.decoder.forward_batch([(c.seq.kv, np.asarray(c.ids, np.int64)) for c in plan.chunks])
        self.stats.record(len(plan.chunks), plan.tokens)
        if self.recurrent and self.cache is not None:
            self._keep_states(plan)
        sampled, done, prompt_ends = {}, [], []
        for row, chunk in enumerate(plan.chunks):
            if not chunk.samples:
                continue
            req = self.requests[chunk.seq]
            if self.cache is not None and not req.prompt_ran:  # (without a cache nothing is kept of a prompt)
                prompt_ends.append(req)
            if chunk.seq.max_tokens == 0:  # the prompt only
                continue
            sampled[chunk.seq] = req.sampler(logits[row], chunk.seq.tokens)
            constraint = req.sampler.constraint
            if constraint is not None and constraint.finished:
                done.append(chunk.seq)
        for req in prompt_ends:
            self._prompt_done(req)
        finished = sch.finish_step(plan, sampled)
        for seq in finished:
            if seq not in sampled:  # max_tokens 0: ended with its prompt, no token
                req = self.requests.pop(seq)
                req.stats.finish_reason = seq.finish_reason
                events.append(StepEvent(req, None, seq.finish_reason))
        ended = set(finished)
        for seq in done:  # a complete grammar ends its request like a stop token
            if seq not in ended:
                sch.abort(seq, reason="stop")
                ended.add(seq)
        for seq, tok in sampled.items():
            req = self.requests[seq] if seq not in ended else self.requests.pop(seq)
            req.stats.generated_tokens = len(seq.output)
            if seq in ended:
                req.stats.finish_reason = seq.finish_reason
            events.append(StepEvent(req, tok, seq.finish_reason if seq in ended else None))
        return events

    def _keep_states(self, plan) -> None:
        """Copies of the linear-attention states of each sequence whose chunk ended at one of its cuts or at the end
        of its prompt (its snapshots, for the state cache when it leaves); at a message boundary also for the anchor
        made there."""
        for chunk in plan.chunks:
            seq, req = chunk.seq, self.requests[chunk.seq]
            end = chunk.start + len(chunk.ids)
            prompt_end = end == len(seq.prompt) and not req.prompt_ran
            if end in seq.cuts or prompt_end:
                marked = prompt_end or end in req.boundaries
                seq.kv.snapshot(self.decoder.max_snapshots, periodic=not marked)
                if end in req.boundaries and not req.prompt_ran:
                    req.states_at[end] = seq.kv.export_states()

    def _prompt_done(self, req: Request) -> None:
        """The prompt's full blocks into the prefix cache (for requests that share its start meanwhile), anchors at
        its boundaries (with linear-attention layers, with the states kept there; a boundary inside the reused
        prefix has none at hand: an anchor there already is reported instead)."""
        req.prompt_ran = True
        seq, bs = req.seq, self.cache.block_size
        if req.share and len(seq.prompt) >= bs:
            self.cache.insert(seq.prompt, seq.kv.kv.blocks, len(seq.prompt) // bs * bs)
        model = self.model
        for b in req.boundaries:
            states = req.states_at.get(b) if self.recurrent else None
            if self.recurrent and states is None:
                have = model.anchors.best_prefix(seq.prompt, [b])
                if have is not None:
                    req.stats.anchors_made.append(have)
                continue
            req.stats.anchors_made.append(model.anchors.create(seq.kv.kv, seq.prompt, b, residency=model._residency(),
                                                               states=states).id)
        req.states_at = {}

    def run(self) -> list[StepEvent]:
        """Step until every request has ended; all the events in order."""
        events = []
        while self.has_work:
            events.extend(self.step())
        return events
