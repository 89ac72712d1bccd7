"""KServe's protocols on the inference port, served natively (no wrapper process), and ``/health``.

KServe v1 (``/v1/models/{m}``, ``:predict``, ``:explain``) and the Open Inference Protocol v2
(``/v2/...``), translated to Jobs exactly as ``api/inference.py`` does for ``/predictions``; this
module knows nothing about batching. The request shapes reach handlers as TorchServe's KServe
envelopes hand them over, so a handler ported from TorchServe sees the same rows:

* **v1** ``{"instances": [i0, i1, ...]}`` → one Job per instance, whose body is the instance as JSON
  (the aggregator may batch them into one frame); the results, in instance order, become
  ``{"predictions": [...]}`` (``{"explanations": [...]}`` for ``:explain``, whose jobs carry the
  ``explain: True`` header as ``/explanations`` does).
* **v2** ``{"id", "inputs": [{"name", "shape", "datatype", "data"}, ...]}`` → one Job per input
  tensor, whose body is that tensor as JSON with ``data`` nested to ``shape`` (BYTES: its first
  element); result *k* becomes output tensor *k*, named after input *k*, flattened, with its
  datatype inferred (BOOL, INT64, FP64, BYTES) — unless the handler returned a tensor object itself
  (a JSON object with ``data`` and ``datatype``), which is passed through.

A result is decoded by its content type: JSON → the value, other text → a string, other bytes →
``{"b64": ...}``. A streaming handler's chunks are collected: one chunk → its value, several → the
list of their values. One failed Job fails the request with that Job's status. Errors are KServe's
``{"error": "message"}``.

For a sequence model the sequence headers apply to the whole request: the Jobs run one after
another in the sequence (START on the first, END on the last), and the id is echoed as on
``/predictions``.

Health: ``/health`` and ``/v2/health/live`` are liveness — 200 while the event loop answers
(``"status": "Draining"`` once ``draining()``). ``/v2/health/ready`` and ``/v2/models/{m}/ready``
are readiness — 503 as soon as a drain starts (``draining()``), and until the models have a READY
worker. In the server, ``draining`` is ``InFlight.closing``: once it is set the listeners are
closed and the middleware answers a kept-alive connection's next request with 503 before any route
runs, so these routes see the flag only on a listener that keeps serving them.

``GET /v1/models/{m}`` is shared with the OpenAI routes (same path: their model card). This route
answers both at once: KServe's ``{"name", "ready"}`` plus the OpenAI card's fields, and an
OpenAI-shaped 404, which a KServe client reads by its status. It must be registered before the
OpenAI routes (``server.py`` does) so that it wins.
"""

from __future__ import annotations

import base64
import json
import time
from importlib import metadata
from typing import Any
from collections.abc import Awaitable, Callable

from aiohttp import web

from backend.protocol import InputParameter, RequestFlags, WireResult
from frontend.api.common import request_id
from frontend.api.payload import check_content_length, request_headers, sequence_fields
from frontend.config import ServerConfig
from frontend.errors import BadRequest, ConveyorError, ModelNotFound, PredictionError
from frontend.jobs import Job
from frontend.metrics import ServerMetrics, status_class
from frontend.models import ModelRegistry, ModelVersion
from frontend.sinks import Failure, ResponseSink
from frontend.workers import WorkerState

JSON_TYPE = "application/json"
# Model names in KServe v1 paths stop at ':' (``m:predict``) and never contain '/'.
_V1_NAME = "{model:[^/:]+}"
_V2_PREFIXES = ("/v2/models/{model}", "/v2/models/{model}/versions/{version}")


def _server_version() -> str:
    try:
        return metadata.version("conveyor-serve")
    except metadata.PackageNotFoundError:  # running from a source tree that was never installed
        return "0+unknown"


# Readiness ----------------------------------------------------------------------------------------


def model_ready(model: ModelVersion) -> bool:
    """A version is ready when at least one of its workers is READY."""
    return any(worker.state == WorkerState.READY for worker in model.pool.all_workers())


def server_ready(registry: ModelRegistry) -> bool:
    """Every model's default version that wants workers has a READY one (KServe: all models ready)."""
    return all(model_ready(entry.default) for entry in registry.models.values() if entry.default.min_workers > 0)


# Tensors (OIP v2) ---------------------------------------------------------------------------------


def _flatten(value: Any) -> list[Any]:
    if isinstance(value, list):
        return [item for part in value for item in _flatten(part)]
    return [value]


def _reshape(flat: list[Any], shape: list[int]) -> Any:
    if len(shape) <= 1:
        return flat
    step = len(flat) // shape[0] if shape[0] else 0
    return [_reshape(flat[i * step:(i + 1) * step], shape[1:]) for i in range(shape[0])]


