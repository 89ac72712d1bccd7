"""Metrics API: Prometheus text that prometheus-client's parser reads, counting what was sent."""

from __future__ import annotations

import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from tests.integration.server import ConveyorProcess

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]


def scrape(server: ConveyorProcess) -> dict[str, list]:
    response = requests.get(f"{server.metrics}/metrics", timeout=10)
    assert response.status_code == 200 and response.headers["Content-Type"].startswith("text/plain")
    return {family.name: family.samples for family in text_string_to_metric_families(response.text)}


def value(samples: list, name: str, **labels: str) -> float:
    return sum(s.value for s in samples if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


def test_metrics_count_the_requests_sent(server: ConveyorProcess) -> None:
    before = scrape(server)
    ok_before = value(before.get("conveyor_inference_requests", []), "conveyor_inference_requests_total",
                      model="echo", status_class="2xx")
    err_before = value(before.get("conveyor_http_requests", []), "conveyor_http_requests_total",
                       api="inference", status_class="4xx")
    for i in range(5):
        assert requests.post(f"{server.inference}/predictions/echo", data=f"{i}".encode(),
                             headers={"Content-Type": "text/plain"}, timeout=10).status_code == 200
    for _ in range(3):
        assert requests.post(f"{server.inference}/predictions/missing", data=b"x", timeout=10).status_code == 404

    after = scrape(server)
    assert value(after["conveyor_inference_requests"], "conveyor_inference_requests_total",
                 model="echo", status_class="2xx") == ok_before + 5
    assert value(after["conveyor_http_requests"], "conveyor_http_requests_total",
                 api="inference", status_class="4xx") == err_before + 3
    latency = after["conveyor_inference_latency_seconds"]
    assert value(latency, "conveyor_inference_latency_seconds_count", model="echo") >= 5
    assert value(after["conveyor_queue_latency_seconds"], "conveyor_queue_latency_seconds_count", model="echo") >= 5
    assert value(after["conveyor_queue_depth"], "conveyor_queue_depth", model="echo", version="1.0") == 0
    assert value(after["conveyor_workers"], "conveyor_workers", model="echo", state="ready") == 1
    assert value(after["conveyor_workers"], "conveyor_workers", model="streaming", state="ready") == 1
