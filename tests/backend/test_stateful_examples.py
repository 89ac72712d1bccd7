"""examples/stateful: the running-sum handlers in a real worker, driven with the frames the frontend sends.

The frames are what the frontend builds (docs/sequences.md): every NEW entry carries the sequence id
and the ``ts_request_sequence_id`` header (the client's, or the one the frontend adds for a server-made
id); a sequence's first request carries the SEQUENCE_START flag, a client's end request SEQUENCE_END
(the worker shows both flags as headers); CONTINUE and CANCEL entries carry the request id and the
sequence id, no payload. With continuous batching a running
stream comes back as CONTINUE every step, and a later request of its sequence is placed after it.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from backend.archive import ModelArchive, open_archive
from backend.archiver import main as archiver_main
from backend.protocol import InputParameter, RequestFlags, RequestState, WireRequest, WireResult
from tests.backend.conftest import EXAMPLES, WorkerProcess

pytestmark = [pytest.mark.slow, pytest.mark.timeout(60)]

SEQUENCE_BATCHING = EXAMPLES / "stateful" / "sequence_batching"
CONTINUOUS = EXAMPLES / "stateful" / "sequence_continuous_batching"
END_HEADER = "ts_request_sequence_end"


def seq_new(rid: str, sid: str, body: Any, *, start: bool = False, end: bool = False,
            content_type: str = "application/json") -> WireRequest:
    flags = (RequestFlags.SEQUENCE_START if start else RequestFlags.NONE) | \
        (RequestFlags.SEQUENCE_END if end else RequestFlags.NONE)
    headers = (("TS_Request_Sequence_Id", sid),)  # any case: HTTP header names are case-insensitive
    value = body if isinstance(body, bytes) else (body if isinstance(body, str) else json.dumps(body)).encode()
    return WireRequest(rid, RequestState.NEW, sid, flags, headers, (InputParameter("body", content_type, value),))


def seq_cont(rid: str, sid: str) -> WireRequest:
    return WireRequest(rid, RequestState.CONTINUE, sid)


def seq_cancel(rid: str, sid: str) -> WireRequest:
    return WireRequest(rid, RequestState.CANCEL, sid)


def step(w: WorkerProcess, frame_id: int, requests: Sequence[WireRequest]) -> dict[str, WireResult]:
    """One frame → its results by request id (these handlers never send intermediate replies)."""
    replies = w.infer(frame_id, requests)
    assert len(replies) == 1 and replies[0].final
    return {r.request_id: r for r in replies[0].results}


def body(result: WireResult) -> Any:
    assert result.status == 200, result.message
    return json.loads(result.body)


def archive(example: Path, name: str, tmp_path: Path) -> ModelArchive:
    """The README's ``conveyor archive`` command, then the frontend's way of opening the archive."""
    handler = next(example.glob("*_handler.py"))
    assert archiver_main(["--model-name", name, "--version", "1.0", "--handler", str(handler),
                          "--config-file", str(example / "model-config.yaml"), "--export-path", str(tmp_path)]) == 0
    return open_archive(tmp_path / f"{name}.mar", tmp_path / "models")


def load(start_worker, arc: ModelArchive, worker_id: str, **yaml_overrides: Any) -> WorkerProcess:
    w = start_worker(worker_id)
    config = {**arc.model_yaml_config, **yaml_overrides}
    reply = w.load(arc.model_dir, arc.handler, batch_size=config["batchSize"], manifest=arc.manifest,
                   yaml_config=config, name=arc.model_name)
    assert reply.status == 200, reply.message
    return w


def last_frame_state(w: WorkerProcess) -> tuple[int, int]:
    """(sequences, streams) the continuous handler holds after its last frame, from its FRAME log line."""
    found = re.findall(r"FRAME .* sequences=(\d+) streams=(\d+)", w.stderr())
    assert found, w.stderr()
    return int(found[-1][0]), int(found[-1][1])


# ------------------------------------------------------------------------------------ sequence batching


def test_readme_archive_and_config(tmp_path: Path) -> None:
    for example, continuous in ((SEQUENCE_BATCHING, False), (CONTINUOUS, True)):
        arc = archive(example, example.name, tmp_path)
        cfg = arc.model_yaml_config
        assert cfg["sequenceBatching"] is True and cfg.get("continuousBatching", False) is continuous
        assert cfg["batchSize"] == 4 and cfg["minWorkers"] == 2 and cfg["sequenceMaxIdleMSec"] > 0
        assert cfg["maxNumSequence"] >= 1 and cfg["maxSequenceJobQueueSize"] >= 1
        assert arc.handler in (example / "README.md").read_text()


def test_interleaved_sequences_keep_their_own_sums(start_worker, tmp_path: Path) -> None:
    w = load(start_worker, archive(SEQUENCE_BATCHING, "running_sum", tmp_path), "W-sum-1")
    # a: JSON numbers, b: text, c: bytes and TorchServe's {"input": n}; one request per sequence per frame.
    first = step(w, 1, [seq_new("a1", "a", 1, start=True),
                        seq_new("b1", "b", "10", start=True, content_type="text/plain")])
    assert (body(first["a1"]), body(first["b1"])) == (1, 10)
    second = step(w, 2, [seq_new("b2", "b", "20", content_type="text/plain"), seq_new("a2", "a", 2),
                         seq_new("c1", "c", b"100", content_type="application/octet-stream")])
    assert (body(second["a2"]), body(second["b2"]), body(second["c1"])) == (3, 30, 100)
    third = step(w, 3, [seq_new("a3", "a", 3), seq_new("c2", "c", {"input": 5}), seq_new("b3", "b", 30)])
    assert (body(third["a3"]), body(third["b3"]), body(third["c2"])) == (6, 60, 105)
    # A bad body fails that request alone; its sequence's sum is unchanged.
    bad = step(w, 4, [seq_new("a4", "a", "x", content_type="text/plain"), seq_new("b4", "b", 1.5)])
    assert {r.status for r in bad.values()} == {400} and "integer" in bad["a4"].message
    assert body(step(w, 5, [seq_new("a5", "a", 4)])["a5"]) == 10


def test_sequence_end_frees_the_state(start_worker, tmp_path: Path) -> None:
    w = load(start_worker, archive(SEQUENCE_BATCHING, "running_sum", tmp_path), "W-sum-2", maxNumSequence=2)
    step(w, 1, [seq_new("a1", "a", 5, start=True), seq_new("b1", "b", 7, start=True)])
    # The client ends a: answered with the sum, then freed. The handler ends b with 0: end header on the answer.
    res = step(w, 2, [seq_new("a2", "a", 1, end=True), seq_new("b2", "b", 0)])
    assert body(res["a2"]) == 6 and END_HEADER not in dict(res["a2"].headers)
    assert body(res["b2"]) == 7 and dict(res["b2"].headers)[END_HEADER] == "b"
    assert "END sequence=a by=client sum=6" in w.stderr() and "END sequence=b by=handler sum=7 open=0" in w.stderr()
    # The worker holds nothing for them any more: the same ids (the frontend would refuse them) start at 0.
    res = step(w, 3, [seq_new("a3", "a", 2), seq_new("b3", "b", 3)])
    assert (body(res["a3"]), body(res["b3"])) == (2, 3)
    # A start header always begins from 0; the state is bounded by maxNumSequence (least recently used goes).
    assert body(step(w, 4, [seq_new("b4", "b", 4, start=True)])["b4"]) == 4
    assert body(step(w, 5, [seq_new("c1", "c", 1, start=True)])["c1"]) == 1
    assert "forgetting the least recently used, a" in w.stderr()
    assert body(step(w, 6, [seq_new("b5", "b", 1)])["b5"]) == 5


# ------------------------------------------------------------------------------------ continuous variant


def chunk_sums(results: dict[str, WireResult], rid: str) -> tuple[int, int, bool]:
    chunk = body(results[rid])
    return chunk["sum"], chunk["step"], results[rid].done


def test_stream_of_ten_steps_over_continue_frames(start_worker, tmp_path: Path) -> None:
    w = load(start_worker, archive(CONTINUOUS, "running_sum_stream", tmp_path), "W-stream-1", handler={"step_ms": 0})
    res = step(w, 1, [seq_new("a1", "a", 3, start=True)])
    assert body(res["a1"]) == {"sum": 3, "step": 1, "of": 10} and not res["a1"].done
    seen = [3]
    for k in range(2, 11):
        frame = [seq_cont("a1", "a")]
        if k == 4:  # another sequence joins the running batch; an even n is answered at once
            frame.append(seq_new("b1", "b", 4, start=True))
        res = step(w, k, frame)
        total, num, done = chunk_sums(res, "a1")
        assert num == k and done is (k == 10)
        seen.append(total)
        if k == 4:
            assert body(res["b1"]) == {"sum": 4} and res["b1"].done
    assert seen == [3 * k for k in range(1, 11)]
    assert last_frame_state(w) == (2, 0)  # two sequences, no stream left
    gone = step(w, 11, [seq_cont("a1", "a")])["a1"]  # done: the worker no longer knows it
    assert gone.status == 500 and gone.done
    assert body(step(w, 12, [seq_new("a2", "a", 2)])["a2"]) == {"sum": 32}


def test_cancel_request_of_the_same_sequence_ends_the_stream_early(start_worker, tmp_path: Path) -> None:
    w = load(start_worker, archive(CONTINUOUS, "running_sum_stream", tmp_path), "W-stream-2", handler={"step_ms": 0})
    assert body(step(w, 1, [seq_new("a1", "a", 2, start=True)])["a1"]) == {"sum": 2}
    res = step(w, 2, [seq_new("a2", "a", {"input": 5}), seq_new("b1", "b", 1, start=True)])
    assert chunk_sums(res, "a2") == (7, 1, False) and chunk_sums(res, "b1") == (1, 1, False)
    res = step(w, 3, [seq_cont("a2", "a"), seq_cont("b1", "b")])
    assert chunk_sums(res, "a2") == (12, 2, False)
    # The -1 of sequence a is admitted while a's stream runs, after the stream's CONTINUE entry.
    res = step(w, 4, [seq_cont("b1", "b"), seq_cont("a2", "a"), seq_new("a3", "a", -1)])
    assert body(res["a2"]) == {"sum": 12, "step": 2, "of": 10, "cancelled": True} and res["a2"].done
    assert body(res["a3"]) == {"sum": 12, "cancelled": 1} and res["a3"].done
    assert chunk_sums(res, "b1") == (3, 3, False)  # another sequence's stream is untouched
    assert last_frame_state(w) == (2, 1)
    # The sequence goes on: an even n adds to the sum kept so far; 0 ends it from the handler.
    assert body(step(w, 5, [seq_cont("b1", "b"), seq_new("a4", "a", 4)])["a4"]) == {"sum": 16}
    res = step(w, 6, [seq_cont("b1", "b"), seq_new("a5", "a", 0)])
    assert body(res["a5"]) == {"sum": 16, "ended": True} and dict(res["a5"].headers)[END_HEADER] == "a"
    assert last_frame_state(w) == (1, 1)
    # The client's end header on a request while its stream runs: the stream is cut, then the state freed.
    res = step(w, 7, [seq_cont("b1", "b"), seq_new("b2", "b", 10, end=True)])
    assert body(res["b1"]) == {"sum": 5, "step": 5, "of": 10, "cancelled": True} and res["b1"].done
    assert body(res["b2"]) == {"sum": 15} and END_HEADER not in dict(res["b2"].headers)
    assert last_frame_state(w) == (0, 0)


def test_cancel_entry_frees_the_stream_state(start_worker, tmp_path: Path) -> None:
    # step_ms (model-config.yaml's handler section): a frame that steps a stream takes that long.
    w = load(start_worker, archive(CONTINUOUS, "running_sum_stream", tmp_path), "W-stream-3", handler={"step_ms": 20})
    res = step(w, 1, [seq_new("a1", "a", 7, start=True)])
    started = time.monotonic()
    res = step(w, 2, [seq_cont("a1", "a")])
    assert time.monotonic() - started >= 0.02
    assert chunk_sums(res, "a1") == (14, 2, False) and last_frame_state(w) == (1, 1)
    # The client of a1 went away: the frame carries a CANCEL for it, and no result comes back for it.
    res = step(w, 3, [seq_cancel("a1", "a"), seq_new("a2", "a", 2)])
    assert set(res) == {"a2"} and body(res["a2"]) == {"sum": 16}  # the sequence stays open; sent steps count
    assert "CANCEL request=a1 sequence=a step=2" in w.stderr()
    assert last_frame_state(w) == (1, 0)
    assert body(step(w, 4, [seq_new("a3", "a", -1)])["a3"]) == {"sum": 16, "cancelled": 0}  # nothing left to cancel
    # A new stream of the sequence runs normally afterwards (no stale cancel, unlike a leaked entry would cause).
    res = step(w, 5, [seq_new("a4", "a", 1)])
    res = step(w, 6, [seq_cont("a4", "a")])
    assert chunk_sums(res, "a4") == (18, 2, False)
    assert step(w, 7, [seq_cancel("a4", "a"), seq_cancel("never-seen", "a")]) == {}  # an unknown id is ignored
    assert "CANCEL request=a4 sequence=a step=2" in w.stderr() and "never-seen sequence" not in w.stderr()
    assert body(step(w, 8, [seq_new("a5", "a", 2)])["a5"]) == {"sum": 20}
    assert last_frame_state(w) == (1, 0)
