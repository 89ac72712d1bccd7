"""gRPC inference API (TorchServe's ``InferenceAPIsService``): translates RPCs to Jobs and results
back, exactly as the REST layer does; knows nothing about batching.

* ``Predictions`` — unary; a streamed result is joined into one prediction.
* ``StreamPredictions`` — one message per result chunk; completes when the result is done, whether
  or not the handler sets a stream flag.
* ``StreamPredictions2`` — bidirectional, for sequences: each incoming request runs as soon as it
  arrives (so a cancel request of a sequence reaches a running stream of the same sequence); replies
  carry ``sequenceId``; a bad request is answered in-stream with ``status`` and the stream goes on.

Cancelling an RPC (or a client that disconnects) cancels its job: the next frame carries a CANCEL.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
import uuid
from collections.abc import AsyncIterator, Callable

import grpc
from google.protobuf import empty_pb2
from multidict import CIMultiDict, CIMultiDictProxy

from backend.protocol import InputParameter, RequestFlags, WireResult
from frontend.api.payload import sequence_fields
from frontend.config import ServerConfig
from frontend.errors import BadRequest, ConveyorError, PredictionError
from frontend.grpc_api.protos import inference_pb2, inference_pb2_grpc
from frontend.grpc_api.status_mapping import code_for_error, rpc_status
from frontend.jobs import Job
from frontend.metrics import ServerMetrics, status_class
from frontend.models import ModelRegistry
from frontend.models.health import health_status
from frontend.sinks import Failure, ResponseSink

# Token check of the auth layer: (api, Authorization metadata) → raises Unauthorized to refuse.
Authorize = Callable[[str, "str | None"], None]

# A client's x-request-id is kept when it is sane (tracing across proxies), as the REST API does.
_CLIENT_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")

# Metadata that is transport, not request headers for the handler.
_SKIP_METADATA = frozenset({"user-agent", "content-type", "te", "grpc-accept-encoding", "grpc-timeout", "authorization"})


def _result_error(result: WireResult) -> ConveyorError:
    return PredictionError(result.status, result.message or f"prediction failed with status {result.status}")


class InferenceService(inference_pb2_grpc.InferenceAPIsServiceServicer):
    def __init__(self, registry: ModelRegistry, config: ServerConfig, metrics: ServerMetrics,
                 authorize: Authorize | None = None) -> None:
        self.registry = registry
        self.config = config
        self.metrics = metrics
        self.authorize = authorize

    # Ping ------------------------------------------------------------------------------------------

    async def Ping(self, request: empty_pb2.Empty, context: grpc.aio.ServicerContext) -> inference_pb2.TorchServeHealthResponse:
        return inference_pb2.TorchServeHealthResponse(health=json.dumps({"status": health_status(self.registry)}))

    # Unary -----------------------------------------------------------------------------------------

    async def Predictions(self, request: inference_pb2.PredictionsRequest,
                          context: grpc.aio.ServicerContext) -> inference_pb2.PredictionResponse:
        bodies: list[bytes] = []
        sequence_id = ""
        try:
            async for result, sequence_id in self._run(request, context):
                bodies.append(result.body)
        except ConveyorError as exc:
            await context.abort(code_for_error(exc), exc.message)
        return inference_pb2.PredictionResponse(prediction=b"".join(bodies), **_seq(sequence_id))

    # Server streaming ------------------------------------------------------------------------------

    async def StreamPredictions(self, request: inference_pb2.PredictionsRequest,
                                context: grpc.aio.ServicerContext) -> AsyncIterator[inference_pb2.PredictionResponse]:
        try:
            async for result, sequence_id in self._run(request, context):
                yield inference_pb2.PredictionResponse(prediction=result.body, **_seq(sequence_id))
        except ConveyorError as exc:
            await context.abort(code_for_error(exc), exc.message)

    # Bidirectional (sequences) ---------------------------------------------------------------------

    async def StreamPredictions2(self, request_iterator: AsyncIterator[inference_pb2.PredictionsRequest],
                                 context: grpc.aio.ServicerContext) -> AsyncIterator[inference_pb2.PredictionResponse]:
        replies: asyncio.Queue[inference_pb2.PredictionResponse | None] = asyncio.Queue()
        tasks: set[asyncio.Task[None]] = set()

        async def run_one(request: inference_pb2.PredictionsRequest) -> None:
            sequence_id = request.sequenceId if request.HasField("sequenceId") else ""
            try:
                async for result, sequence_id in self._run(request, context):
                    await replies.put(inference_pb2.PredictionResponse(prediction=result.body, **_seq(sequence_id)))
            except ConveyorError as exc:
                # In-stream error: this request fails, the stream (and the sequence) go on.
                await replies.put(inference_pb2.PredictionResponse(
                    status=rpc_status(code_for_error(exc), exc.message), **_seq(sequence_id)))

        async def read_requests() -> None:
            # Requests start in arrival order; a sequence's own FIFO keeps them in order downstream.
            async for request in request_iterator:
                task = asyncio.create_task(run_one(request))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
                await asyncio.sleep(0)  # let it submit before the next request is read
            while tasks:
                await asyncio.gather(*list(tasks), return_exceptions=True)
            await replies.put(None)

        reader = asyncio.create_task(read_requests())
        try:
            while (reply := await replies.get()) is not None:
                yield reply
            await reader
        finally:
            reader.cancel()
            for task in list(tasks):
                task.cancel()
            await asyncio.gather(reader, *list(tasks), return_exceptions=True)

    # Shared: one request → Job → results ----------------------------------------------------------

    async def _run(self, request: inference_pb2.PredictionsRequest,
                   context: grpc.aio.ServicerContext) -> AsyncIterator[tuple[WireResult, str]]:
        """Submit one request as a Job and yield its results (with the sequence id) until done.
        Raises ConveyorError for anything that is not a successful result."""
        started = time.monotonic()
        metadata = CIMultiDict((k, v) for k, v in (context.invocation_metadata() or ()) if isinstance(v, str))
        if self.authorize is not None:
            self.authorize("inference", metadata.get("authorization"))
        if not request.model_name:
            raise BadRequest("model_name is required")
        model = self.registry.get(request.model_name, request.model_version or None)
        headers = [(k, v) for k, v in metadata.items() if k.lower() not in _SKIP_METADATA]
        parameters = [InputParameter(name, "", bytes(value)) for name, value in request.input.items()]
        sequence_id, flags = "", RequestFlags.NONE
        if model.config.sequence_batching:
            if request.HasField("sequenceId") and request.sequenceId:
                metadata[self.config.sequence_id_header] = request.sequenceId
            sequence_id, flags, generated = sequence_fields(CIMultiDictProxy(metadata), self.config)
            if generated:
                headers.append((self.config.sequence_id_header, sequence_id))
        sink = ResponseSink()
        now = model.batcher.clock()
        timeout_ms = model.config.client_timeout_ms
        client_id = metadata.get("x-request-id", "")
        job_id = client_id if _CLIENT_ID.fullmatch(client_id) else str(uuid.uuid4())
        job = Job(job_id, model.name, model.version, headers, parameters, sequence_id=sequence_id,
                  flags=flags, sink=sink, created_at=now, deadline=now + timeout_ms / 1000.0 if timeout_ms else None)
        status = 500
        submitted = False
        try:
            model.submit(job)
            submitted = True
            while True:
                item = await sink.next()
                if isinstance(item, Failure):
                    raise item.error
                if item.status >= 400:
                    raise _result_error(item)
                status = item.status
                yield item, sequence_id
                if item.done:
                    return
        except ConveyorError as exc:
            status = exc.status
            raise
        except BaseException:
            status = 499  # cancelled by the client
            raise
        finally:
            if submitted and not job.state.finished:
                sink.close()
                model.batcher.cancel(job)  # the next frame carries a CANCEL for it
            self.metrics.inference_requests.labels(model.name, status_class(status)).inc()
            self.metrics.inference_latency.labels(model.name).observe(time.monotonic() - started)


def _seq(sequence_id: str) -> dict[str, str]:
    return {"sequenceId": sequence_id} if sequence_id else {}
