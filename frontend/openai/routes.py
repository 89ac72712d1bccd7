"""OpenAI-compatible routes on the inference port: ``GET /v1/models[/{model}]``,
``POST /v1/completions``, ``POST /v1/chat/completions``.

Like ``api/inference.py`` they translate HTTP to Jobs and results back and know nothing about
batching: a request becomes one Job whose body is the text_generation handler's request
(protocol.py maps the parameters), submitted through the registry; the handler's per-step chunks
(``{"text", "token_ids", "finish_reason", "prompt_tokens", "completion_tokens"}``) become one JSON
answer or Server-Sent Events ending with ``data: [DONE]``. Empty chunks (a request waiting for KV
budget or in a chunked prefill) are skipped. A client that goes away cancels its job exactly as on
the REST route (the aggregator drops it from the queue or sends one CANCEL). Every error, ours or the
handler's, is answered in OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

from aiohttp import web

from backend.protocol import InputParameter, WireResult
from frontend.api.common import request_id
from frontend.api.payload import check_content_length
from frontend.config import ServerConfig
from frontend.errors import ConveyorError, ModelNotFound
from frontend.jobs import Job
from frontend.metrics import ServerMetrics, status_class
from frontend.models import ModelRegistry, ModelVersion
from frontend.openai.llm_load import STATS_HEADER, LLMLoad
from frontend.openai.protocol import (
    SSE_DONE, Completion, Endpoint, GenerationRequest, OpenAIError, finish_reason, parse_json_body, parse_request, sse,
)
from frontend.sinks import Failure, ResponseSink

log = logging.getLogger(__name__)

def error_response(error: OpenAIError) -> web.Response:
    headers = {"Retry-After": str(error.retry_after)} if error.retry_after is not None else None
    return web.json_response(error.to_json(), status=error.status, headers=headers)


def from_conveyor(exc: ConveyorError) -> OpenAIError:
    """Our typed errors (unknown model, queue full, worker lost, timeout...) in OpenAI's shape."""
    code = "model_not_found" if isinstance(exc, ModelNotFound) else None
    return OpenAIError(exc.status, exc.message, "model" if code else None, code, exc.retry_after)


class _Generation:
    """One request's job on its way: reads the sink, skips empty chunks, keeps the LLM metrics."""

    __slots__ = (
        "_itl",
        "_prompt_tokens",
        "_tokens",
        "_ttft",
        "completion",
        "job",
        "last_token_at",
        "load",
        "model",
        "sink",
        "started",
    )

    def __init__(self, api: OpenAIApi, model: ModelVersion, job: Job, sink: ResponseSink,
                 completion: Completion, started: float) -> None:
        self.load = api.load
        self.model = model
        self.job = job
        self.sink = sink
        self.completion = completion
        self.started = started
        self.last_token_at: float | None = None
        metrics, name = api.metrics, model.name  # label children bound once, not per token
        self._ttft = metrics.llm_time_to_first_token.labels(name)
        self._itl = metrics.llm_inter_token_latency.labels(name)
        self._tokens = metrics.llm_generation_tokens.labels(name)
        self._prompt_tokens = metrics.llm_prompt_tokens.labels(name)

    async def next_chunk(self) -> dict[str, Any]:
        """The next chunk with text, tokens or a finish reason; OpenAIError when the job failed."""
        model = self.model
        while True:
            item = await self.sink.next()
            if isinstance(item, Failure):
                raise from_conveyor(item.error)
            self.load.observe(model.name, model.version, self.job.worker_id, item)
            if item.status >= 400:
                raise OpenAIError(item.status, _error_message(item))
            chunk = _decode_chunk(model.name, item)
            num_tokens = len(chunk["token_ids"])
            if num_tokens:
                now = time.monotonic()
                if self.last_token_at is None:
                    self._ttft.observe(now - self.started)
                else:
                    self._itl.observe((now - self.last_token_at) / num_tokens)
                self.last_token_at = now
                self._tokens.inc(num_tokens)
            completion = self.completion
            completion.prompt_tokens = int(chunk.get("prompt_tokens") or completion.prompt_tokens)
            completion.completion_tokens = int(chunk.get("completion_tokens") or completion.completion_tokens)
            if item.done:
                completion.finish_reason = finish_reason(chunk.get("finish_reason")) or "stop"
                self._prompt_tokens.inc(completion.prompt_tokens)
                return chunk
            if chunk["text"] or num_tokens:
                return chunk


def _error_message(result: WireResult) -> str:
    if result.message:
        return result.message
    try:
        return str(json.loads(result.body)["error"])
    except (ValueError, KeyError, TypeError):
        return f"the model answered with status {result.status}"


def _decode_chunk(model: str, result: WireResult) -> dict[str, Any]:
    try:
        chunk = json.loads(result.body)
    except ValueError:
        chunk = None
    if not isinstance(chunk, dict) or not isinstance(chunk.get("text"), str):
        raise OpenAIError(500, f"model '{model}' did not answer with text-generation chunks; the OpenAI routes "
                               "serve models with the text_generation handler (or its chunk format)")
    chunk.setdefault("token_ids", [])
    return chunk


