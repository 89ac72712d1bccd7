"""Continuous batching end to end (issue 5): a real server, the deterministic streaming handler
(examples/streaming: body {"n": N} streams N chunks {"i": k, "of": N}, one per step) on batchSize 2.

The handler logs ``STEP frame=<k> new=<ids> continuing=<ids> cancelled=<ids>`` per frame to the
worker's stderr, which the server forwards to its log (ConveyorProcess writes it to server.log):
the tests read the frames the backend really got from there. Request ids are chosen by the test
(``x-request-id``) so each test finds its own lines.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import time
import uuid
from dataclasses import dataclass
from datetime import datetime
from collections.abc import Iterator

import aiohttp
import pytest
import requests

from tests.integration.server import EXAMPLES, ConveyorProcess, build_mar, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

STREAMING = EXAMPLES / "streaming" / "streaming_handler.py"
CONTINUOUS_YAML = "minWorkers: 1\nmaxWorkers: 1\nbatchSize: 2\nmaxBatchDelay: 200\ncontinuousBatching: true\n"
# No continuousBatching key: the register parameter continuous_batching=true must reach the handler.
PLAIN_YAML = "minWorkers: 1\nmaxWorkers: 1\nbatchSize: 2\nmaxBatchDelay: 20\n"

# The streaming handler, made to raise in a chosen step: body {"n": N, "raise_at": k} fails the
# frame in which that request would emit chunk k. It logs the frame's ids first.
FAILING_HANDLER = '''
import logging
from streaming_handler import StreamingHandler

logger = logging.getLogger("failing_handler")


class FailingStreamingHandler(StreamingHandler):
    def handle(self, data, context):
        for idx, row in enumerate(data):
            body = row.get("body")
            rid = context.get_request_id(idx)
            if isinstance(body, dict) and self.steps.get(rid, 0) == body.get("raise_at", -1):
                logger.info("RAISE ids=%s", ",".join(context.request_ids.values()))
                raise RuntimeError("asked to fail at step %d" % body["raise_at"])
        return super().handle(data, context)
'''

# Anchored on the forwarding logger, so the stderr tails quoted in worker-failure messages do not count.
STEP_LINE = re.compile(r"conveyor\.worker\.(?P<worker>\S+): \[[^\]]+\] (?P<ts>\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) INFO streaming_handler - "
                       r"STEP frame=(?P<frame>\d+) new=(?P<new>\S+) continuing=(?P<cont>\S+) cancelled=(?P<cancel>\S+)")


@dataclass(frozen=True)
class Step:
    worker: str
    at: float  # wall-clock seconds (the worker's log timestamp, ms resolution)
    frame: int
    new: frozenset[str]
    continuing: frozenset[str]
    cancelled: frozenset[str]

    @property
    def active(self) -> frozenset[str]:
        return self.new | self.continuing


def _ids(text: str) -> frozenset[str]:
    return frozenset() if text == "-" else frozenset(text.split(","))


def steps(server: ConveyorProcess, ids: set[str]) -> list[Step]:
    """The STEP lines of frames that carried any of ``ids``, in log order."""
    out = []
    for match in STEP_LINE.finditer(server.log_path.read_text(errors="replace")):
        step = Step(match["worker"], datetime.strptime(match["ts"], "%Y-%m-%d %H:%M:%S,%f").timestamp(),
                    int(match["frame"]), _ids(match["new"]), _ids(match["cont"]), _ids(match["cancel"]))
        if (step.active | step.cancelled) & ids:
            out.append(step)
    return out


def rid(tag: str) -> str:
    return f"{tag}-{uuid.uuid4().hex[:8]}"


def expected_chunks(n: int) -> list[bytes]:
    return [json.dumps({"i": k, "of": n}).encode() for k in range(n)]


@pytest.fixture(scope="module")
def cserver(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ConveyorProcess]:
    root = tmp_path_factory.mktemp("continuous")
    store = root / "store"
    store.mkdir()
    (root / "continuous.yaml").write_text(CONTINUOUS_YAML)
    (root / "plain.yaml").write_text(PLAIN_YAML)
    (root / "failing_handler.py").write_text(FAILING_HANDLER)
    build_mar(store, "cstream", STREAMING, root / "continuous.yaml")
    build_mar(store, "cfail", root / "failing_handler.py", root / "continuous.yaml", extra=["--extra-files", str(STREAMING)])
    build_mar(store, "cplain", STREAMING, root / "plain.yaml")
    with ConveyorProcess(root / "server", model_store=store, models=["cstream=cstream.mar", "cfail=cfail.mar"],
                         properties={"default_workers_per_model": "1"}) as proc:
        yield proc


@dataclass
class Streamed:
    status: int
    headers: dict[str, str]
    chunks: list[bytes]  # one entry per HTTP chunk, exactly as framed on the wire


async def stream(session: aiohttp.ClientSession, url: str, request_id: str, body: dict,
                 headers: dict[str, str] | None = None) -> Streamed:
    async with session.post(url, json=body, headers={"x-request-id": request_id, **(headers or {})}) as response:
        chunks, buf = [], b""
        async for data, end_of_chunk in response.content.iter_chunks():
            buf += data
            if end_of_chunk and buf:  # the terminating zero-length chunk is not a result
                chunks.append(buf)
                buf = b""
        if buf:
            chunks.append(buf)
        return Streamed(response.status, dict(response.headers), chunks)


def run_streams(url: str, requests_: list[tuple[str, dict]], headers: dict[str, str] | None = None) -> list[Streamed]:
    async def main() -> list[Streamed]:
        timeout = aiohttp.ClientTimeout(total=60)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            return await asyncio.gather(*(stream(session, url, r, body, headers) for r, body in requests_))

    return asyncio.run(main())


def wait_for_steps(server: ConveyorProcess, ids: set[str], count: int) -> list[Step]:
    """The log is forwarded asynchronously: wait (bounded) until ``count`` frames with ``ids`` are in."""
    wait_until(lambda: len(steps(server, ids)) >= count, timeout=10)
    return steps(server, ids)


def test_four_streams_on_batch_size_two_join_the_running_batch(cserver: ConveyorProcess) -> None:
    lengths = [4, 6, 8, 10]  # distinct by >= 2: two streams started together never end in the same step
    ids = [rid(f"four{n}") for n in lengths]
    results = run_streams(f"{cserver.inference}/predictions/cstream",
                          [(i, {"n": n, "step_ms": 30}) for i, n in zip(ids, lengths)])
    for result, n in zip(results, lengths):
        assert result.status == 200
        assert result.headers["Transfer-Encoding"] == "chunked" and result.headers["ts_stream_next"] == "true"
        assert result.chunks == expected_chunks(n)

    frames = wait_for_steps(cserver, set(ids), sum(lengths) // 2)
    assert all(len(step.active) <= 2 for step in frames), frames  # batchSize 2, never exceeded
    for request_id, n in zip(ids, lengths):  # exactly one NEW, then CONTINUE until done: n steps each
        assert sum(request_id in step.new for step in frames) == 1
        assert sum(request_id in step.continuing for step in frames) == n - 1
    # Jobs joined the running batch between steps: the third stream to start was admitted in a frame
    # that also carried a CONTINUE (a slot freed while another stream ran), not after the batch drained.
    started = [next(step for step in frames if request_id in step.new) for request_id in ids]
    third = sorted(started, key=lambda step: step.frame)[2]
    assert third.continuing & set(ids), frames


def test_sse_non_streaming_and_single_result_responses(cserver: ConveyorProcess) -> None:
    url = f"{cserver.inference}/predictions/cstream"
    [sse] = run_streams(url, [(rid("sse"), {"n": 3})], headers={"Accept": "text/event-stream"})
    assert sse.status == 200 and sse.headers["Content-Type"].startswith("text/event-stream")
    events = b"".join(sse.chunks).decode().split("\n\n")
    assert events == [f"data: {chunk.decode()}" for chunk in expected_chunks(3)] + [""]

    whole = requests.post(url, json={"n": 3}, headers={"x-conveyor-stream": "false"}, timeout=30)
    assert whole.status_code == 200 and "Transfer-Encoding" not in whole.headers
    assert whole.content == b"".join(expected_chunks(3))

    with socket.create_connection(("127.0.0.1", cserver.ports["inference"]), timeout=30) as sock:  # HTTP/1.0
        body = b'{"n": 2}'
        sock.sendall(b"POST /predictions/cstream HTTP/1.0\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    head, _, content = data.partition(b"\r\n\r\n")
    assert b" 200 " in head.split(b"\r\n")[0] and b"chunked" not in head.lower()
    assert content == b"".join(expected_chunks(2))

    single = requests.post(url, json={"n": 1}, timeout=30)
    assert single.status_code == 200 and "Transfer-Encoding" not in single.headers
    assert "ts_stream_next" not in single.headers and single.content == expected_chunks(1)[0]


def test_disconnect_after_first_chunk_cancels_within_two_steps(cserver: ConveyorProcess) -> None:
    request_id = rid("cut")
    body = b'{"n": 50, "step_ms": 200}'
    with socket.create_connection(("127.0.0.1", cserver.ports["inference"]), timeout=30) as sock:
        sock.sendall(b"POST /predictions/cstream HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"x-request-id: %s\r\nContent-Length: %d\r\n\r\n%s" % (request_id.encode(), len(body), body))
        received = b""
        while b'"i": 0' not in received:
            data = sock.recv(65536)
            assert data, "the server closed the stream before its first chunk"
            received += data
        closed_at = time.time()  # taken before close: steps that start later are counted against us
    # The CANCEL reaches the handler's cancel hook, which logs ``CANCEL ids=…`` before the frame's
    # STEP line (a frame of CANCELs only has no STEP line: the worker does not call handle then).
    cancel_line = re.compile(rf"conveyor\.worker\.\S+: .* CANCEL ids=(\S+,)?{request_id}(,\S+)?$", re.M)
    assert wait_until(lambda: cancel_line.search(cserver.log_path.read_text()) is not None, timeout=15)
    log = cserver.log_path.read_text()
    assert len(cancel_line.findall(log)) == 1  # exactly one CANCEL
    cancelled_at = cancel_line.search(log).start()  # type: ignore[union-attr]
    ran = [m for m in STEP_LINE.finditer(log) if request_id in _ids(m["new"]) | _ids(m["cont"])]
    assert all(m.start() < cancelled_at for m in ran)  # never sent again after its CANCEL
    started = [datetime.strptime(m["ts"], "%Y-%m-%d %H:%M:%S,%f").timestamp() for m in ran]
    after_close = [at for at in started if at > closed_at]
    assert len(after_close) <= 2, (closed_at, started)
    assert len(ran) < 50
    metrics = requests.get(f"{cserver.metrics}/metrics", timeout=10).text
    assert re.search(r'conveyor_cancels_sent_total\{model="cstream"\} [1-9]', metrics), metrics


def test_handler_exception_fails_only_that_frames_requests(cserver: ConveyorProcess) -> None:
    url = f"{cserver.inference}/predictions/cfail"
    bad, other, late = rid("raise"), rid("bystander"), rid("late")

    async def main() -> list[Streamed]:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
            first = [asyncio.create_task(stream(session, url, bad, {"n": 8, "raise_at": 3, "step_ms": 30})),
                     asyncio.create_task(stream(session, url, other, {"n": 8, "step_ms": 30}))]
            # ``late`` queues behind the two running streams (batchSize 2) and runs after the failure.
            await asyncio.sleep(0.05)
            last = asyncio.create_task(stream(session, url, late, {"n": 3, "step_ms": 30}))
            return await asyncio.gather(*first, last)

    results = dict(zip((bad, other, late), asyncio.run(main())))
    assert wait_until(lambda: "RAISE ids=" in cserver.log_path.read_text(), timeout=10)
    raised = set(re.search(r"RAISE ids=(\S+)", cserver.log_path.read_text())[1].split(","))  # type: ignore[index]
    assert bad in raised
    for request_id, result in results.items():
        assert result.status == 200  # the stream had started: the error is a chunk
        if request_id in raised:
            *good, error = result.chunks
            assert good == expected_chunks(8)[:len(good)]
            failure = json.loads(error)
            assert failure["code"] == 503 and "asked to fail at step 3" in failure["message"]
        else:  # not in the failing frame: unaffected
            assert result.chunks == expected_chunks(8 if request_id == other else 3)
    assert results[bad].chunks[:3] == expected_chunks(8)[:3]
    assert late not in raised  # it was queued (capacity 2) and ran after the failure
    again = requests.post(url, json={"n": 2}, headers={"x-conveyor-stream": "false"}, timeout=30)
    assert again.status_code == 200 and again.content == b"".join(expected_chunks(2))


def test_worker_death_ends_every_open_stream_with_an_error_chunk(cserver: ConveyorProcess) -> None:
    url = f"{cserver.inference}/predictions/cfail"
    assert wait_until(lambda: [w["status"] for w in cserver.describe("cfail")["workers"]] == ["READY"], timeout=30)
    [pid] = cserver.worker_pids("cfail")

    doomed = {rid("doomed"), rid("doomed")}

    async def main() -> list[Streamed]:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
            tasks = [asyncio.create_task(stream(session, url, r, {"n": 500, "step_ms": 20})) for r in doomed]
            for _ in range(400):  # bounded: until both streams run in the backend
                if {r for step in steps(cserver, doomed) for r in step.continuing} >= doomed:
                    break
                await asyncio.sleep(0.05)
            os.kill(pid, signal.SIGKILL)
            return await asyncio.gather(*tasks)

    for result in asyncio.run(main()):
        assert result.status == 200 and len(result.chunks) >= 2
        error = json.loads(result.chunks[-1])
        assert error["code"] == 500 and str(pid) in error["message"], error
        assert all(json.loads(c)["of"] == 500 for c in result.chunks[:-1])
    assert wait_until(lambda: [w["status"] for w in cserver.describe("cfail")["workers"]] == ["READY"], timeout=60)
    assert requests.post(url, json={"n": 1}, timeout=30).status_code == 200


def test_register_parameter_continuous_batching_reaches_the_handler(cserver: ConveyorProcess) -> None:
    """cplain's model-config.yaml has no continuousBatching: the register parameter turns it on, and
    the handler (which reads context.model_yaml_config) streams one step per frame accordingly."""
    register = requests.post(f"{cserver.management}/models", params={
        "url": "cplain.mar", "continuous_batching": "true", "initial_workers": "1", "synchronous": "true"}, timeout=120)
    assert register.status_code == 200, register.text
    try:
        assert cserver.describe("cplain")["continuousBatching"] is True
        request_id = rid("plain")
        [result] = run_streams(f"{cserver.inference}/predictions/cplain", [(request_id, {"n": 3})])
        assert result.chunks == expected_chunks(3)
        # Continuous decode: three frames (NEW, CONTINUE, CONTINUE); plain batching would be one
        # frame streaming its chunks as intermediate replies.
        frames = wait_for_steps(cserver, {request_id}, 3)
        assert [request_id in s.new for s in frames] == [True, False, False]
        assert all(request_id in s.continuing for s in frames[1:])
    finally:
        requests.delete(f"{cserver.management}/models/cplain", timeout=60)


def test_step_metrics_are_exported_per_model(cserver: ConveyorProcess) -> None:
    run_streams(f"{cserver.inference}/predictions/cstream", [(rid("metrics"), {"n": 3})])
    text = requests.get(f"{cserver.metrics}/metrics", timeout=10).text

    def value(name: str) -> float:
        match = re.search(rf'^{name}\{{model="cstream"\}} (\S+)$', text, re.M)
        assert match, f"{name} missing"
        return float(match[1])

    assert value("conveyor_steps_total") >= 3
    assert value("conveyor_batch_size_count") == value("conveyor_steps_total")
    assert value("conveyor_time_to_first_chunk_seconds_count") >= 1
    assert value("conveyor_time_between_chunks_seconds_count") >= 2
    assert value("conveyor_queue_latency_seconds_count") >= 1
    assert value("conveyor_step_overhead_seconds_count") >= 2
