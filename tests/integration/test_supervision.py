"""Supervision details through a real server (test_worker_failures.py covers a hung worker, an
exit mid-request and a handler error): kill -9 mid-request and mid-stream, exit 137 → 507, garbage
on the worker socket, a handler that exits in initialize (at registration and at startup), and the
frontend's side of the socket codec against a fake worker sending garbage (in-process)."""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import socket
import struct
import threading
import time
from typing import TypeVar
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import requests

from backend.protocol import MAGIC, VERSION, ConnectionClosed, InferRequest, MessageType, ProtocolError, read_message
from frontend.batching.base import BatchConfig
from frontend.batching.model_batcher import ModelBatcher
from frontend.jobs import Job
from frontend.metrics import ServerMetrics
from frontend.sinks import ResponseSink
from frontend.workers.worker import Worker, WorkerSpec
from tests.integration.server import EXAMPLES, ConveyorProcess, build_mar, wait_until

HANDLER = Path(__file__).parent / "handlers" / "chaos_handler.py"


F = TypeVar("F", bound=Callable[..., None])


def slow(test: F) -> F:
    """Process-starting tests (the in-process fuzz test at the end is not one)."""
    return pytest.mark.slow(pytest.mark.timeout(120)(test))


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    store = tmp_path_factory.mktemp("chaos_store")
    config = store / "chaos-config.yaml"
    config.write_text("minWorkers: 1\nbatchSize: 1\nmaxBatchDelay: 1\nresponseTimeout: 60\n")
    build_mar(store, "chaos", HANDLER, config)
    broken = store / "broken-config.yaml"
    broken.write_text("minWorkers: 1\nbatchSize: 1\nmaxRetryTimeoutInSec: 2\nhandler:\n  exit_in_initialize: true\n")
    build_mar(store, "broken", HANDLER, broken)
    build_mar(store, "streaming", EXAMPLES / "streaming" / "streaming_handler.py",
              EXAMPLES / "streaming" / "model-config.yaml")
    return store


@pytest.fixture(scope="module")
def chaos(store: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ConveyorProcess]:
    with ConveyorProcess(tmp_path_factory.mktemp("chaos"), model_store=store, models=["chaos.mar", "streaming.mar"],
                         properties={"default_workers_per_model": "1"}) as server:
        yield server


def call(server: ConveyorProcess, body: str, model: str = "chaos") -> requests.Response:
    return requests.post(f"{server.inference}/predictions/{model}", data=body.encode(),
                         headers={"Content-Type": "text/plain"}, timeout=60)


def recovered(server: ConveyorProcess, old_pid: int) -> None:
    """The worker was replaced (a new pid) and the next request succeeds."""
    again = call(server, "again")
    assert again.status_code == 200 and again.text == "again"
    worker = server.describe("chaos")["workers"][0]
    assert worker["pid"] not in (old_pid, -1) and worker["restarts"] >= 1 and worker["status"] == "READY"


@slow
def test_sigkill_mid_request_names_worker_and_signal(chaos: ConveyorProcess, tmp_path: Path) -> None:
    worker = chaos.describe("chaos")["workers"][0]
    marker = tmp_path / "in_handler"
    result: list[requests.Response] = []
    thread = threading.Thread(target=lambda: result.append(call(chaos, f"sleep:{marker}")))
    thread.start()
    try:
        assert wait_until(marker.exists, timeout=30)
        os.kill(worker["pid"], signal.SIGKILL)
    finally:
        thread.join(60)
    failed = result[0]
    assert failed.status_code == 500
    error = failed.json()
    assert error["type"] == "WorkerException"
    assert f"worker {worker['id']}" in error["message"] and "signal SIGKILL" in error["message"]
    recovered(chaos, worker["pid"])


@slow
def test_sigkill_mid_stream_ends_with_error_chunk(chaos: ConveyorProcess) -> None:
    pid = chaos.worker_pids("streaming")[0]
    chunks: list[bytes] = []
    with requests.post(f"{chaos.inference}/predictions/streaming", json={"n": 50, "step_ms": 100}, stream=True,
                       timeout=60) as response:
        assert response.status_code == 200
        for chunk in response.iter_content(chunk_size=None):
            chunks.append(chunk)
            if len(chunks) == 1:
                os.kill(pid, signal.SIGKILL)
    text = b"".join(chunks).decode()
    error = json.loads(text[text.rindex('{"code": '):])  # the stream's last chunk: TorchServe's error JSON
    assert error["type"] == "WorkerException" and "signal SIGKILL" in error["message"]
    assert '"i": 49' not in text
    ok = requests.post(f"{chaos.inference}/predictions/streaming", json={"n": 3}, timeout=60)
    assert ok.status_code == 200
    assert wait_until(lambda: chaos.worker_pids("streaming") not in ([], [pid]), timeout=10)


@slow
def test_exit_137_is_507_out_of_memory(chaos: ConveyorProcess) -> None:
    pid = chaos.worker_pids("chaos")[0]
    failed = call(chaos, "oom")
    assert failed.status_code == 507, failed.text
    error = failed.json()
    assert error["code"] == 507 and "exit code 137" in error["message"] and "out of memory" in error["message"]
    recovered(chaos, pid)


