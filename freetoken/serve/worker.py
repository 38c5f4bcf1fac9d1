"""The one sequence engine behind the server: a worker thread that owns the model and runs queued jobs in order.

The product is single-session and interactive: one sequence at a time, and its KV cache is reused from request to
request (``reuse_cache``: an agent's next request repeats the conversation so far, so only its new tail is
prefilled). A job's text pieces reach the request's asyncio task through an ``asyncio.Queue`` fed with
``call_soon_threadsafe``. A job whose client went away is cancelled: a waiting one is dropped, a running one stops
after the token it is on, so the engine is free within one decode step.

A job may instead carry a ``task``: a function of the model run in the queue's order (the anchor routes list and
delete anchors this way, so that only this thread touches the model and its anchor store).
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from freetoken.engine.decoding.sampling import SamplingParams
from freetoken.engine.generation.chat import model_template

#: Finish reasons of :class:`freetoken.engine.generation.generate.GenerationStats` -> the OpenAI API's
FINISH_REASONS = {"stop": "stop", "length": "length", "context": "length"}


@dataclass
class Outcome:
    """What a finished job reports (the usage block, the finish reason, the timings)."""

    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    finish_reason: str  # "stop" or "length"
    prefill_tps: float
    decode_tps: float
    seconds_to_first_token: float
    hit_rate: float | None  # the expert cache's over this job's decode steps (None: no cache, or no decode step)
    stop_sequence: str | None = None  # the stop string that ended the text (None: another reason did)
    anchor: str | None = None  # the anchor the prompt's start was restored from (its id)
    anchor_refused: str | None = None  # why the anchor asked for (or found at a boundary) was not used
    anchors_made: list[dict] = field(default_factory=list)  # Anchor.info() of those made at the job's boundaries
    anchors_new: int = 0  # how many of them were not there before (the rest were there already, and reused)
    max_tokens: int = 0  # the completion's limit: what the request asked for, or what the context left
    requested_max_tokens: int | None = None  # what the request asked for, where the context left less


@dataclass
class Job:
    """One request's generation: token ids in, text pieces and then an :class:`Outcome` (or an error) out."""

    ids: list[int]
    max_tokens: int
    sampling: SamplingParams
    stop: list[str]
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    number: int = 0
    enqueued: float = field(default_factory=time.perf_counter)
    constraint: object = None  # a freetoken.engine.decoding.grammar.TokenConstraint the reply must follow (or None)
    anchor: str | None = None  # an anchor id to resume from (refused or unknown: recomputed)
    boundaries: list[int] = field(default_factory=list)  # prompt positions to make (and look up) anchors at
    task: Callable | None = None  # instead of generating: ``task(model)``, its result the "done" value
    requested_max_tokens: int | None = None  # the request's max_tokens where the context left less (max_tokens)

    def post(self, kind: str, value) -> None:
        """From the worker thread: hand ``(kind, value)`` to the request's task ("text", "done" or "error")."""
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, value))
        except RuntimeError:  # the loop is closed (the server is shutting down): nobody is listening
            pass


