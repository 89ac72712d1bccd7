"""Prometheus metrics of one server, in a registry of its own (tests can run several servers).

Counters and histograms are updated where things happen (API middleware, the worker loop); gauges
that describe current state (queue depth, workers by state) are computed at scrape time by a
collector, so they can never drift from the truth.
"""

from __future__ import annotations

from typing import Callable, Iterable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

# Latency buckets from 1 ms to 60 s: echo requests sit at the low end, LLM streams at the high end.
_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


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

    def watch_state(self, sample: Callable[[], Iterable[tuple[str, str, int, dict[str, int]]]]) -> None:
        """Register the scrape-time sampler: yields (model, version, queue depth, {state: count})."""
        self.registry.register(_StateCollector(sample))
