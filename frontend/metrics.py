"""Prometheus metrics of one server, in a registry of its own (tests can run several servers).

Counters and histograms are updated where things happen (API middleware, the worker loop); gauges
that describe current state (queue depth, workers by state) are computed at scrape time by a
collector, so they can never drift from the truth.
"""

from __future__ import annotations

import itertools
from bisect import bisect_left
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, disable_created_metrics
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

# Latency buckets from 1 ms to 60 s: echo requests sit at the low end, LLM streams at the high end.
_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
# Active batch size per step (entries), and the frontend's per-step overhead (25 us to 50 ms).
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
_OVERHEAD_BUCKETS = (25e-6, 50e-6, 100e-6, 200e-6, 400e-6, 700e-6, 0.001, 0.002, 0.004, 0.008, 0.016, 0.05)


def status_class(status: int) -> str:
    return f"{status // 100}xx"


class _CounterChild:
    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0.0

    def inc(self, amount: float = 1.0) -> None:
        self.value += amount


class _HistogramChild:
    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # per bucket (not cumulative); the last one is +Inf
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1  # the first bucket whose bound is >= value
        self.sum += value


class LoopMetric(Collector):
    """A labelled counter or histogram updated only from the event loop: plain numbers, turned into
    Prometheus samples at scrape time. prometheus_client's own take a lock per update (a histogram
    observation takes two), a measurable share of the frontend's CPU per request at thousands of
    requests per second (docs/benchmarks.md); the exposition is the same."""

    def __init__(self, name: str, documentation: str, labelnames: list[str], registry: CollectorRegistry,
                 buckets: tuple[float, ...] | None = None) -> None:
        self.name = name
        self.documentation = documentation
        self.labelnames = labelnames
        self.buckets = buckets  # None: a counter
        self._children: dict[tuple[str, ...], Any] = {}
        registry.register(self)

    def labels(self, *values: str) -> Any:
        child = self._children.get(values)
        if child is None:
            if len(values) != len(self.labelnames):
                raise ValueError(f"{self.name}: expected labels {self.labelnames}, got {values!r}")
            child = self._children[values] = _CounterChild() if self.buckets is None else _HistogramChild(self.buckets)
        return child

    def collect(self) -> Iterator[Metric]:
        if self.buckets is None:
            counter = CounterMetricFamily(self.name, self.documentation, labels=self.labelnames)
            for values, child in self._children.items():
                counter.add_metric(list(values), child.value)
            yield counter
            return
        histogram = HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames)
        bounds = [floatToGoString(bound) for bound in self.buckets] + ["+Inf"]
        for values, child in self._children.items():
            cumulative = list(itertools.accumulate(child.counts))
            histogram.add_metric(list(values), list(zip(bounds, cumulative)), child.sum)
        yield histogram


class _StateCollector(Collector):
    """Samples the registry at scrape time through a callback (no reference cycle to the models)."""

    def __init__(self, sample: Callable[[], Iterable[tuple[str, str, int, dict[str, int]]]]) -> None:
        self._sample = sample

    def collect(self) -> Iterator[Metric]:
        depth = GaugeMetricFamily("conveyor_queue_depth", "Jobs waiting in a model's queue", labels=["model", "version"])
        workers = GaugeMetricFamily("conveyor_workers", "Worker processes by state", labels=["model", "version", "state"])
        for model, version, queue_depth, by_state in self._sample():
            depth.add_metric([model, version], queue_depth)
            for state, count in by_state.items():
                workers.add_metric([model, version, state], count)
        yield depth
        yield workers


# (model, version, SequenceTable.describe()) for every version that uses sequence batching.
SequenceSample = tuple[str, str, dict[str, int]]


class _SequenceCollector(Collector):
    """Sequence counts at scrape time, from each sequence model's table (never drift, no hooks)."""

    def __init__(self, sample: Callable[[], Iterable[SequenceSample]]) -> None:
        self._sample = sample

    def collect(self) -> Iterator[Metric]:
        labels = ["model", "version"]
        num_open = GaugeMetricFamily("conveyor_sequences_open", "Open sequences (stateful sessions)", labels=labels)
        opened = CounterMetricFamily("conveyor_sequences_opened", "Sequences opened", labels=labels)
        ended = CounterMetricFamily(
            "conveyor_sequences_ended",
            "Sequences ended: closed (end header from client or handler), expired (idle or absolute "
            "timeout), lost (worker died or was stopped)", labels=[*labels, "reason"],
        )
        for model, version, counts in self._sample():
            num_open.add_metric([model, version], counts["num_open"])
            opened.add_metric([model, version], counts["num_opened"])
            for reason in ("closed", "expired", "lost"):
                ended.add_metric([model, version, reason], counts[f"num_{reason}"])
        yield num_open
        yield opened
        yield ended


# (model name, requests running, requests waiting, KV-cache tokens held, KV-cache token budget)
LLMSample = tuple[str, int, int, int, int]
# Inter-token latency: a decode step is ~1 ms (tiny model) to ~100 ms (a 7B model on CPU).
_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)


