"""The worker step loop against a fake backend on a socketpair: frames out, replies in, results to
sinks; streaming replies; protocol errors and timeouts end the loop; an idle loop sleeps."""

from __future__ import annotations

import asyncio
import socket
import time
from pathlib import Path
from collections.abc import Awaitable, Callable

import pytest

from backend.protocol import InferReply, InferRequest, ProtocolError, WireResult, read_message, write_message
from frontend.batching.base import BatchConfig
from frontend.batching.model_batcher import ModelBatcher
from frontend.jobs import Job
from frontend.metrics import ServerMetrics
from frontend.sinks import ResponseSink
from frontend.workers.worker import Worker, WorkerSpec

pytestmark = pytest.mark.timeout(20)

Peer = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


def spec(response_timeout: float = 5.0, batch_size: int = 4) -> WorkerSpec:
    return WorkerSpec("m", "1.0", "/nonexistent", "h.py", batch_size, 1 << 20, 1 << 20, 5.0, response_timeout, 1.0,
                      {}, {}, Path("/tmp"))


async def run_loop(peer: Peer, jobs: int, batch: BatchConfig, response_timeout: float = 5.0,
                   body: Callable[[ModelBatcher, list[Job]], Awaitable[None]] | None = None) -> list[Job]:
    batcher = ModelBatcher("m", batch, time.monotonic)
    worker = Worker("w1", spec(response_timeout, batch.batch_size), batcher, ServerMetrics())
    batcher.add_listener(worker.wake)
    ours, theirs = socket.socketpair()
    reader, writer = await asyncio.open_connection(sock=ours)
    peer_reader, peer_writer = await asyncio.open_connection(sock=theirs)
    peer_task = asyncio.create_task(peer(peer_reader, peer_writer))
    aggregator = batcher.add_worker("w1")
    loop_task = asyncio.create_task(worker._step_loop(aggregator, reader, writer))
    made = [Job(f"r{i}", "m", sink=ResponseSink(), created_at=time.monotonic()) for i in range(jobs)]
    try:
        for job in made:
            batcher.submit(job)
        if body is not None:
            await body(batcher, made)
        else:
            for job in made:
                assert job.sink is not None
                await asyncio.wait_for(_drain(job.sink), 5)  # type: ignore[arg-type]
    finally:
        loop_task.cancel()
        peer_task.cancel()
        await asyncio.gather(loop_task, peer_task, return_exceptions=True)
        writer.close()
        peer_writer.close()
    return made


async def _drain(sink: ResponseSink) -> list:
    items = []
    while True:
        item = await sink.next()
        items.append(item)
        if not isinstance(item, WireResult) or item.done:
            return items


async def echo_peer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, chunks: int = 1) -> None:
    while True:
        frame = await read_message(reader)
        assert isinstance(frame, InferRequest)
        for k in range(chunks):
            last = k == chunks - 1
            results = [WireResult(r.request_id, 200, last, body=f"{r.request_id}:{k}:{len(frame.requests)}".encode())
                       for r in frame.requests]
            write_message(writer, InferReply(frame.frame_id, last, results))
        await writer.drain()


def test_jobs_are_batched_and_delivered_by_request_id() -> None:
    async def main() -> None:
        seen: dict[str, list] = {}

        async def body(batcher: ModelBatcher, jobs: list[Job]) -> None:
            for job in jobs:
                seen[job.request_id] = await asyncio.wait_for(_drain(job.sink), 5)  # type: ignore[arg-type]

        await run_loop(echo_peer, 6, BatchConfig(batch_size=4, max_batch_delay=0.05), body=body)
        assert [item.body.split(b":")[0].decode() for r in sorted(seen) for item in seen[r]] == sorted(seen)
        sizes = sorted(int(items[0].body.split(b":")[2]) for items in seen.values())
        assert sizes == [2, 2, 4, 4, 4, 4]  # one frame of 4 (full), one of the 2 left after the delay

    asyncio.run(main())


def test_intermediate_replies_stream_to_the_sink() -> None:
    async def main() -> None:
        async def peer(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            await echo_peer(r, w, chunks=3)

        async def body(batcher: ModelBatcher, jobs: list[Job]) -> None:
            items = await asyncio.wait_for(_drain(jobs[0].sink), 5)  # type: ignore[arg-type]
            assert [i.body for i in items] == [b"r0:0:1", b"r0:1:1", b"r0:2:1"] and items[-1].done

        await run_loop(peer, 1, BatchConfig(batch_size=1, max_batch_delay=0.0), body=body)

    asyncio.run(main())


@pytest.mark.parametrize("misbehaviour", ["wrong_frame", "timeout"])
def test_protocol_error_and_timeout_end_the_loop(misbehaviour: str) -> None:
    async def main() -> None:
        async def peer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            frame = await read_message(reader)
            assert isinstance(frame, InferRequest)
            if misbehaviour == "wrong_frame":
                write_message(writer, InferReply(frame.frame_id + 7, True, ()))
                await writer.drain()
            await asyncio.sleep(30)

        batcher = ModelBatcher("m", BatchConfig(batch_size=1, max_batch_delay=0.0), time.monotonic)
        worker = Worker("w1", spec(response_timeout=0.2, batch_size=1), batcher, ServerMetrics())
        ours, theirs = socket.socketpair()
        reader, writer = await asyncio.open_connection(sock=ours)
        peer_reader, peer_writer = await asyncio.open_connection(sock=theirs)
        peer_task = asyncio.create_task(peer(peer_reader, peer_writer))
        aggregator = batcher.add_worker("w1")
        batcher.submit(Job("r0", "m", sink=ResponseSink(), created_at=time.monotonic()))
        expected = ProtocolError if misbehaviour == "wrong_frame" else asyncio.TimeoutError
        with pytest.raises(expected):
            await asyncio.wait_for(worker._step_loop(aggregator, reader, writer), 5)
        lost = batcher.worker_lost("w1")
        assert [job.request_id for job in lost] == ["r0"]  # the caller fails these
        peer_task.cancel()
        await asyncio.gather(peer_task, return_exceptions=True)
        writer.close()
        peer_writer.close()

    asyncio.run(main())


def test_idle_loop_sleeps_until_work_arrives() -> None:
    """No busy waiting: while idle the loop asks its aggregator only when woken."""

    async def main() -> None:
        async def body(batcher: ModelBatcher, jobs: list[Job]) -> None:
            aggregator = batcher.aggregators["w1"]
            calls = 0
            original = aggregator.next_frame

            def counting() -> object:
                nonlocal calls
                calls += 1
                return original()

            aggregator.next_frame = counting  # type: ignore[method-assign]
            await asyncio.sleep(0.3)
            assert calls <= 2, calls  # at most the wake-up already pending
            late = Job("late", "m", sink=ResponseSink(), created_at=time.monotonic())
            batcher.submit(late)
            items = await asyncio.wait_for(_drain(late.sink), 5)  # type: ignore[arg-type]
            assert items[-1].body.startswith(b"late:")

        await run_loop(echo_peer, 0, BatchConfig(batch_size=2, max_batch_delay=0.0), body=body)

    asyncio.run(main())
