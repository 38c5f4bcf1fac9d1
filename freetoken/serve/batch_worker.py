"""The server's engine with continuous batching (``freetoken serve --max-seqs N``, N > 1): requests share steps.

A :class:`BatchWorker` is an :class:`freetoken.serve.worker.EngineWorker` whose thread drives a
:class:`freetoken.engine.batching.step_loop.StepLoop` instead of running one job to its end: every waiting job is
submitted as it arrives, and each step runs the decode token of every running request and chunks of the prompts being
prefilled. A request's text goes through its own :class:`freetoken.engine.decoding.text_stream.TextStream` (stop
strings, held-back text), its reply ends as the one-job worker's does (the same :class:`Outcome`), a job whose client
left is dropped from the loop before the next step. Prefix reuse and anchors work as they do alone (the step loop's).

A model with linear-attention layers batches the same way (the step loop keeps their states where reuse needs
them). Jobs that carry a ``task`` (the anchor routes) and prefill-only jobs (``POST /v1/anchors``) run between two
steps, on this thread, as the one-job worker runs them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from freetoken.engine.batching.scheduler import Status
from freetoken.engine.batching.step_loop import Request, StepLoop
from freetoken.engine.decoding.text_stream import TextStream
from freetoken.serve.worker import FINISH_REASONS, EngineWorker, Job, Outcome


@dataclass
class _Active:
    """A job in the step loop: its request, its text, when its first token came, the anchors there before it."""

    job: Job
    request: Request
    text: TextStream
    anchors_before: set
    first: float | None = None
    last: float | None = None


class BatchWorker(EngineWorker):
    """Runs :class:`Job` s on ``model`` in batched steps (see the module doc); ``max_seqs`` requests at once,
    ``step_tokens`` tokens a step (None: the step loop's default)."""

    def __init__(self, model, on_finish=None, max_seqs: int = 8, step_tokens: int | None = None):
        self.loop_engine = StepLoop(model, max_seqs=max_seqs, step_tokens=step_tokens)
        self._active: dict[Request, _Active] = {}
        super().__init__(model, on_finish=on_finish)

    # ---- what the request side and the metrics see ------------------------------------------------------------
    @property
    def running(self) -> Job | None:
        """One of the jobs being generated for (None: none is)."""
        return next((a.job for a in list(self._active.values())), None)

    @property
    def running_jobs(self) -> int:
        """Jobs whose requests run in the step loop (admitted, not waiting for a seat)."""
        return sum(a.request.seq.status is Status.RUNNING for a in list(self._active.values()))

    def queue(self) -> list[Job]:
        """The jobs not yet running, next first: those the step loop holds waiting for a seat, then the arrivals."""
        held = [a for a in list(self._active.values()) if a.request.seq.status is Status.WAITING]
        held.sort(key=lambda a: a.request.seq.arrival)
        with self._cv:
            return [a.job for a in held] + list(self._waiting)

    # ---- the worker thread ------------------------------------------------------------------------------------
    def _loop(self) -> None:
        loop = self.loop_engine
        while True:
            with self._cv:
                while not self._waiting and not loop.has_work and not self._closed:
                    self._cv.wait()
                if self._closed:
                    break
                arrived, self._waiting = list(self._waiting), type(self._waiting)()
            for job in arrived:
                self._admit(job)
            self._drop_cancelled()
            if not loop.has_work:
                continue
            try:
                events = loop.step()
            except Exception as e:  # noqa: BLE001 - the engine broke mid-step: every running request gets the error
                self._fail_all(e)
                continue
            self.counters = dict(self.model.experts.counters())
            now = time.perf_counter()
            for ev in events:
                a = self._active.get(ev.request)
                if a is None:
                    continue
                if ev.token is not None:
                    a.first = a.first or now
                    a.last = now
                    piece = a.text.push(ev.token)
                    if piece:
                        a.job.post("text", piece)
                if ev.finish_reason == "kv":
                    self._end(a, error=RuntimeError("the request does not fit the KV cache even alone"))
                elif ev.finish_reason is not None or a.text.done:
                    if ev.finish_reason is None:  # a stop string: its sequence leaves the loop now
                        loop.abort(a.request)
                    self._end(a)
        for a in list(self._active.values()):  # closed: whoever still runs is told
            a.job.cancelled.set()
            loop.abort(a.request)
            a.job.post("error", RuntimeError("the server is shutting down"))
        self._active.clear()

    def _admit(self, job: Job) -> None:
        if job.task is not None or job.max_tokens == 0:
            # between two steps, this thread alone touching the model: the anchor routes' tasks, and a prefill-only
            # job (POST /v1/anchors) on the decoder's own sequence, which shares the step loop's pool and caches
            self._run(job)
            return
        if job.cancelled.is_set():
            return
        store = getattr(self.model, "_anchors", None)
        before = set(store.anchors) if store is not None else set()
        try:
            req = self.loop_engine.submit(job.ids, job.max_tokens, job.sampling, constraint=job.constraint,
                                          anchor=job.anchor, boundaries=job.boundaries)
        except Exception as e:  # noqa: BLE001 - the request is refused, the server goes on
            job.post("error", e)
            self._finished(job, None, e)
            return
        self._active[req] = _Active(job, req, TextStream(self.model, job.stop), before)

    def _drop_cancelled(self) -> None:
        for req, a in list(self._active.items()):
            if a.job.cancelled.is_set():
                self.loop_engine.abort(req)
                del self._active[req]
                self._finished(a.job, None, None)

    def _fail_all(self, error: BaseException) -> None:
        for req, a in list(self._active.items()):
            self.loop_engine.abort(req)
            a.job.post("error", error)
            self._finished(a.job, None, error)
        self._active.clear()

    def _end(self, a: _Active, error: BaseException | None = None) -> None:
        job, req, text = a.job, a.request, a.text
        self._active.pop(req, None)
        if error is not None:
            job.post("error", error)
            self._finished(job, None, error)
            return
        piece = text.flush()
        if piece:
            job.post("text", piece)
        st = req.stats
        reason = text.finish_reason or req.finish_reason or "stop"
        now = time.perf_counter()
        first = a.first or now
        decode = (a.last or now) - first
        outcome = Outcome(prompt_tokens=len(job.ids), cached_tokens=st.cached_tokens,
                          completion_tokens=len(req.output), finish_reason=FINISH_REASONS.get(reason, "stop"),
                          prefill_tps=st.prompt_tokens / max(first - job.enqueued, 1e-9),
                          decode_tps=(len(req.output) - 1) / decode if decode > 0 else 0.0,
                          seconds_to_first_token=first - job.enqueued, hit_rate=None,
                          stop_sequence=text.stop_sequence, anchor=st.anchor, anchor_refused=st.anchor_refused,
                          max_tokens=job.max_tokens, requested_max_tokens=job.requested_max_tokens)
        for aid in st.anchors_made:
            anchor = self.model.anchors.get(aid)
            if anchor is not None:
                outcome.anchors_made.append(anchor.info())
                outcome.anchors_new += aid not in a.anchors_before
        job.post("done", outcome)
        self._finished(job, outcome, None)