class _LLMCollector(Collector):
    """LLM load at scrape time (issue 6): Conveyor's own names and the vLLM gauges that load-aware
    routers read (Gateway API Inference Extension), labelled ``model_name`` as vLLM does."""

    def __init__(self) -> None:
        self.sample: Callable[[], Iterable[LLMSample]] = lambda: ()

    def collect(self) -> Iterator[Metric]:
        kv_tokens = GaugeMetricFamily("conveyor_llm_kv_cache_tokens", "KV-cache token slots holding real tokens",
                                      labels=["model"])
        kv_budget = GaugeMetricFamily("conveyor_llm_kv_cache_budget_tokens", "KV-cache token budget "
                                      "(handler max_batch_tokens, summed over workers)", labels=["model"])
        running = GaugeMetricFamily("vllm:num_requests_running", "Requests prefilling or decoding",
                                    labels=["model_name"])
        waiting = GaugeMetricFamily("vllm:num_requests_waiting", "Requests queued (frontend queue and "
                                    "handler waiting for KV budget)", labels=["model_name"])
        usage = GaugeMetricFamily("vllm:kv_cache_usage_perc", "KV-cache usage, 0-1 (1 = full)",
                                  labels=["model_name"])
        for model, num_running, num_waiting, tokens, budget in self.sample():
            kv_tokens.add_metric([model], tokens)
            kv_budget.add_metric([model], budget)
            running.add_metric([model], num_running)
            waiting.add_metric([model], num_waiting)
            usage.add_metric([model], tokens / budget if budget else 0.0)
        yield from (kv_tokens, kv_budget, running, waiting, usage)


class ServerMetrics:
    def __init__(self) -> None:
        # The *_created series double the output and no dashboard here uses them (process-global).
        disable_created_metrics()
        self.registry = CollectorRegistry(auto_describe=True)
        self.http_requests = LoopMetric(
            "conveyor_http_requests", "HTTP requests answered, by API and status class",
            ["api", "status_class"], self.registry)
        self.inference_requests = LoopMetric(
            "conveyor_inference_requests", "Inference requests answered, by model and status class",
            ["model", "status_class"], self.registry)
        self.inference_latency = LoopMetric(
            "conveyor_inference_latency_seconds", "Time from accepting an inference request to its last byte",
            ["model"], self.registry, buckets=_BUCKETS)
        self.queue_latency = LoopMetric(
            "conveyor_queue_latency_seconds", "Time a job waited in its model's queue before a worker sent it",
            ["model"], self.registry, buckets=_BUCKETS)
        self.worker_restarts = Counter(
            "conveyor_worker_restarts", "Worker processes that failed and were replaced", ["model"],
            registry=self.registry,
        )
        # Step loop and streams (issue 5), updated by workers/worker.py. "Steps per second" is
        # rate(conveyor_steps_total); queue wait is conveyor_queue_latency_seconds above.
        self.steps = LoopMetric(
            "conveyor_steps", "INFER frames (steps) sent to workers", ["model"], self.registry)
        self.batch_size = LoopMetric(
            "conveyor_batch_size", "Active batch size of each step: NEW + CONTINUE entries of the frame",
            ["model"], self.registry, buckets=_BATCH_BUCKETS)
        self.cancels_sent = LoopMetric(
            "conveyor_cancels_sent", "CANCEL entries sent to workers (client gone, request cancelled)", ["model"],
            self.registry)
        self.time_to_first_chunk = LoopMetric(
            "conveyor_time_to_first_chunk_seconds", "Time from accepting a request to its first result",
            ["model"], self.registry, buckets=_BUCKETS)
        self.time_between_chunks = LoopMetric(
            "conveyor_time_between_chunks_seconds", "Time between two results of one streamed request",
            ["model"], self.registry, buckets=_BUCKETS)
        self.step_overhead = LoopMetric(
            "conveyor_step_overhead_seconds", "Frontend time per step of a busy worker: from the reply's "
            "bytes read to the next frame written (decode, dispatch, next frame built, encoded, sent)",
            ["model"], self.registry, buckets=_OVERHEAD_BUCKETS)

        # LLM block (issue 6), fed by the OpenAI routes (frontend/openai/): tokens/s is
        # rate(conveyor_llm_generation_tokens_total); active sequences are the streams in flight.
        self.llm_time_to_first_token = LoopMetric(
            "conveyor_llm_time_to_first_token_seconds", "Time from accepting a request to its first generated token",
            ["model"], self.registry, buckets=_BUCKETS)
        self.llm_inter_token_latency = LoopMetric(
            "conveyor_llm_inter_token_latency_seconds", "Time between two generated tokens of one request",
            ["model"], self.registry, buckets=_TOKEN_BUCKETS)
        self.llm_generation_tokens = LoopMetric(
            "conveyor_llm_generation_tokens", "Tokens generated", ["model"], self.registry)
        self.llm_prompt_tokens = LoopMetric(
            "conveyor_llm_prompt_tokens", "Prompt tokens of requests answered", ["model"], self.registry)
        self.llm_active_sequences = Gauge(
            "conveyor_llm_active_sequences", "Generation requests in flight (queued or generating)", ["model"],
            registry=self.registry,
        )
        self._llm = _LLMCollector()
        self.registry.register(self._llm)

    def watch_llm(self, sample: Callable[[], Iterable[LLMSample]]) -> None:
        """Set the scrape-time sampler of LLM load: yields (model, running, waiting, KV tokens, KV budget)."""
        self._llm.sample = sample

    def watch_state(self, sample: Callable[[], Iterable[tuple[str, str, int, dict[str, int]]]]) -> None:
        """Register the scrape-time sampler: yields (model, version, queue depth, {state: count})."""
        self.registry.register(_StateCollector(sample))

    def watch_sequences(self, sample: Callable[[], Iterable[SequenceSample]]) -> None:
        """Register the scrape-time sampler of sequence models: yields (model, version, counts)."""
        self.registry.register(_SequenceCollector(sample))
