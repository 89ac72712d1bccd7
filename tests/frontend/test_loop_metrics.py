"""LoopMetric: lock-free counters and histograms exposed exactly as prometheus_client's own."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Histogram

from frontend.metrics import LoopMetric

pytestmark = pytest.mark.timeout(10)


def test_histogram_samples_equal_prometheus_clients() -> None:
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    buckets = (0.001, 0.01, 0.1, 1.0)
    mine = LoopMetric("x_seconds", "doc", ["model"], ours, buckets=buckets)
    reference = Histogram("x_seconds", "doc", ["model"], buckets=buckets, registry=theirs)
    for value in (0.0, 0.001, 0.0011, 0.05, 0.1, 3.0, 7.5):  # bucket bounds are inclusive (le)
        mine.labels("m").observe(value)
        reference.labels("m").observe(value)
    mine.labels("other").observe(0.5)
    for le in ("0.001", "0.01", "0.1", "1.0", "+Inf"):
        labels = {"model": "m", "le": le}
        assert ours.get_sample_value("x_seconds_bucket", labels) == theirs.get_sample_value("x_seconds_bucket", labels)
    assert ours.get_sample_value("x_seconds_bucket", {"model": "m", "le": "0.001"}) == 2
    assert ours.get_sample_value("x_seconds_count", {"model": "m"}) == 7
    assert ours.get_sample_value("x_seconds_sum", {"model": "m"}) == pytest.approx(10.6521)
    assert ours.get_sample_value("x_seconds_count", {"model": "other"}) == 1


def test_counter_totals_per_label_set_and_label_count_checked() -> None:
    registry = CollectorRegistry()
    counter = LoopMetric("requests", "doc", ["api", "status_class"], registry)
    counter.labels("inference", "2xx").inc()
    counter.labels("inference", "2xx").inc(2)
    counter.labels("inference", "5xx").inc()
    assert registry.get_sample_value("requests_total", {"api": "inference", "status_class": "2xx"}) == 3
    assert registry.get_sample_value("requests_total", {"api": "inference", "status_class": "5xx"}) == 1
    with pytest.raises(ValueError, match="expected labels"):
        counter.labels("inference")