def parse_tensor(index: int, tensor: Any) -> dict[str, Any]:
    """One v2 input → the object a handler gets: name, shape, datatype and ``data`` in its shape."""
    if not isinstance(tensor, dict):
        raise BadRequest(f"inputs[{index}] must be an object with name, shape, datatype and data")
    name, shape, datatype, data = (tensor.get(k) for k in ("name", "shape", "datatype", "data"))
    if not isinstance(name, str) or not name:
        raise BadRequest(f"inputs[{index}].name must be a non-empty string")
    if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
        raise BadRequest(f"input '{name}': shape must be a list of non-negative integers")
    if not isinstance(datatype, str) or not datatype:
        raise BadRequest(f"input '{name}': datatype must be a string such as FP32, INT64 or BYTES")
    if not isinstance(data, list):
        raise BadRequest(f"input '{name}': data must be a list (flat or nested)")
    flat = _flatten(data)
    size = 1
    for dim in shape:
        size *= dim
    if len(flat) != size:
        raise BadRequest(f"input '{name}': {len(flat)} data elements do not fill shape {shape}")
    parsed = {"name": name, "shape": shape, "datatype": datatype.upper(),
              # As TorchServe's KServe v2 envelope: BYTES hands over the first element.
              "data": (flat[0] if flat else "") if datatype.upper() == "BYTES" else _reshape(flat, shape)}
    if isinstance(tensor.get("parameters"), dict):
        parsed["parameters"] = tensor["parameters"]
    return parsed


def _datatype(flat: list[Any]) -> str:
    if flat and all(isinstance(v, bool) for v in flat):
        return "BOOL"
    if all(isinstance(v, int) and not isinstance(v, bool) for v in flat):
        return "INT64"
    if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in flat):
        return "FP64"
    return "BYTES"


def to_tensor(name: str, value: Any) -> dict[str, Any]:
    """A handler's result → one v2 output tensor (flattened, as TorchServe's envelope does)."""
    if isinstance(value, dict) and "data" in value and "datatype" in value:
        tensor = dict(value)  # the handler built the tensor itself
        tensor.setdefault("name", name)
        tensor.setdefault("shape", [len(_flatten(tensor["data"]))])
        return tensor
    flat = _flatten(value)
    datatype = _datatype(flat)
    if datatype == "BYTES":
        flat = [v if isinstance(v, str) else json.dumps(v) for v in flat]
    return {"name": name, "shape": [len(flat)], "datatype": datatype, "data": flat}


# Results ------------------------------------------------------------------------------------------


def decode_result(result: WireResult) -> Any:
    """A result's body as a JSON value: JSON → the value, text → a string, bytes → {"b64": ...}."""
    media_type = result.content_type.split(";")[0].strip().lower()
    body = result.body
    if media_type == JSON_TYPE or media_type.endswith("+json"):
        try:
            return json.loads(body)
        except ValueError:
            pass  # a handler that mislabelled its output: fall back to text
    try:
        return body.decode("utf-8")
    except UnicodeDecodeError:
        return {"b64": base64.b64encode(body).decode("ascii")}


async def collect(sink: ResponseSink) -> Any:
    """Await one job's results until done; its value (a list of values for a multi-chunk stream)."""
    values: list[Any] = []
    while True:
        item = await sink.next()
        if isinstance(item, Failure):
            raise item.error
        if item.status >= 400:
            message = item.message or item.body[:1000].decode("utf-8", "replace")
            raise PredictionError(item.status, message or f"prediction failed with status {item.status}")
        if item.body or (item.done and not values):
            values.append(decode_result(item))
        if item.done:
            return values[0] if len(values) == 1 else values


def kserve_error(status: int, message: str, headers: dict[str, str] | None = None) -> web.Response:
    return web.json_response({"error": message}, status=status, headers=headers)


def _error(exc: ConveyorError, headers: dict[str, str]) -> web.Response:
    if exc.retry_after is not None:
        headers = {**headers, "Retry-After": str(exc.retry_after)}
    return kserve_error(exc.status, exc.message, headers)


async def _json_body(request: web.Request, limit: int) -> Any:
    check_content_length(request, limit)
    try:
        return json.loads(await request.read())  # bounded by client_max_size (= max_request_size)
    except ValueError as exc:
        raise BadRequest(f"the body must be JSON: {exc}") from None


# Routes -------------------------------------------------------------------------------------------


