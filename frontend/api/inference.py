"""Inference API (default 127.0.0.1:8080): ``/ping``, ``/predictions``, ``/explanations``,
``/api-description``. Translates HTTP to Jobs and results back; knows nothing about batching."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from aiohttp import web

from backend.protocol import InputParameter, RequestFlags
from frontend.api.common import error_parts, json_response, request_id
from frontend.api.openapi import api_description
from frontend.api.payload import check_content_length, read_parameters, request_headers, sequence_fields
from frontend.api.streaming import AiohttpWriter, ResultWriter, StreamMode, choose_mode, respond
from frontend.config import ServerConfig
from frontend.errors import ConveyorError
from frontend.jobs import Job
from frontend.metrics import ServerMetrics, status_class
from frontend.models import ModelRegistry
from frontend.models.registry import ModelVersion
from frontend.models.health import health_status, unhealthy_models
from frontend.sinks import ResponseSink


class InferenceApi:
    def __init__(self, registry: ModelRegistry, config: ServerConfig, metrics: ServerMetrics) -> None:
        self.registry = registry
        self.config = config
        self.metrics = metrics
        self._requests: dict[tuple[str, int], Any] = {}  # (model, status) → counter child
        self._latency: dict[str, Any] = {}  # model → histogram child

    def add_routes(self, app: web.Application) -> None:
        app.router.add_get("/ping", self.ping)
        app.router.add_get("/api-description", self.describe_api)
        app.router.add_route("OPTIONS", "/", self.describe_api)
        for prefix, explain in (("/predictions", False), ("/explanations", True)):
            for path in (f"{prefix}/{{model}}", f"{prefix}/{{model}}/{{version}}"):
                handler = self.explain if explain else self.predict
                app.router.add_post(path, handler)
                app.router.add_put(path, handler)

    def ping_result(self) -> tuple[int, dict[str, object]]:
        """TorchServe's health rule over default versions: Healthy, Partial Healthy or Unhealthy."""
        status = health_status(self.registry)
        body: dict[str, object] = {"status": status}
        if status != "Healthy":  # which models are down, and why (absent when all is well, as TorchServe)
            body["unhealthyModels"] = unhealthy_models(self.registry)
        return 500 if status == "Unhealthy" else 200, body

    async def ping(self, request: web.Request) -> web.Response:
        status, body = self.ping_result()
        return json_response(body, status=status)

    async def describe_api(self, request: web.Request) -> web.Response:
        return json_response(api_description("inference"))

    async def predict(self, request: web.Request) -> web.StreamResponse:
        return await self._infer(request, explain=False)

    async def explain(self, request: web.Request) -> web.StreamResponse:
        return await self._infer(request, explain=True)

    async def _infer(self, request: web.Request, explain: bool) -> web.StreamResponse:
        started = time.monotonic()
        model = self.registry.get(request.match_info["model"], request.match_info.get("version"))
        check_content_length(request, self.config.max_request_size)
        parameters = await read_parameters(request, self.config.max_request_size)
        writer = AiohttpWriter(request)
        mode = choose_mode(request.version, request.headers)
        await self.run(model, request_id(request), request.headers, parameters, explain, mode, writer, started)
        assert writer.response is not None  # run() wrote a response or raised
        return writer.response

    async def run(self, model: ModelVersion, rid: str, headers: Mapping[str, str], parameters: list[InputParameter],
                  explain: bool, mode: StreamMode, writer: ResultWriter, started: float,
                  header_list: list[tuple[str, str]] | None = None) -> int:
        """One prediction, whatever carries it (aiohttp, or the fast path of frontend/api/fast_path.py):
        the job goes to the model's queue and its results to ``writer``. Returns the status written.
        Errors before the job is queued are raised for the caller's error mapping, except for a
        sequence model, whose errors carry the sequence id header and are written here.
        ``header_list``: the headers as received, when the caller has them as pairs already."""
        header_list = request_headers(headers) if header_list is None else list(header_list)
        if explain:
            header_list.append(("explain", "True"))  # TorchServe's signal to call the handler's explain
        extra: dict[str, str] = {}
        sequence_id, flags = "", RequestFlags.NONE
        if model.config.sequence_batching:
            sequence_id, flags, generated = sequence_fields(headers, self.config)
            if generated:  # TorchServe handlers read the id from the headers too
                header_list.append((self.config.sequence_id_header, sequence_id))
            extra[self.config.sequence_id_header] = sequence_id
        sink = ResponseSink()
        now = model.batcher.clock()
        timeout_ms = model.config.client_timeout_ms
        job = Job(
            rid, model.name, model.version, header_list, parameters, sequence_id=sequence_id,
            flags=flags, sink=sink, created_at=now, deadline=now + timeout_ms / 1000.0 if timeout_ms else None,
        )
        status = 500
        submitted = False
        try:
            model.submit(job)  # QueueFull / NoWorkers / sequence errors: raised now, mapped by the caller
            submitted = True
            status = await respond(sink, extra, mode, writer)
            return status
        except ConveyorError as exc:
            status = exc.status
            if not extra:
                raise  # mapped by the caller
            status, error_headers, body = error_parts(exc)
            error_headers.update(extra)  # a sequence model's errors carry the sequence id too
            writer.complete(status, error_headers, body)
            return status
        except BaseException as exc:
            status = getattr(exc, "status", 499 if not isinstance(exc, Exception) else 500)
            raise
        finally:
            if submitted and not job.state.finished:
                # Client gone (handler cancelled), or the response could not be written: the
                # aggregator drops the queued job or sends one CANCEL for a running one.
                sink.close()
                model.batcher.cancel(job)
            self._count(model.name, status, time.monotonic() - started)

    def _count(self, model_name: str, status: int, seconds: float) -> None:
        # Label children are looked up once per (model, status): labels() costs more than inc().
        counter = self._requests.get((model_name, status))
        if counter is None:
            counter = self._requests[(model_name, status)] = self.metrics.inference_requests.labels(
                model_name, status_class(status))
        counter.inc()
        latency = self._latency.get(model_name)
        if latency is None:
            latency = self._latency[model_name] = self.metrics.inference_latency.labels(model_name)
        latency.observe(seconds)