class OpenAIApi:
    def __init__(self, registry: ModelRegistry, config: ServerConfig, metrics: ServerMetrics) -> None:
        self.registry = registry
        self.config = config
        self.metrics = metrics
        self.load = LLMLoad(registry)
        metrics.watch_llm(self.load.sample)

    def add_routes(self, app: web.Application) -> None:
        app.router.add_get("/v1/models", self.list_models)
        app.router.add_get("/v1/models/{model:.+}", self.get_model)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_route("*", "/v1/{tail:.*}", self.unknown_route)  # OpenAI-shaped 404 under /v1

    # Models -----------------------------------------------------------------------------------------

    def _model_card(self, name: str) -> dict[str, Any]:
        model = self.registry.get(name)
        return {"id": name, "object": "model", "created": int(model.registered_at), "owned_by": "conveyor",
                "root": name, "parent": None}

    async def list_models(self, request: web.Request) -> web.Response:
        cards = [self._model_card(name) for name in sorted(self.registry.models)]
        return web.json_response({"object": "list", "data": cards})

    async def get_model(self, request: web.Request) -> web.Response:
        try:
            return web.json_response(self._model_card(request.match_info["model"]))
        except ConveyorError as exc:
            return error_response(from_conveyor(exc))

    async def unknown_route(self, request: web.Request) -> web.Response:
        return error_response(OpenAIError(404, f"no route {request.method} {request.path} on this server "
                                               "(served: /v1/models, /v1/completions, /v1/chat/completions)"))

    # Generation -------------------------------------------------------------------------------------

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, Endpoint.COMPLETIONS)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, Endpoint.CHAT)

    async def _generate(self, request: web.Request, endpoint: Endpoint) -> web.StreamResponse:
        started = time.monotonic()
        model: ModelVersion | None = None
        job: Job | None = None
        response: web.StreamResponse | None = None
        try:
            try:
                generation_request = await self._read(request, endpoint)
                model = self.registry.get(generation_request.model)
                if model.config.sequence_batching:
                    raise OpenAIError(400, f"model '{model.name}' uses sequence batching; use /predictions",
                                      "model")
                job, run = self._submit(request, model, generation_request, started)
                response = await (self._stream(request, run) if generation_request.stream else self._answer(run))
            except ConveyorError as exc:
                raise from_conveyor(exc) from None
        except OpenAIError as exc:
            response = error_response(exc)
        except web.HTTPException as exc:  # body over max_request_size while reading
            response = error_response(OpenAIError(exc.status, exc.text or exc.reason))
        except Exception:  # a bug: answer 500 in the client's format, keep serving
            log.exception("unhandled error in %s %s", request.method, request.path)
            response = error_response(OpenAIError(500, "internal error"))
        finally:
            # No response: the client went away and aiohttp cancelled this handler.
            status = response.status if response is not None else 499
            if job is not None and model is not None:
                self.metrics.llm_active_sequences.labels(model.name).dec()
                if not job.state.finished:
                    # Client gone, or we stopped reading (an error): drop the queued job or CANCEL it.
                    job.sink.close()  # type: ignore[union-attr]
                    model.batcher.cancel(job)
            if model is not None:
                self.metrics.inference_requests.labels(model.name, status_class(status)).inc()
                self.metrics.inference_latency.labels(model.name).observe(time.monotonic() - started)
        return response

    async def _read(self, request: web.Request, endpoint: Endpoint) -> GenerationRequest:
        check_content_length(request, self.config.max_request_size)
        raw = await request.read()  # bounded by the app's client_max_size
        return parse_request(endpoint, parse_json_body(raw))

    def _submit(self, request: web.Request, model: ModelVersion, generation_request: GenerationRequest,
                started: float) -> tuple[Job, _Generation]:
        rid = request_id(request)
        # The handler needs none of the client's headers (the worker copies a request's headers into
        # its context at every step, so fewer is cheaper); it gets the one that asks for its load.
        headers = [(STATS_HEADER, "1")]
        body = json.dumps(generation_request.body).encode()
        sink = ResponseSink()
        now = model.batcher.clock()
        timeout_ms = model.config.client_timeout_ms
        job = Job(rid, model.name, model.version, headers, (InputParameter("body", "application/json", body),),
                  sink=sink, created_at=now, deadline=now + timeout_ms / 1000.0 if timeout_ms else None)
        model.submit(job)  # QueueFull / NoWorkers: raised now
        self.metrics.llm_active_sequences.labels(model.name).inc()
        prefix = "chatcmpl-" if generation_request.endpoint is Endpoint.CHAT else "cmpl-"
        return job, _Generation(self, model, job, sink, Completion(generation_request, prefix + rid), started)

    async def _answer(self, run: _Generation) -> web.Response:
        completion = run.completion
        while True:
            chunk = await run.next_chunk()
            completion.texts.append(chunk["text"])
            if completion.finish_reason is not None:
                return web.json_response(completion.response())

    async def _stream(self, request: web.Request, run: _Generation) -> web.StreamResponse:
        completion = run.completion
        # The first chunk comes before the headers: a request the handler refuses (prompt over the
        # context, bad parameter) gets a real HTTP 400, not a stream that fails.
        chunk = await run.next_chunk()
        response = web.StreamResponse(status=200, headers={"Content-Type": "text/event-stream",
                                                           "Cache-Control": "no-cache"})
        await response.prepare(request)
        try:
            if completion.chat:
                await response.write(sse(completion.chunk("", None, first=True)))
            while True:
                reason = completion.finish_reason
                if chunk["text"] or reason is not None:
                    await response.write(sse(completion.chunk(chunk["text"], reason)))
                if reason is not None:
                    break
                try:
                    chunk = await run.next_chunk()
                except OpenAIError as exc:  # after the headers: an error event, as vLLM sends it
                    await response.write(sse(exc.to_json()) + SSE_DONE)
                    return response
            if completion.request.include_usage:
                await response.write(sse(completion.usage_chunk()))
            await response.write(SSE_DONE)
            await response.write_eof()
        except ConnectionError:
            pass  # the client went away mid-stream; the caller sees the job unfinished and cancels it
        return response
