"""Prometheus metrics of one server, in a registry of its own (tests can run several servers).

Counters and histograms are updated where things happen (API middleware, the worker loop); gauges
that describe current state (queue depth, workers by state) are computed at scrape time by a
collector, so they can never drift from the truth.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

# Latency buckets from 1 ms to 60 s: echo requests sit at the low end, LLM streams at the high end.
_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
# Active batch size per step (entries), and the frontend's per-step overhead (25 us to 50 ms).
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
_OVERHEAD_BUCKETS = (25e-6, 50e-6, 100e-6, 200e-6, 400e-6, 700e-6, 0.001, 0.002, 0.004, 0.008, 0.016, 0.05)


def status_class(status: int) -> str:
    return f"{status // 100}xx"


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
        self.http_requests = Counter(
            "conveyor_http_requests", "HTTP requests answered, by API and status class",
            ["api", "status_class"], registry=self.registry,
        )
        self.inference_requests = Counter(
            "conveyor_inference_requests", "Inference requests answered, by model and status class",
            ["model", "status_class"], registry=self.registry,
        )
        self.inference_latency = Histogram(
            "conveyor_inference_latency_seconds", "Time from accepting an inference request to its last byte",
            ["model"], buckets=_BUCKETS, registry=self.registry,
        )
        self.queue_latency = Histogram(
            "conveyor_queue_latency_seconds", "Time a job waited in its model's queue before a worker sent it",
            ["model"], buckets=_BUCKETS, registry=self.registry,
        )
        self.worker_restarts = Counter(
            "conveyor_worker_restarts", "Worker processes that failed and were replaced", ["model"],
            registry=self.registry,
        )
        # Step loop and streams (issue 5), updated by workers/worker.py. "Steps per second" is
        # rate(conveyor_steps_total); queue wait is conveyor_queue_latency_seconds above.
        self.steps = Counter(
            "conveyor_steps", "INFER frames (steps) sent to workers", ["model"], registry=self.registry,
        )
        self.batch_size = Histogram(
            "conveyor_batch_size", "Active batch size of each step: NEW + CONTINUE entries of the frame",
            ["model"], buckets=_BATCH_BUCKETS, registry=self.registry,
        )
        self.cancels_sent = Counter(
            "conveyor_cancels_sent", "CANCEL entries sent to workers (client gone, request cancelled)", ["model"],
            registry=self.registry,
        )
        self.time_to_first_chunk = Histogram(
            "conveyor_time_to_first_chunk_seconds", "Time from accepting a request to its first result",
            ["model"], buckets=_BUCKETS, registry=self.registry,
        )
        self.time_between_chunks = Histogram(
            "conveyor_time_between_chunks_seconds", "Time between two results of one streamed request",
            ["model"], buckets=_BUCKETS, registry=self.registry,
        )
        self.step_overhead = Histogram(
            "conveyor_step_overhead_seconds", "Frontend time per step of a busy worker: from the reply's "
            "bytes read to the next frame written (decode, dispatch, next frame built, encoded, sent)",
            ["model"], buckets=_OVERHEAD_BUCKETS, registry=self.registry,
        )

        # LLM block (issue 6), fed by the OpenAI routes (frontend/openai/): tokens/s is
        # rate(conveyor_llm_generation_tokens_total); active sequences are the streams in flight.
        self.llm_time_to_first_token = Histogram(
            "conveyor_llm_time_to_first_token_seconds", "Time from accepting a request to its first generated token",
            ["model"], buckets=_BUCKETS, registry=self.registry,
        )
        self.llm_inter_token_latency = Histogram(
            "conveyor_llm_inter_token_latency_seconds", "Time between two generated tokens of one request",
            ["model"], buckets=_TOKEN_BUCKETS, registry=self.registry,
        )
        self.llm_generation_tokens = Counter(
            "conveyor_llm_generation_tokens", "Tokens generated", ["model"], registry=self.registry,
        )
        self.llm_prompt_tokens = Counter(
            "conveyor_llm_prompt_tokens", "Prompt tokens of requests answered", ["model"], registry=self.registry,
        )
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
