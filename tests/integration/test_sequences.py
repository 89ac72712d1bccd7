"""Stateful sequences end to end (issue 7): the stateful examples behind a real server.

One server per module loads the running-sum examples (``examples/stateful/``) archived with
test-sized configs (the examples' own model-config.yaml with a few keys overridden):

* ``sum``        sequence batching, 2 workers, maxNumSequence 2 — affinity, ids, capacity;
* ``sum_idle``   1 worker, sequenceMaxIdleMSec 300 — the idle timeout;
* ``sum_life``   1 worker, sequenceTimeoutMSec 600 — the absolute timeout;
* ``sum_stream`` sequence + continuous batching, 1 worker, 200 ms per step — cancel a running stream;
* ``seq_header`` a handler that sets the sequence id header itself — no duplicate header.

``sum_kill`` (2 workers) is registered by the test that kills a worker and removed after it; a
second server checks custom header names (``ts_header_key_sequence_*``). Every sequence a test
opens is ended (or expires) within the test, and ids are unique per run, so tests do not depend
on each other's order.
"""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import uuid
from pathlib import Path
from typing import Any
from collections.abc import Iterator, Mapping

import pytest
import requests
import yaml

from tests.integration.server import EXAMPLES, ConveyorProcess, build_mar, pid_alive, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

STATEFUL = EXAMPLES / "stateful"
SUM_HANDLER = STATEFUL / "sequence_batching" / "running_sum_handler.py"
STREAM_HANDLER = STATEFUL / "sequence_continuous_batching" / "running_sum_stream_handler.py"
ID, START, END = "ts_request_sequence_id", "ts_request_sequence_start", "ts_request_sequence_end"
SERVER_ID = re.compile(r"ts-seq-[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}")

# Sets the sequence id response header itself, in another case than the frontend's, as a ported
# TorchServe handler may: the response must still carry the header once.
ID_ECHO_HANDLER = '''
def handle(data, context):
    if data is None:  # the load-time call (TorchServe's module-handler convention)
        return None
    out = []
    for idx, _row in enumerate(data):
        sid = context.get_sequence_id(idx)
        context.set_response_header(idx, "TS_Request_Sequence_Id", sid)
        out.append({"sequence": sid})
    return out
'''


def example_config(example: str, path: Path, **overrides: Any) -> Path:
    """The example's model-config.yaml with ``overrides`` (test sizes: workers, limits, timeouts)."""
    config = yaml.safe_load((STATEFUL / example / "model-config.yaml").read_text())
    config.update(overrides)
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    store = tmp_path_factory.mktemp("stateful_store")
    cfg = tmp_path_factory.mktemp("stateful_configs")
    small = {"maxBatchDelay": 1, "maxNumSequence": 2, "maxSequenceJobQueueSize": 4}
    build_mar(store, "sum", SUM_HANDLER, example_config(
        "sequence_batching", cfg / "sum.yaml", minWorkers=2, maxWorkers=2, sequenceMaxIdleMSec=30000, **small))
    build_mar(store, "sum_kill", SUM_HANDLER, example_config(
        "sequence_batching", cfg / "kill.yaml", minWorkers=2, maxWorkers=2, sequenceMaxIdleMSec=30000, **small))
    build_mar(store, "sum_idle", SUM_HANDLER, example_config(
        "sequence_batching", cfg / "idle.yaml", minWorkers=1, maxWorkers=1, sequenceMaxIdleMSec=300, **small))
    build_mar(store, "sum_life", SUM_HANDLER, example_config(
        "sequence_batching", cfg / "life.yaml", minWorkers=1, maxWorkers=1, sequenceMaxIdleMSec=30000,
        sequenceTimeoutMSec=600, **small))
    build_mar(store, "sum_stream", STREAM_HANDLER, example_config(
        "sequence_continuous_batching", cfg / "stream.yaml", minWorkers=1, maxWorkers=1,
        sequenceMaxIdleMSec=30000, handler={"step_ms": 200}, **small))
    handler = cfg / "id_echo_handler.py"
    handler.write_text(ID_ECHO_HANDLER)
    (cfg / "id_echo.yaml").write_text("minWorkers: 1\nmaxWorkers: 1\nmaxBatchDelay: 1\nsequenceBatching: true\n"
                                      "sequenceMaxIdleMSec: 30000\nmaxNumSequence: 2\n")
    build_mar(store, "seq_header", handler, cfg / "id_echo.yaml")
    (cfg / "bad.yaml").write_text("minWorkers: 1\nsequenceBatching: true\nsequenceMaxIdleMSec: 0\n")
    build_mar(store, "bad_idle", SUM_HANDLER, cfg / "bad.yaml")
    return store


