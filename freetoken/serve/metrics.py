"""``GET /metrics``: Prometheus metrics of the server, in a registry of its own (``prometheus-client``).

Counted by the server: requests by endpoint and status, prompt / cached / generated tokens, cancelled requests,
time to first token, anchors made, restored and refused. Read at scrape time: the last request's prefill and
decode tokens/s, the queue (its length and each waiting request's position), the KV cache in use, and the expert
runner's counters (cache hits and misses, the q* split's hits / fetched / cpu), as the worker thread last copied
them (it owns the model; the HTTP side never touches the device). A batching server (``--max-seqs`` > 1) adds its
step loop's: steps run, histograms of sequences and of tokens per step, preemptions.
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.utils import floatToGoString

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class ServerMetrics:
    def __init__(self):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("freetoken_requests", "HTTP requests by endpoint and status code",
                                ["endpoint", "status"], registry=r)
        self.prompt_tokens = Counter("freetoken_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.cached_tokens = Counter("freetoken_cached_prompt_tokens",
                                     "Prompt tokens whose KV rows were reused (prefix cache or anchor)", registry=r)
        self.anchors_created = Counter("freetoken_anchors_created", "Anchors made (at message boundaries or by "
                                       "POST /v1/anchors; one already there is not counted again)", registry=r)
        self.anchors_restored = Counter("freetoken_anchors_restored", "Prompts resumed from an anchor", registry=r)
        self.anchors_refused = Counter("freetoken_anchors_refused",
                                       "Anchors refused at a restore (unknown, or a check failed): recomputed",
                                       registry=r)
        self.generated_tokens = Counter("freetoken_generated_tokens", "Tokens generated", registry=r)
        self.cancelled = Counter("freetoken_requests_cancelled",
                                 "Requests whose client went away before they finished", registry=r)
        self.failed = Counter("freetoken_requests_failed", "Requests the engine could not finish", registry=r)
        self.ttft = Histogram("freetoken_time_to_first_token_seconds",
                              "From the request's arrival (queueing included) to its first text",
                              buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300), registry=r)
        self.prefill_tps = Gauge("freetoken_prefill_tokens_per_second", "Prefill speed of the last request",
                                 registry=r)
        self.decode_tps = Gauge("freetoken_decode_tokens_per_second", "Decode speed of the last request",
                                registry=r)
        self.worker = None
        r.register(_LiveCollector(self))

    def job_finished(self, job, outcome, error) -> None:
        """The worker's ``on_finish``."""
        if error is not None:
            self.failed.inc()
        elif outcome is None:
            self.cancelled.inc()
        else:
            self.prompt_tokens.inc(outcome.prompt_tokens)
            self.cached_tokens.inc(outcome.cached_tokens)
            self.generated_tokens.inc(outcome.completion_tokens)
            self.ttft.observe(outcome.seconds_to_first_token)
            self.prefill_tps.set(outcome.prefill_tps)
            self.decode_tps.set(outcome.decode_tps)
            self.anchors_created.inc(outcome.anchors_new)
            self.anchors_restored.inc(outcome.anchor is not None)
            self.anchors_refused.inc(outcome.anchor_refused is not None)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _LiveCollector:
    """The metrics read from the worker at scrape time."""

    def __init__(self, metrics: ServerMetrics):
        self.metrics = metrics

    def describe(self):
        return []

    def collect(self):
        worker = self.metrics.worker
        loaded = GaugeMetricFamily("freetoken_model_loaded", "1 once the model is loaded and serving")
        loaded.add_metric([], 0 if worker is None else 1)
        yield loaded
        if worker is None:
            return
        waiting = worker.queue()
        length = GaugeMetricFamily("freetoken_queue_length", "Requests waiting for the engine")
        length.add_metric([], len(waiting))
        yield length
        running = GaugeMetricFamily("freetoken_requests_running", "Requests the engine is generating for (at most "
                                    "--max-seqs)")
        running.add_metric([], worker.running_jobs)
        yield running
        position = GaugeMetricFamily("freetoken_queue_position", "Each waiting request's place in the queue "
                                     "(1: next)", labels=["request"])
        wait = GaugeMetricFamily("freetoken_queue_wait_seconds", "How long each waiting request has waited",
                                 labels=["request"])
        now = time.perf_counter()
        for i, job in enumerate(waiting, 1):
            position.add_metric([str(job.number)], i)
            wait.add_metric([str(job.number)], now - job.enqueued)
        yield position
        yield wait
        decoder = worker.model.decoder
        kv = GaugeMetricFamily("freetoken_kv_tokens", "Tokens in the KV cache, and the context it holds",
                               labels=["what"])
        kv.add_metric(["used"], decoder.length)
        kv.add_metric(["capacity"], decoder.ctx)
        yield kv
        counters = dict(worker.counters)
        hits, misses = counters.get("split_hits"), None
        if hits is not None:
            misses = counters.get("split_fetched", 0) + counters.get("split_cpu", 0)
        elif "cache_hits" in counters:
            hits, misses = counters["cache_hits"], counters["cache_misses"]
        if hits is not None:
            rate = GaugeMetricFamily("freetoken_expert_cache_hit_rate",
                                     "Routed experts found in the device cache, since load")
            rate.add_metric([], hits / (hits + misses) if hits + misses else 0.0)
            yield rate
        loop = getattr(worker, "loop_engine", None)
        if loop is not None:
            yield from _step_metrics(loop)
        if counters:
            family = CounterMetricFamily("freetoken_experts", "The expert runner's counters since load "
                                         "(cache hits/misses; q* split: hits, fetched over PCIe, computed on the "
                                         "CPU; prefetch)", labels=["counter"])
            for name, value in sorted(counters.items()):
                family.add_metric([name], value)
            yield family


def _step_metrics(loop):
    """A batching worker's step loop (:class:`freetoken.engine.batching.step_loop.StepLoop`), read at scrape time."""
    from freetoken.engine.batching.step_loop import BATCH_SIZE_BOUNDS, STEP_TOKEN_BOUNDS

    st = loop.stats
    steps = CounterMetricFamily("freetoken_steps", "Forward passes of the step loop (each runs every running "
                                "request's next token and prompt chunks together)")
    steps.add_metric([], st.steps)
    yield steps
    yield _histogram("freetoken_step_batch_size", "Requests in one step", BATCH_SIZE_BOUNDS, st.batch_sizes,
                     st.sequences)
    yield _histogram("freetoken_step_tokens", "Tokens in one step (decode tokens and prompt chunks)",
                     STEP_TOKEN_BOUNDS, st.step_tokens, st.tokens)
    preempted = CounterMetricFamily("freetoken_preemptions", "Requests preempted when the KV cache ran short "
                                    "(their rows given back; recomputed when readmitted)")
    preempted.add_metric([], loop.preemptions)
    yield preempted


def _histogram(name: str, doc: str, bounds, counts, total) -> HistogramMetricFamily:
    """A Prometheus histogram from per-bucket counts (the last: above every bound) and the values' sum."""
    counts = list(counts)  # the worker thread may add to it meanwhile: one copy, so the buckets agree
    buckets, running = [], 0
    for bound, n in zip(bounds, counts, strict=False):
        running += n
        buckets.append((floatToGoString(bound), running))  # le="1.0", as prometheus-client's own histograms
    buckets.append(("+Inf", running + counts[-1]))
    family = HistogramMetricFamily(name, doc)
    family.add_metric([], buckets, sum_value=total)
    return family