class EngineWorker:
    """Runs :class:`Job` s on ``model`` one at a time, first come first served, on a daemon thread.

    ``on_finish(job, outcome_or_None, error_or_None)`` is called on the worker thread after each job (metrics).

    ``script`` (tests): replies to give instead of generating, one per job in order, streamed a few characters at a
    time, so that what the server makes of a reply (tool calls, stop strings) is checked on exact text."""

    SCRIPT_PIECE = 3  # characters per streamed piece of a scripted reply

    def __init__(self, model, on_finish=None, script: list[str] | None = None):
        self.model = model
        self.template = model_template(model)  # compiled once: every request renders through it
        self.end_of_turn = self.template.stop_strings()  # (renders a probe conversation: once, not per request)
        self.on_finish = on_finish
        self.script = deque(script or ())
        self._waiting: deque[Job] = deque()
        self._cv = threading.Condition()
        self._running: Job | None = None
        self._closed = False
        self._numbers = itertools.count(1)
        self._lltokenizer = None
        self._lltokenizer_lock = threading.Lock()
        self.counters: dict[str, int] = dict(model.experts.counters())  # a snapshot, taken between jobs
        self._thread = threading.Thread(target=self._loop, name="freetoken-engine", daemon=True)
        self._thread.start()

    # ---- the request side ---------------------------------------------------------------------------------
    def submit(self, job: Job) -> Job:
        with self._cv:
            if self._closed:
                raise RuntimeError("the engine is shut down")
            job.number = next(self._numbers)
            self._waiting.append(job)
            self._cv.notify()
        return job

    def cancel(self, job: Job) -> None:
        """The client went away: drop the job if it waits, stop it after its current token if it runs (the batching
        worker: before its next step)."""
        job.cancelled.set()
        with self._cv:
            try:
                self._waiting.remove(job)
            except ValueError:
                return
        self._finished(job, None, None)

    def constraint(self, grammar: str):
        """A fresh :class:`freetoken.engine.decoding.grammar.TokenConstraint` of ``grammar`` over the model's
        tokenizer (GrammarError for a grammar llguidance refuses); the tokenizer's llguidance view is built once."""
        from freetoken.engine.decoding.grammar import TokenConstraint, grammar_tokenizer

        with self._lltokenizer_lock:
            if self._lltokenizer is None:
                m = self.model
                self._lltokenizer = grammar_tokenizer(m.tokenizer, m.eos_ids, m.config.vocab_size)
        return TokenConstraint(self._lltokenizer, grammar, self.model.config.vocab_size)

    def queue(self) -> list[Job]:
        """The waiting jobs, next first (the running one is not among them)."""
        with self._cv:
            return list(self._waiting)

    @property
    def running(self) -> Job | None:
        return self._running

    @property
    def running_jobs(self) -> int:
        """Jobs being generated for now (0 or 1 here; the batching worker runs several)."""
        return 0 if self._running is None else 1

    def close(self) -> None:
        with self._cv:
            self._closed = True
            waiting, self._waiting = list(self._waiting), deque()
            self._cv.notify()
        for job in waiting:
            job.cancelled.set()
            job.post("error", RuntimeError("the server is shutting down"))
        if self._running is not None:
            self._running.cancelled.set()
        self._thread.join(timeout=30)

    # ---- the worker thread --------------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._waiting and not self._closed:
                    self._cv.wait()
                if self._closed:
                    return
                job = self._running = self._waiting.popleft()
            try:
                self._run(job)
            finally:
                self._running = None

    def _run(self, job: Job) -> None:
        if job.task is not None:
            try:
                job.post("done", job.task(self.model))
            except Exception as e:  # noqa: BLE001 - the request gets the error, the server goes on
                job.post("error", e)
            return
        if self.script:
            self._run_script(job, self.script.popleft())
            return
        model = self.model
        experts = model.experts
        hits_before = _hits(experts)
        store = getattr(model, "anchors", None)  # (a stand-in engine may have none)
        anchors_before = set(store.anchors) if store is not None else set()
        first = None
        try:
            pieces = model.generate_text(job.ids, job.max_tokens, job.sampling, reuse_cache=True, stop=job.stop,
                                         constraint=job.constraint, anchor=job.anchor, boundaries=job.boundaries,
                                         should_stop=job.cancelled.is_set)
            for piece in pieces:
                if first is None:
                    first = time.perf_counter()
                job.post("text", piece)
        except Exception as e:  # the model refused the job (or broke): the client gets an error, the server goes on
            self.counters = dict(experts.counters())
            job.post("error", e)
            self._finished(job, None, e)
            return
        st = pieces.stats
        self.counters = dict(experts.counters())
        if job.cancelled.is_set() and st.finish_reason is None:
            self._finished(job, None, None)
            return
        hits_after = _hits(experts)
        rate = None
        if hits_before is not None and hits_after is not None:
            h, m = hits_after[0] - hits_before[0], hits_after[1] - hits_before[1]
            rate = h / (h + m) if h + m else None
        now = time.perf_counter()
        outcome = Outcome(prompt_tokens=len(job.ids), cached_tokens=st.cached_tokens,
                          completion_tokens=st.generated_tokens,
                          finish_reason=FINISH_REASONS.get(st.finish_reason or "stop", "stop"),
                          prefill_tps=st.prefill_tps, decode_tps=st.decode_tps,
                          seconds_to_first_token=(first or now) - job.enqueued, hit_rate=rate,
                          stop_sequence=st.stop_sequence, anchor=st.anchor, anchor_refused=st.anchor_refused,
                          max_tokens=job.max_tokens, requested_max_tokens=job.requested_max_tokens)
        for aid in st.anchors_made:
            a = model.anchors.get(aid)
            if a is not None:  # (one made early in the call may have been dropped already: the store's budgets)
                outcome.anchors_made.append(a.info())
                outcome.anchors_new += aid not in anchors_before
        job.post("done", outcome)
        self._finished(job, outcome, None)

    def _run_script(self, job: Job, text: str) -> None:
        t0 = time.perf_counter()
        for i in range(0, len(text), self.SCRIPT_PIECE):
            if job.cancelled.is_set():
                self._finished(job, None, None)
                return
            job.post("text", text[i:i + self.SCRIPT_PIECE])
        outcome = Outcome(prompt_tokens=len(job.ids), cached_tokens=0,
                          completion_tokens=len(self.model.encode(text, add_special_tokens=False)),
                          finish_reason="stop", prefill_tps=0.0, decode_tps=0.0,
                          seconds_to_first_token=t0 - job.enqueued, hit_rate=None, max_tokens=job.max_tokens,
                          requested_max_tokens=job.requested_max_tokens)
        job.post("done", outcome)
        self._finished(job, outcome, None)

    def _finished(self, job: Job, outcome: Outcome | None, error: BaseException | None) -> None:
        if self.on_finish is not None and job.task is None:
            self.on_finish(job, outcome, error)


def _hits(experts) -> tuple[int, int] | None:
    """(hits, misses) of the expert cache's decode steps so far, or None for a runner without a cache."""
    stats = getattr(experts, "hit_stats", None)
    if stats is None:
        return None
    _, hits, misses = stats()
    return hits, misses
