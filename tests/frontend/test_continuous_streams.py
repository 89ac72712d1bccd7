"""Issue 5 without processes: the shapes of streamed HTTP responses (chunked, SSE, buffered, error
chunks, ts_stream_next) and the step loop's metrics against a fake continuous backend."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from pathlib import Path
from collections.abc import Awaitable, Callable

import pytest
from aiohttp.test_utils import TestClient, TestServer

from backend.protocol import InferReply, InferRequest, RequestState, WireResult, read_message, write_message
from frontend.batching.base import BatchConfig
from frontend.batching.model_batcher import ModelBatcher
from frontend.jobs import Job
from frontend.metrics import ServerMetrics
from frontend.sinks import ResponseSink
from frontend.workers.worker import Worker, WorkerSpec
from tests.frontend.test_http_layer import stream_app

pytestmark = pytest.mark.timeout(20)

Item = WireResult | tuple[int, str]


def with_client(results: list[Item], body: Callable[[TestClient], Awaitable[None]]) -> None:
    async def main() -> None:
        async with TestClient(TestServer(stream_app(results, extra={}))) as client:
            await body(client)

    asyncio.run(main())


def chunk(i: int, done: bool = False, status: int = 200, message: str = "") -> WireResult:
    return WireResult("r", status, done, message, "application/json", (("ts_stream_next", "true"),),
                      json.dumps({"i": i}).encode())


def test_chunked_stream_has_one_chunk_per_result_and_ts_stream_next() -> None:
    async def body(client: TestClient) -> None:
        response = await client.post("/s")
        assert response.status == 200 and response.headers["Transfer-Encoding"] == "chunked"
        assert response.headers["ts_stream_next"] == "true"  # TorchServe's header on a streamed response
        assert response.headers["Content-Type"] == "application/json"
        chunks, buf = [], b""
        async for data, end in response.content.iter_chunks():
            buf += data
            if end:
                chunks.append(buf)
                buf = b""
        assert chunks == [b'{"i": 0}', b'{"i": 1}', b'{"i": 2}']

    with_client([chunk(0), chunk(1), chunk(2, done=True)], body)


def test_first_result_done_is_a_complete_response_without_stream_headers() -> None:
    async def body(client: TestClient) -> None:
        response = await client.post("/s", headers={"Accept": "text/event-stream"})
        assert response.status == 200 and "Transfer-Encoding" not in response.headers
        assert "ts_stream_next" not in response.headers  # framing of the backend message, not of HTTP
        assert response.headers["Content-Length"] == "8" and await response.read() == b'{"i": 0}'

    with_client([chunk(0, done=True)], body)


def test_non_streaming_client_gets_the_whole_output_once_done() -> None:
    async def body(client: TestClient) -> None:
        for value in ("false", "0", "no"):
            response = await client.post("/s", headers={"x-conveyor-stream": value})
            assert response.status == 200 and "Transfer-Encoding" not in response.headers
            assert await response.read() == b'{"i": 0}{"i": 1}{"i": 2}'

    with_client([chunk(0), chunk(1), chunk(2, done=True)], body)


def test_handler_error_mid_stream_is_an_error_chunk() -> None:
    """A step that fails (status >= 400, e.g. the handler raised) after the stream started."""
    failed = WireResult("r", 503, True, "Prediction failed: RuntimeError: boom")

    async def body(client: TestClient) -> None:
        text = await (await client.post("/s")).text()
        first, _, rest = text.partition("}")
        assert first + "}" == '{"i": 0}'
        error = json.loads(rest)
        assert error["code"] == 503 and "boom" in error["message"]
        sse = await (await client.post("/s", headers={"Accept": "text/event-stream"})).text()
        events = sse.split("\n\n")
        assert events[0] == 'data: {"i": 0}' and events[1].startswith("event: error\ndata: ") and "boom" in events[1]
        buffered = await client.post("/s", headers={"x-conveyor-stream": "false"})
        assert buffered.status == 503 and "boom" in (await buffered.json())["message"]

    with_client([chunk(0), failed], body)


def test_first_result_failed_is_a_complete_error_even_if_not_done() -> None:
    async def body(client: TestClient) -> None:
        response = await client.post("/s")
        assert response.status == 400 and "Transfer-Encoding" not in response.headers
        assert await response.json() == {"code": 400, "type": "PredictionException", "message": "bad input"}

    with_client([WireResult("r", 400, False, "bad input")], body)


# The step loop's metrics ---------------------------------------------------------------------------


def spec(batch_size: int) -> WorkerSpec:
    return WorkerSpec("m", "1.0", "/nonexistent", "h.py", batch_size, 1 << 20, 1 << 20, 5.0, 5.0, 1.0, {}, {},
                      Path("/tmp"))


async def counting_peer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, frames: list[InferRequest]) -> None:
    """A continuous backend: request ``rK`` streams K chunks, one per frame (body = chunk index)."""
    steps: dict[str, int] = {}
    while True:
        frame = await read_message(reader)
        assert isinstance(frame, InferRequest)
        frames.append(frame)
        results = []
        for req in frame.requests:
            if req.state == RequestState.CANCEL:
                steps.pop(req.request_id, None)
                continue
            k = steps.get(req.request_id, 0)
            n = int(req.request_id[1:])
            done = k == n - 1
            steps[req.request_id] = k + 1
            results.append(WireResult(req.request_id, 200, done, body=str(k).encode()))
        write_message(writer, InferReply(frame.frame_id, True, tuple(results)))
        await writer.drain()


def sample(metrics: ServerMetrics, name: str, **labels: str) -> float:
    value = metrics.registry.get_sample_value(name, {"model": "m", **labels})
    return 0.0 if value is None else value


def test_step_loop_metrics_and_cancel_in_the_next_frame() -> None:
    async def main() -> None:
        metrics = ServerMetrics()
        batcher = ModelBatcher("m", BatchConfig(batch_size=2, max_batch_delay=0.0, continuous=True), time.monotonic)
        worker = Worker("w1", spec(2), batcher, metrics)
        batcher.add_listener(worker.wake)
        ours, theirs = socket.socketpair()
        reader, writer = await asyncio.open_connection(sock=ours)
        peer_reader, peer_writer = await asyncio.open_connection(sock=theirs)
        frames: list[InferRequest] = []
        peer = asyncio.create_task(counting_peer(peer_reader, peer_writer, frames))
        loop_task = asyncio.create_task(worker._step_loop(batcher.add_worker("w1"), reader, writer))
        try:
            jobs = [Job(rid, "m", sink=ResponseSink(), created_at=time.monotonic()) for rid in ("r3", "r100000", "r2")]
            for job in jobs:
                batcher.submit(job)
            bodies = []
            for job in (jobs[0], jobs[2]):
                got = []
                while not got or not got[-1].done:
                    got.append(await asyncio.wait_for(job.sink.next(), 5))  # type: ignore[union-attr]
                bodies.append([r.body for r in got])
            assert bodies == [[b"0", b"1", b"2"], [b"0", b"1"]]
            await asyncio.wait_for(jobs[1].sink.next(), 5)  # type: ignore[union-attr]  # r1000 is streaming
            batcher.cancel(jobs[1])
            for _ in range(200):  # bounded: the CANCEL goes out in the next frame
                if any(r.state == RequestState.CANCEL for f in frames for r in f.requests):
                    break
                await asyncio.sleep(0.01)
        finally:
            loop_task.cancel()
            peer.cancel()
            await asyncio.gather(loop_task, peer, return_exceptions=True)
            writer.close()
            peer_writer.close()
        cancel_frames = [f for f in frames if any(r.state == RequestState.CANCEL for r in f.requests)]
        assert len(cancel_frames) == 1 and [r.request_id for r in cancel_frames[0].requests] == ["r100000"]
        assert sample(metrics, "conveyor_steps_total") == len(frames)
        assert sample(metrics, "conveyor_batch_size_count") == len(frames)
        assert sample(metrics, "conveyor_batch_size_bucket", le="2.0") == len(frames)  # capacity 2, never more
        assert sample(metrics, "conveyor_cancels_sent_total") == 1
        assert sample(metrics, "conveyor_queue_latency_seconds_count") == 3
        assert sample(metrics, "conveyor_time_to_first_chunk_seconds_count") == 3
        num_results = 3 + 2 + sum(1 for f in frames for r in f.requests if r.request_id == "r100000"
                                  and r.state != RequestState.CANCEL)
        assert sample(metrics, "conveyor_time_between_chunks_seconds_count") == num_results - 3
        # Every frame but the first and the cancel-only last follows a reply at once (a busy worker).
        assert sample(metrics, "conveyor_step_overhead_seconds_count") >= len(frames) - 2

    asyncio.run(main())