@slow
@pytest.mark.parametrize("kind, cause", [("magic", "bad magic"), ("oversize", "exceeds the limit")])
def test_garbage_on_the_socket_replaces_the_worker(chaos: ConveyorProcess, kind: str, cause: str) -> None:
    pid = chaos.worker_pids("chaos")[0]
    failed = call(chaos, f"garbage:{kind}")
    assert failed.status_code == 500
    message = failed.json()["message"]
    assert "broke the protocol" in message and cause in message, message
    recovered(chaos, pid)


@slow
def test_register_handler_exiting_in_initialize_reports_stderr(chaos: ConveyorProcess) -> None:
    response = requests.post(f"{chaos.management}/models", params={"url": "broken.mar", "initial_workers": "1"},
                             timeout=60)
    assert response.status_code == 500
    error = response.json()
    assert error["type"] == "ModelLoadException"
    assert "exit code 4" in error["message"] and "cannot open weights.bin" in error["message"]
    assert requests.get(f"{chaos.management}/models/broken", timeout=10).status_code == 404  # rolled back
    assert call(chaos, "still serving").text == "still serving"


@slow
def test_model_failing_at_startup_is_unhealthy_with_its_last_error(store: Path, tmp_path: Path) -> None:
    with ConveyorProcess(tmp_path, model_store=store, models=["chaos.mar", "broken.mar"],
                         properties={"default_workers_per_model": "1"}) as server:
        assert call(server, "fine").text == "fine"  # the server started and serves the healthy model
        assert wait_until(lambda: server.describe("broken")["workers"][0]["restarts"] >= 1, timeout=30)
        ping = requests.get(f"{server.inference}/ping", timeout=10)
        assert ping.status_code == 200 and ping.json()["status"] == "Partial Healthy"
        broken = ping.json()["unhealthyModels"]["broken"]
        assert broken["readyWorkers"] == 0 and broken["minWorkers"] == 1
        assert "exit code 4" in broken["lastError"] and "cannot open weights.bin" in broken["lastError"]
        worker = server.describe("broken")["workers"][0]
        assert worker["status"] in ("ERROR", "STARTING") and "cannot open weights.bin" in worker["lastError"]


# The frontend's side of the socket codec, in-process: a fake worker answers an INFER frame with
# garbage; the step loop must end with a protocol error or a closed connection (which the
# supervisor turns into "replace the worker, fail its jobs"), never hang or raise anything else.

def _garbage_cases() -> list[bytes]:
    rng = random.Random(9)
    header = struct.Struct("!4sBBHI")
    cases = [
        b"\x00" * 12,
        header.pack(b"XXXX", VERSION, MessageType.INFER_REPLY, 0, 0),
        header.pack(MAGIC, VERSION + 7, MessageType.INFER_REPLY, 0, 0),
        header.pack(MAGIC, VERSION, 99, 0, 0),
        header.pack(MAGIC, VERSION, MessageType.INFER_REPLY, 0, 0x7FFFFFFF),
        header.pack(MAGIC, VERSION, MessageType.INFER_REPLY, 0, 64) + b"\xff" * 64,  # undecodable payload
        header.pack(MAGIC, VERSION, MessageType.INFER_REPLY, 0, 64) + b"\x01" * 10,  # truncated, then EOF
        header.pack(MAGIC, VERSION, MessageType.LOAD_REPLY, 0, 6) + b"\x00\xc8\x00\x00\x00\x00",  # wrong type
        b"CNV",  # half a header, then EOF
    ]
    cases += [rng.randbytes(rng.randint(1, 200)) for _ in range(20)]
    cases += [header.pack(MAGIC, VERSION, MessageType.INFER_REPLY, 0, n) + rng.randbytes(n)
              for n in (rng.randint(1, 300) for _ in range(20))]
    return cases


def test_fake_worker_sending_garbage_ends_the_step_loop_cleanly() -> None:
    async def one(garbage: bytes) -> BaseException:
        batcher = ModelBatcher("m", BatchConfig(batch_size=1, max_batch_delay=0.0), time.monotonic)
        spec = WorkerSpec("m", "1.0", "/nonexistent", "h.py", 1, 1 << 20, 1 << 20, 5.0, 2.0, 1.0, {}, {}, Path("/tmp"))
        worker = Worker("w1", spec, batcher, ServerMetrics())
        ours, theirs = socket.socketpair()
        reader, writer = await asyncio.open_connection(sock=ours)
        peer_reader, peer_writer = await asyncio.open_connection(sock=theirs)

        async def fake_worker() -> None:
            frame = await read_message(peer_reader)
            assert isinstance(frame, InferRequest)
            peer_writer.write(garbage)
            await peer_writer.drain()
            peer_writer.close()  # EOF after the garbage: a truncated frame must not wait forever

        peer = asyncio.create_task(fake_worker())
        aggregator = batcher.add_worker("w1")
        batcher.submit(Job("r0", "m", sink=ResponseSink(), created_at=time.monotonic()))
        try:
            await asyncio.wait_for(worker._step_loop(aggregator, reader, writer), 5)
        except BaseException as exc:  # noqa: BLE001 - what ended the loop is the result
            error: BaseException = exc
        else:
            error = AssertionError("the step loop returned normally")
        finally:
            await asyncio.gather(peer, return_exceptions=True)
            writer.close()
        assert [job.request_id for job in batcher.worker_lost("w1")] == ["r0"]  # the caller fails it
        return error

    async def main() -> None:
        for garbage in _garbage_cases():
            error = await one(garbage)
            assert isinstance(error, (ProtocolError, ConnectionClosed)), (garbage[:40], repr(error))

    asyncio.run(main())
