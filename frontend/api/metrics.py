"""Metrics API (default 127.0.0.1:8082): ``GET /metrics`` in Prometheus text format."""

from __future__ import annotations

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from frontend.metrics import ServerMetrics


class MetricsApi:
    def __init__(self, metrics: ServerMetrics) -> None:
        self.metrics = metrics

    def add_routes(self, app: web.Application) -> None:
        app.router.add_get("/metrics", self.scrape)

    async def scrape(self, request: web.Request) -> web.Response:
        # Rendering is CPU work proportional to the number of series: small enough for the loop.
        body = generate_latest(self.metrics.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})