class KServeApi:
    """KServe v1, Open Inference Protocol v2 and ``/health`` on the inference app."""

    def __init__(self, registry: ModelRegistry, config: ServerConfig, metrics: ServerMetrics,
                 draining: Callable[[], bool] = lambda: False) -> None:
        self.registry = registry
        self.config = config
        self.metrics = metrics
        self.draining = draining  # True once a graceful stop began: readiness turns false at once

    def add_routes(self, app: web.Application) -> None:
        router = app.router
        router.add_get("/health", self.live)
        router.add_get(f"/v1/models/{_V1_NAME}", self.v1_model)
        router.add_post(f"/v1/models/{_V1_NAME}:predict", self.v1_predict)
        router.add_post(f"/v1/models/{_V1_NAME}:explain", self.v1_explain)
        router.add_get("/v2", self.v2_server_metadata)
        router.add_get("/v2/health/live", self.live)
        router.add_get("/v2/health/ready", self.v2_ready)
        for prefix in _V2_PREFIXES:
            router.add_get(prefix, self.v2_model_metadata)
            router.add_get(f"{prefix}/ready", self.v2_model_ready)
            router.add_post(f"{prefix}/infer", self.v2_infer)

    # Health ---------------------------------------------------------------------------------------

    async def live(self, request: web.Request) -> web.Response:
        return web.json_response({"live": True, "status": "Draining" if self.draining() else "Healthy"})

    async def v2_ready(self, request: web.Request) -> web.Response:
        ready = not self.draining() and server_ready(self.registry)
        return web.json_response({"ready": ready}, status=200 if ready else 503)

    async def v2_model_ready(self, request: web.Request) -> web.Response:
        model = self._model(request)
        if model is None:
            return self._not_found(request)
        ready = not self.draining() and model_ready(model)
        return web.json_response({"name": model.name, "ready": ready}, status=200 if ready else 503)

    # Metadata -------------------------------------------------------------------------------------

    async def v1_model(self, request: web.Request) -> web.Response:
        name = request.match_info["model"]
        try:
            model = self.registry.get(name)
        except ModelNotFound as exc:  # OpenAI's shape: this path is also the OpenAI model card
            return web.json_response({"error": {"message": exc.message, "type": "invalid_request_error",
                                                "param": "model", "code": "model_not_found"}}, status=404)
        return web.json_response({
            "name": name, "ready": not self.draining() and model_ready(model),
            # The OpenAI model card (frontend/openai/routes.py), field for field.
            "id": name, "object": "model", "created": int(model.registered_at), "owned_by": "conveyor",
            "root": name, "parent": None,
        })

    async def v2_server_metadata(self, request: web.Request) -> web.Response:
        return web.json_response({"name": "conveyor", "version": _server_version(), "extensions": []})

    async def v2_model_metadata(self, request: web.Request) -> web.Response:
        model = self._model(request)
        if model is None:
            return self._not_found(request)
        entry = self.registry.entry(model.name)
        # Tensor metadata is not declared anywhere in an archive: inputs/outputs stay empty lists.
        return web.json_response({"name": model.name, "versions": sorted(entry.versions), "platform": "conveyor",
                                  "inputs": [], "outputs": []})

    # Inference ------------------------------------------------------------------------------------

    async def v1_predict(self, request: web.Request) -> web.Response:
        return await self._v1(request, explain=False)

    async def v1_explain(self, request: web.Request) -> web.Response:
        return await self._v1(request, explain=True)

    async def _v1(self, request: web.Request, explain: bool) -> web.Response:
        async def run(model: ModelVersion, extra: dict[str, str]) -> web.Response:
            body = await _json_body(request, self.config.max_request_size)
            instances = body.get("instances") if isinstance(body, dict) else None
            if not isinstance(instances, list):
                raise BadRequest('the body must be a JSON object with an "instances" list')
            values = await self._run_jobs(request, model, [json.dumps(i).encode() for i in instances], explain, extra)
            return web.json_response({"explanations" if explain else "predictions": values}, headers=extra)

        return await self._serve(request, run)

    async def v2_infer(self, request: web.Request) -> web.Response:
        async def run(model: ModelVersion, extra: dict[str, str]) -> web.Response:
            body = await _json_body(request, self.config.max_request_size)
            inputs = body.get("inputs") if isinstance(body, dict) else None
            if not isinstance(inputs, list) or not inputs:
                raise BadRequest('the body must be a JSON object with a non-empty "inputs" list')
            tensors = [parse_tensor(i, t) for i, t in enumerate(inputs)]
            values = await self._run_jobs(request, model, [json.dumps(t).encode() for t in tensors], False, extra)
            client_id = body.get("id")
            response_id = client_id if isinstance(client_id, str) and client_id.strip() else request_id(request)
            outputs = [to_tensor(t["name"], v) for t, v in zip(tensors, values)]
            return web.json_response({"model_name": model.name, "model_version": model.version, "id": response_id,
                                      "outputs": outputs}, headers=extra)

        return await self._serve(request, run)

    async def _serve(self, request: web.Request,
                     run: Callable[[ModelVersion, dict[str, str]], Awaitable[web.Response]]) -> web.Response:
        """Model lookup, errors in KServe's shape, and the inference metrics of one request."""
        started = time.monotonic()
        model = self._model(request)
        if model is None:
            return self._not_found(request)
        extra: dict[str, str] = {}  # the sequence id header of a sequence model, on errors too
        status = 500
        try:
            response = await run(model, extra)
            status = response.status
            return response
        except ConveyorError as exc:
            status = exc.status
            return _error(exc, extra)
        except web.HTTPException as exc:  # the body outgrew max_request_size while being read
            status = exc.status
            return kserve_error(exc.status, exc.text or exc.reason)
        except Exception:
            raise  # a bug: the middleware answers 500 JSON (status stays 500 here)
        except BaseException:
            status = 499  # client gone: the handler was cancelled
            raise
        finally:
            self.metrics.inference_requests.labels(model.name, status_class(status)).inc()
            self.metrics.inference_latency.labels(model.name).observe(time.monotonic() - started)

    async def _run_jobs(self, request: web.Request, model: ModelVersion, bodies: list[bytes], explain: bool,
                        extra: dict[str, str]) -> list[Any]:
        """One Job per body; their values in order. A sequence model's jobs run one at a time."""
        headers = request_headers(request.headers)
        if explain:
            headers.append(("explain", "True"))  # TorchServe's signal to call the handler's explain
        sequence_id, flags = "", RequestFlags.NONE
        if model.config.sequence_batching:
            sequence_id, flags, generated = sequence_fields(request.headers, self.config)
            if generated:
                headers.append((self.config.sequence_id_header, sequence_id))
            extra[self.config.sequence_id_header] = sequence_id
        rid = request_id(request)
        jobs: list[tuple[Job, ResponseSink]] = []
        try:
            if sequence_id:
                values = []
                cfg = self.config
                for index, body in enumerate(bodies):
                    # START belongs to the first job only and END to the last, as flags and as the
                    # headers a handler reads (it would reset or free its state on every job).
                    job_flags, dropped = flags, set()
                    if index > 0:
                        job_flags &= ~RequestFlags.SEQUENCE_START
                        dropped.add(cfg.sequence_start_header)
                    if index < len(bodies) - 1:
                        job_flags &= ~RequestFlags.SEQUENCE_END
                        dropped.add(cfg.sequence_end_header)
                    job_headers = [(k, v) for k, v in headers if k.lower() not in dropped]
                    jobs.append(self._submit(model, f"{rid}:{index}" if index else rid, job_headers, body,
                                             sequence_id, job_flags))
                    values.append(await collect(jobs[-1][1]))
                return values
            for index, body in enumerate(bodies):  # all queued at once: the aggregator may batch them
                jobs.append(self._submit(model, f"{rid}:{index}" if index else rid, headers, body, "", flags))
            return [await collect(sink) for _, sink in jobs]
        finally:
            for job, sink in jobs:
                if not job.state.finished:
                    # Client gone, or another job of this request failed: drop or CANCEL the rest.
                    sink.close()
                    model.batcher.cancel(job)

    def _submit(self, model: ModelVersion, rid: str, headers: list[tuple[str, str]], body: bytes,
                sequence_id: str, flags: RequestFlags) -> tuple[Job, ResponseSink]:
        now = model.batcher.clock()
        timeout_ms = model.config.client_timeout_ms
        sink = ResponseSink()
        job = Job(rid, model.name, model.version, headers, [InputParameter("body", JSON_TYPE, body)],
                  sequence_id=sequence_id, flags=flags, sink=sink, created_at=now,
                  deadline=now + timeout_ms / 1000.0 if timeout_ms else None)
        model.submit(job)  # QueueFull / NoWorkers / sequence errors raise now
        return job, sink

    # Lookups --------------------------------------------------------------------------------------

    def _model(self, request: web.Request) -> ModelVersion | None:
        try:
            return self.registry.get(request.match_info["model"], request.match_info.get("version"))
        except ModelNotFound:
            return None

    def _not_found(self, request: web.Request) -> web.Response:
        name, version = request.match_info["model"], request.match_info.get("version")
        what = f"Model with name {name}" + (f" and version {version}" if version else "")
        return kserve_error(404, f"{what} does not exist.")
