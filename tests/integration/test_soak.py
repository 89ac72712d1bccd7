"""No leaks (issue 9 §6): the state probe and describe's ``state`` blocks, and the soak's short mode.

* Without processes: the backend answers a state probe (``#state``) with its ``active`` table and the
  handler's live counts, after the rest of the frame ran, and never hands it to the handler; the
  frontend reads the answer; aggregators and the sequence table report what they hold.
* A real server: a running stream shows up in every table of describe?state=true (so the probe
  reports live state, not a constant 0), and every count is back to 0 once its client hung up.
* ``benchmarks/soak.py --short``: ~25 s of echo, continuous streaming and sequence clients with
  disconnects and one worker SIGKILL; no request lost, no wrong answer, no state leaked.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from backend.context import Context
from backend.handler_loader import LoadedHandler
from backend.protocol import InferReply, InferRequest, RequestState, WireRequest, WireResult
from backend.service import STATE_PROBE_ID, Service
from frontend.batching.base import BatchConfig
from frontend.batching.model_batcher import ModelBatcher
from frontend.workers import worker as frontend_worker
from tests.batching.helpers import FakeClock, make_jobs, reply, seq_job
from tests.integration.server import EXAMPLES, REPO, ConveyorProcess, build_mar, pid_alive, wait_until

PROBE = WireRequest(STATE_PROBE_ID, RequestState.CONTINUE)


def new(rid: str, body: str) -> WireRequest:
    from tests.backend.conftest import new as backend_new

    return backend_new(rid, body)


class Streams:
    """A class handler with per-request state: ``{"n": N}`` streams N results, one per frame."""

    def __init__(self) -> None:
        self.left: dict[str, int] = {}
        self.seen: list[list[str]] = []

    @property
    def num_live_requests(self) -> int:
        return len(self.left)

    def handle(self, data: list, ctx: Context) -> list:
        self.seen.append(list(ctx.request_ids.values()))
        out = []
        for idx, row in enumerate(data):
            rid = ctx.get_request_id(idx) or ""
            left = self.left.pop(rid, None)
            left = int(row["body"]) if left is None else left
            if left > 1:
                self.left[rid] = left - 1
            ctx.set_done(idx, left <= 1)
            out.append(left)
        return out

    def cancel(self, ids: list[str]) -> None:
        for rid in ids:
            self.left.pop(rid, None)


def streams_service() -> tuple[Service, Streams]:
    handler = Streams()
    ctx = Context("m", "/tmp", {"model": {}}, 4, None)
    loaded = LoadedHandler("test.Streams", handler.handle, lambda ids, _ctx: handler.cancel(ids), handler)
    return Service(loaded, ctx, 1000, lambda _reply: None), handler


def probe_answer(reply_: InferReply) -> dict[str, int]:
    last = reply_.results[-1]
    assert (last.request_id, last.status, last.done) == (STATE_PROBE_ID, 200, True)
    return json.loads(last.body)


# -------------------------------------------------------------------------- the probe, no processes


@pytest.mark.timeout(10)
def test_probe_reports_state_after_the_frame_and_never_reaches_the_handler() -> None:
    svc, handler = streams_service()
    out = svc.predict(InferRequest(1, [new("a", "3"), new("b", "1"), PROBE]))
    assert [r.request_id for r in out.results] == ["a", "b", STATE_PROBE_ID]
    assert handler.seen == [["a", "b"]]  # the probe is not in data
    assert probe_answer(out) == {"num_active": 1, "num_live_requests": 1}  # b finished in this frame
    # A frame of a CANCEL alone has no result to carry anything; with the probe it reports the freed state.
    out = svc.predict(InferRequest(2, [WireRequest("a", RequestState.CANCEL), PROBE]))
    assert probe_answer(out) == {"num_active": 0, "num_live_requests": 0}
    assert handler.seen == [["a", "b"]]  # nothing ran
    # A probe alone (an idle worker), and a function handler without counts.
    fn_svc = Service(LoadedHandler("fn", lambda data, ctx: data), Context("m", "/tmp", {"model": {}}, 1, None), 1000)
    assert probe_answer(fn_svc.predict(InferRequest(0, [PROBE]))) == {"num_active": 0}


@pytest.mark.timeout(10)
def test_frontend_reads_the_probe_answer_and_agrees_on_the_id() -> None:
    assert frontend_worker.STATE_PROBE_ID == STATE_PROBE_ID
    body = json.dumps({"num_active": 2, "num_live_sequences": 1}).encode()
    answer = InferReply(7, True, (WireResult("x", 200), WireResult(STATE_PROBE_ID, 200, True, "", "", (), body)))
    assert frontend_worker.probe_counts(answer) == {"num_active": 2, "num_live_sequences": 1}
    assert frontend_worker.probe_counts(InferReply(7, True, (WireResult("x", 200),))) is None
    garbled = InferReply(7, True, (WireResult(STATE_PROBE_ID, 500, True, "not active"),))
    assert frontend_worker.probe_counts(garbled) is None  # a backend without probes: unknown, not 0


@pytest.mark.timeout(10)
def test_aggregators_and_sequence_table_report_what_they_hold() -> None:
    clock = FakeClock()
    batcher = ModelBatcher("m", BatchConfig(batch_size=2, max_batch_delay=0.0, continuous=True), clock)
    agg = batcher.add_worker("w")
    jobs = make_jobs(3)
    for job in jobs:
        batcher.submit(job)
    frame = agg.next_frame()
    assert frame is not None
    assert batcher.describe_state() == {"num_queued": 1}
    assert agg.describe_state() == {"num_running": 2, "num_gathered": 0, "num_cancels_owed": 0}
    batcher.cancel(jobs[0])
    agg.on_reply(reply(frame, done=False))
    frame = agg.next_frame()  # r0's CANCEL, r1 continues, r2 joins
    assert frame is not None and [j.request_id for j in frame.cancelled_jobs] == ["r0"]
    agg.on_reply(reply(frame, done=True))
    assert agg.next_frame() is None
    assert agg.describe_state() == {"num_running": 0, "num_gathered": 0, "num_cancels_owed": 0}
    assert batcher.describe_state() == {"num_queued": 0}

    seq = ModelBatcher("s", BatchConfig(batch_size=2, max_batch_delay=0.0, sequence=True, continuous=True,
                                        sequence_max_idle=60.0, max_num_sequence=4, max_sequence_job_queue_size=4), clock)
    sagg = seq.add_worker("w")
    seq.submit(seq_job("a0", "A"))
    seq.submit(seq_job("a1", "A", end=True))
    state = seq.describe_state()
    assert (state["num_sequences_open"], state["num_sequence_jobs_waiting"], state["num_ready_sequences"]) == (1, 2, 1)
    for _ in range(4):
        frame = sagg.next_frame()
        if frame is None:
            break
        sagg.on_reply(reply(frame, done=True))
    state = seq.describe_state()
    assert {k: v for k, v in state.items() if k not in ("num_tombstones", "num_deadline_entries")} == {
        "num_queued": 0, "num_sequences_open": 0, "num_sequence_jobs_waiting": 0, "num_sequence_jobs_in_flight": 0,
        "num_ready_sequences": 0, "num_failures_unreported": 0,
    }
    assert state["num_tombstones"] == 1  # bounded by maxSequenceTombstones, and by its TTL


# -------------------------------------------------------------------------- a real server


async def _describe_state(server: ConveyorProcess, session: aiohttp.ClientSession) -> dict[str, Any]:
    async with session.get(f"{server.management}/models/streaming?state=true") as response:
        assert response.status == 200
        return (await response.json())[0]


def _live(described: dict[str, Any]) -> dict[str, int]:
    worker = described["workers"][0]["state"]
    return {**{k: v for k, v in worker.items() if k != "backend"}, **(worker.get("backend") or {}),
            **described["state"]}


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_describe_state_shows_a_running_stream_then_nothing_after_its_client_left(tmp_path: Path) -> None:
    store = tmp_path / "store"
    store.mkdir()
    config = tmp_path / "streaming.yaml"
    config.write_text("minWorkers: 1\nmaxWorkers: 1\nbatchSize: 4\nmaxBatchDelay: 5\ncontinuousBatching: true\n")
    build_mar(store, "streaming", EXAMPLES / "streaming" / "streaming_handler.py", config)

    async def scenario(server: ConveyorProcess) -> tuple[dict[str, int], dict[str, int]]:
        timeout = aiohttp.ClientTimeout(total=60)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            async with session.post(f"{server.inference}/predictions/streaming", json={"n": 2000, "step_ms": 20}) as response:
                assert response.status == 200
                await response.content.readany()  # the stream runs
                running = _live(await _describe_state(server, session))
                response.close()  # the client goes away mid-stream
            for _ in range(100):  # bounded: the CANCEL goes out with the next step
                after = _live(await _describe_state(server, session))
                if not any(after.values()):
                    break
                await asyncio.sleep(0.1)
            return running, after

    with ConveyorProcess(tmp_path / "server", model_store=store, models=["streaming=streaming.mar"]) as server:
        running, after = asyncio.run(scenario(server))
    assert running["num_running"] == 1 and running["num_timed_streams"] == 1
    assert running["num_active"] == 1 and running["num_live_requests"] == 1  # probed on the busy worker
    assert after == {"num_running": 0, "num_gathered": 0, "num_cancels_owed": 0, "num_timed_streams": 0,
                     "num_active": 0, "num_live_requests": 0, "num_queued": 0}


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_short_soak_loses_nothing_and_leaks_nothing(tmp_path: Path) -> None:
    report_path = tmp_path / "report.json"
    cmd = [sys.executable, str(REPO / "benchmarks" / "soak.py"), "--short", "--workdir", str(tmp_path / "soak"),
           "--json", str(report_path)]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        output, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)  # soak.py stops its server on SIGTERM
            try:
                proc.communicate(timeout=45)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.communicate(timeout=10)
        _kill_leftover_server(tmp_path / "soak" / "server" / "conveyor.pid")
    assert report_path.exists(), output
    report = json.loads(report_path.read_text())
    assert report["lost"] == 0, output
    assert report["wrong"] == 0, output
    assert report["leaked"] == 0 and report["unverified"] == 0, output
    assert report["sent"] > 0 and report["served_ok"] > 0 and len(report["kills"]) == 1, output
    assert report["kills"][0]["back_in"] is not None, output  # the killed worker was replaced
    assert proc.returncode == 0, output


def _kill_leftover_server(pid_file: Path) -> None:
    """Last resort when soak.py itself was killed: the server runs in its own session."""
    try:
        pid = int(json.loads(pid_file.read_text())["pid"])
    except (OSError, ValueError, KeyError, TypeError):
        return
    if pid_alive(pid):
        try:
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        wait_until(lambda: not pid_alive(pid), timeout=10)