@pytest.fixture(scope="module")
def server(store: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ConveyorProcess]:
    models = [f"{name}={name}.mar" for name in ("sum", "sum_idle", "sum_life", "sum_stream", "seq_header")]
    with ConveyorProcess(tmp_path_factory.mktemp("stateful_server"), model_store=store, models=models) as proc:
        yield proc


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def post(server: ConveyorProcess, model: str, n: int, sequence_id: str | None = None,
         headers: Mapping[str, str] | None = None, **kwargs: Any) -> requests.Response:
    sent = {"Content-Type": "application/json", **({ID: sequence_id} if sequence_id else {}), **(headers or {})}
    return requests.post(f"{server.inference}/predictions/{model}", data=json.dumps(n), headers=sent,
                         timeout=30, **kwargs)


def end(server: ConveyorProcess, model: str, sequence_id: str, n: int = 0) -> requests.Response:
    """The client's last request of a sequence (end header)."""
    return post(server, model, n, sequence_id, {END: "true"})


def assert_error(response: requests.Response, status: int, error_type: str, *words: str,
                 header: str = ID, sequence_id: str | None = None) -> dict:
    """The documented error JSON ({code, type, message}), carrying the sequence id header."""
    assert response.status_code == status, response.text
    error = response.json()
    assert error["code"] == status and error["type"] == error_type, error
    for word in words:
        assert word in error["message"], error
    if sequence_id is not None:
        assert response.headers.get(header) == sequence_id
    return error


def worker_of(server: ConveyorProcess, model: str) -> dict[str, dict]:
    """sequence id → its worker's describe entry (describe lists the open sequences per worker)."""
    return {sid: w for w in server.describe(model)["workers"] for sid in w["sequences"]["ids"]}


def sequence_metrics(server: ConveyorProcess, model: str) -> dict[str, float]:
    """conveyor_sequences_* samples of one model: {"open": n, "opened": n, "closed": n, ...}."""
    text = requests.get(f"{server.metrics}/metrics", timeout=10).text
    out: dict[str, float] = {}
    for match in re.finditer(r'^conveyor_sequences_(open|opened_total|ended_total)\{([^}]*)\} (\S+)$', text, re.M):
        labels = dict(re.findall(r'(\w+)="([^"]*)"', match.group(2)))
        if labels.get("model") == model:
            key = labels.get("reason") or match.group(1).removesuffix("_total")
            out[key] = float(match.group(3))
    return out


# Affinity, ids, capacity ------------------------------------------------------------------------


def test_two_client_sequences_keep_their_own_sums_on_their_own_workers(server: ConveyorProcess) -> None:
    a, b = new_id("alice"), new_id("bob")
    first_a, first_b = post(server, "sum", 1, a), post(server, "sum", 100, b)
    assert (first_a.json(), first_b.json()) == (1, 100)
    assert first_a.headers[ID] == a and first_b.headers[ID] == b
    pinned = worker_of(server, "sum")
    assert pinned[a]["id"] != pinned[b]["id"]  # least-loaded pinning: one sequence per worker
    assert all(w["sequences"]["num_open"] == 1 for w in pinned.values())

    answers: dict[str, list[int]] = {a: [], b: []}

    def client(sid: str) -> None:
        for n in range(1, 11):
            response = post(server, "sum", n, sid)
            assert response.headers[ID] == sid
            answers[sid].append(response.json())

    threads = [threading.Thread(target=client, args=(sid,)) for sid in (a, b)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    running = [sum(range(1, k + 1)) for k in range(1, 11)]
    assert answers[a] == [1 + s for s in running]
    assert answers[b] == [100 + s for s in running]
    assert worker_of(server, "sum") == pinned  # still on the same workers

    assert end(server, "sum", a, 5).json() == 1 + 55 + 5
    assert end(server, "sum", b).json() == 100 + 55
    assert_error(post(server, "sum", 1, a), 410, "SequenceClosedException", a, "closed", sequence_id=a)
    assert worker_of(server, "sum") == {}


def test_server_made_id_comes_back_and_works_for_follow_ups(server: ConveyorProcess) -> None:
    first = post(server, "sum", 5)
    assert first.status_code == 200 and first.json() == 5
    sid = first.headers[ID]
    assert SERVER_ID.fullmatch(sid), sid
    follow = post(server, "sum", 6, sid)
    assert follow.json() == 11 and follow.headers[ID] == sid
    # 0: the handler ends the sequence with the end header on its response.
    ended = post(server, "sum", 0, sid)
    assert ended.json() == 11 and ended.headers[END] == sid and ended.headers[ID] == sid
    assert_error(post(server, "sum", 1, sid), 410, "SequenceClosedException", sid, "ended by the handler",
                 sequence_id=sid)


def test_end_frees_capacity_for_a_third_sequence(server: ConveyorProcess) -> None:
    before = sequence_metrics(server, "sum")
    s1, s2, s3 = new_id("s1"), new_id("s2"), new_id("s3")
    assert post(server, "sum", 1, s1).json() == 1
    assert post(server, "sum", 2, s2).json() == 2
    full = post(server, "sum", 3, s3)
    assert_error(full, 503, "ServiceUnavailableException", s3, "maxNumSequence=2", sequence_id=s3)
    assert int(full.headers["Retry-After"]) >= 1
    made = post(server, "sum", 3)  # a server-made id cannot open either, and is returned all the same
    assert made.status_code == 503 and SERVER_ID.fullmatch(made.headers[ID])
    assert sequence_metrics(server, "sum")["open"] == 2

    assert end(server, "sum", s1, 10).json() == 11  # the client's end frees s1's place at once
    assert post(server, "sum", 3, s3).json() == 3
    assert end(server, "sum", s2).json() == 2
    assert post(server, "sum", 0, s3).json() == 3  # ended by the handler
    after = sequence_metrics(server, "sum")
    assert after["open"] == 0
    assert after["opened"] - before["opened"] == 3 and after["closed"] - before["closed"] == 3


def test_handler_setting_the_id_header_does_not_duplicate_it(server: ConveyorProcess) -> None:
    sid = new_id("dup")
    response = post(server, "seq_header", 1, sid)
    assert response.status_code == 200 and response.json() == {"sequence": sid}
    assert response.raw.headers.getlist(ID) == [sid]  # case-insensitive: one header, any spelling
    assert end(server, "seq_header", sid).status_code == 200


# Timeouts -----------------------------------------------------------------------------------------


def test_idle_timeout_rejects_the_old_id(server: ConveyorProcess) -> None:
    before = sequence_metrics(server, "sum_idle")
    sid = new_id("idle")
    assert post(server, "sum_idle", 4, sid).json() == 4
    # 300 ms idle: the server expires it on its own (no request needed), within well under a second.
    assert wait_until(lambda: sequence_metrics(server, "sum_idle")["open"] == 0, timeout=10)
    assert_error(post(server, "sum_idle", 1, sid), 410, "SequenceExpiredException", sid, "expired",
                 "idle longer than sequenceMaxIdleMSec=300", sequence_id=sid)
    after = sequence_metrics(server, "sum_idle")
    assert after["expired"] - before["expired"] == 1
    fresh = new_id("idle")  # a new id opens as usual
    assert post(server, "sum_idle", 2, fresh).json() == 2
    assert end(server, "sum_idle", fresh).status_code == 200


def test_absolute_timeout_rejects_the_old_id(server: ConveyorProcess) -> None:
    sid = new_id("life")
    assert post(server, "sum_life", 4, sid).json() == 4
    # 600 ms after its first request, however active (idle limit 30 s here).
    assert wait_until(lambda: sequence_metrics(server, "sum_life")["open"] == 0, timeout=10)
    assert_error(post(server, "sum_life", 1, sid), 410, "SequenceExpiredException", sid,
                 "open longer than sequenceTimeoutMSec=600", sequence_id=sid)


# Sequence + continuous batching ---------------------------------------------------------------------


def read_chunks(response: requests.Response) -> list[dict]:
    """The JSON objects of a chunked response, whatever the chunk boundaries on the way."""
    text = b"".join(response.iter_content(chunk_size=None)).decode()
    decoder, out, pos = json.JSONDecoder(), [], 0
    while pos < len(text):
        obj, pos = decoder.raw_decode(text, pos)
        out.append(obj)
    return out


def test_streamed_request_is_cancelled_by_a_later_request_of_its_sequence(server: ConveyorProcess) -> None:
    sid = new_id("stream")
    assert post(server, "sum_stream", 2, sid).json() == {"sum": 2}
    # 5 streams ten steps of 200 ms (2 s: time to cancel it on a busy machine); the headers arrive with its first chunk, so it is running now.
    with post(server, "sum_stream", 5, sid, stream=True) as stream:
        assert stream.status_code == 200 and stream.headers[ID] == sid
        cancel = post(server, "sum_stream", -1, sid)  # admitted into the stream's next step
        chunks = read_chunks(stream)
    assert cancel.status_code == 200 and cancel.headers[ID] == sid
    answer = cancel.json()
    assert answer["cancelled"] == 1
    last = chunks[-1]
    assert last["cancelled"] is True and last["step"] < 10 and len(chunks) < 10, chunks
    assert [c["sum"] for c in chunks[:-1]] == [2 + 5 * k for k in range(1, len(chunks))]
    assert last["sum"] == answer["sum"] == 2 + 5 * last["step"]
    ended = post(server, "sum_stream", 0, sid)
    assert ended.json() == {"sum": answer["sum"], "ended": True}
    assert_error(post(server, "sum_stream", 2, sid), 410, "SequenceClosedException", sid, sequence_id=sid)


# Worker death ------------------------------------------------------------------------------------


def test_killed_worker_fails_only_its_own_sequences(server: ConveyorProcess) -> None:
    registered = requests.post(f"{server.management}/models",
                               params={"url": "sum_kill.mar", "synchronous": "true"}, timeout=60)
    assert registered.status_code == 200, registered.text
    try:
        a, b = new_id("doomed"), new_id("survivor")
        assert post(server, "sum_kill", 1, a).json() == 1
        assert post(server, "sum_kill", 10, b).json() == 10
        pinned = worker_of(server, "sum_kill")
        victim, other = pinned[a], pinned[b]
        assert victim["id"] != other["id"]
        os.kill(victim["pid"], signal.SIGKILL)
        assert wait_until(lambda: not pid_alive(victim["pid"]), timeout=10)
        # The frontend notices the death and turns the worker's sequences into "lost" tombstones.
        assert wait_until(lambda: a not in worker_of(server, "sum_kill"), timeout=10)
        assert_error(post(server, "sum_kill", 2, a), 410, "SequenceWorkerLostException", a, "lost",
                     f"worker '{victim['id']}' died", sequence_id=a)
        assert post(server, "sum_kill", 2, b).json() == 12  # untouched, on its own worker
        assert worker_of(server, "sum_kill")[b]["pid"] == other["pid"]
        assert sequence_metrics(server, "sum_kill")["lost"] == 1
        assert end(server, "sum_kill", b).json() == 12
    finally:
        requests.delete(f"{server.management}/models/sum_kill", timeout=60)


# Configuration --------------------------------------------------------------------------------------


def test_idle_zero_fails_registration_naming_the_key(server: ConveyorProcess) -> None:
    response = requests.post(f"{server.management}/models", params={"url": "bad_idle.mar"}, timeout=60)
    assert response.status_code == 400, response.text
    assert "sequenceMaxIdleMSec" in response.json()["message"]
    assert requests.get(f"{server.management}/models/bad_idle", timeout=10).status_code == 404


def test_custom_header_names_reach_the_frontend_and_the_worker(store: Path, tmp_path: Path) -> None:
    names = {"ts_header_key_sequence_id": "X-Conv-Seq", "ts_header_key_sequence_start": "X-Conv-Start",
             "ts_header_key_sequence_end": "X-Conv-End"}
    with ConveyorProcess(tmp_path / "srv", model_store=store, models=["sum=sum.mar"],
                         properties=names) as custom:
        model = "sum"
        first = post(custom, model, 3)
        sid = first.headers["x-conv-seq"]
        assert SERVER_ID.fullmatch(sid) and ID not in first.headers
        assert post(custom, model, 4, headers={"X-CONV-SEQ": sid}).json() == 7
        # The handler ends it with context.header_key_sequence_end: the worker must know the name.
        ended = post(custom, model, 0, headers={"x-conv-seq": sid})
        assert ended.json() == 7 and ended.headers["X-Conv-End"] == sid
        assert_error(post(custom, model, 1, headers={"x-conv-seq": sid}), 410, "SequenceClosedException",
                     "ended by the handler", header="x-conv-seq", sequence_id=sid)
        # The client's end and start headers, by their configured names.
        mine = new_id("c")
        assert post(custom, model, 2, headers={"x-conv-seq": mine, "x-conv-start": "1"}).json() == 2
        again = post(custom, model, 1, headers={"x-conv-seq": mine, "x-conv-start": "1"})
        assert_error(again, 409, "SequenceAlreadyOpenException", mine, header="x-conv-seq", sequence_id=mine)
        assert post(custom, model, 3, headers={"x-conv-seq": mine, "x-conv-end": ""}).json() == 5
        assert_error(post(custom, model, 1, headers={"x-conv-seq": mine}), 410, "SequenceClosedException",
                     "end flag", header="x-conv-seq", sequence_id=mine)
