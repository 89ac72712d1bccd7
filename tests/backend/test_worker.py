"""A real worker process (``python -m backend.worker``) driven over its Unix socket with backend.protocol."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from backend.archive import open_archive
from backend.archiver import main as archiver_main
from backend.protocol import HEADER, InferReply, Ping, Pong, Shutdown
from tests.backend.conftest import EXAMPLES, cancel, cont, new

pytestmark = [pytest.mark.slow, pytest.mark.timeout(60)]

ECHO = EXAMPLES / "echo"
STREAMING = EXAMPLES / "streaming"
TS_STYLE = EXAMPLES / "ts_style"


def results_by_id(reply: InferReply) -> dict:
    return {r.request_id: r for r in reply.results}


def test_readiness_line_and_ping(start_worker) -> None:
    w = start_worker()
    assert re.fullmatch(rf"CONVEYOR_WORKER_LISTENING pid={w.proc.pid} sock={re.escape(w.sock_path)}", w.ready_line)
    w.send(Ping(42))
    assert w.recv() == Pong(42)
    w.send(Shutdown())
    assert w.wait() == 0
    assert not os.path.exists(w.sock_path)  # the worker removes its socket file


def test_echo_batch_of_three(start_worker) -> None:
    w = start_worker("W-echo-1")
    assert w.load(ECHO, "echo_handler.py").status == 200
    replies = w.infer(1, [new("a", b'{"x": 1}'), new("b", "hello", "text/plain"),
                          new("c", b"\x00\x01", "application/octet-stream")])
    assert len(replies) == 1 and replies[0].final
    res = results_by_id(replies[0])
    assert json.loads(res["a"].body) == {"x": 1} and res["a"].content_type == "application/json"
    assert res["b"].body == b"hello" and res["b"].content_type == "text/plain"
    assert res["c"].body == b"\x00\x01"
    for r in res.values():
        assert r.status == 200 and r.done and dict(r.headers)["x-batch-size"] == "3"
    assert "[W-echo-1]" in w.stderr()


def test_handler_exception_is_503_and_worker_keeps_serving(start_worker, tmp_path: Path) -> None:
    (tmp_path / "flaky.py").write_text(
        "def handle(data, context):\n"
        "    if data and data[0]['body'] == 'boom':\n"
        "        raise ValueError('kaboom')\n"
        "    return data and [row['body'] for row in data]\n")
    w = start_worker("W-flaky-1")
    assert w.load(tmp_path, "flaky.py").status == 200
    failed = w.infer(1, [new("a", "boom", "text/plain"), new("b", "x", "text/plain")])[0]
    assert {r.status for r in failed.results} == {503}
    assert all("ValueError: kaboom" in r.message and r.done for r in failed.results)
    ok = w.infer(2, [new("c", "fine", "text/plain")])[0]
    assert ok.results[0].status == 200 and ok.results[0].body == b"fine"
    log = w.stderr()
    assert "Traceback" in log and "[W-flaky-1] ValueError: kaboom" in log  # every traceback line is prefixed


def test_oversize_response_fails_only_that_request(start_worker) -> None:
    w = start_worker()
    assert w.load(ECHO, "echo_handler.py", max_response_size=100).status == 200
    reply = w.infer(1, [new("big", "x" * 500, "text/plain"), new("small", "y", "text/plain")])[0]
    res = results_by_id(reply)
    assert res["big"].status == 500 and "500 bytes" in res["big"].message and "100" in res["big"].message
    assert res["small"].status == 200 and res["small"].body == b"y"


def test_streaming_continue_and_cancel(start_worker) -> None:
    w = start_worker("W-stream-1")
    assert w.load(STREAMING, "streaming_handler.py", yaml_config={"continuousBatching": True}).status == 200
    chunks: dict[str, list] = {"a": [], "b": [], "c": []}

    def step(frame_id: int, requests) -> dict:
        replies = w.infer(frame_id, requests)
        assert len(replies) == 1
        res = results_by_id(replies[0])
        for rid, r in res.items():
            assert r.status == 200, r.message
            chunks[rid].append(json.loads(r.body))
        return res

    res = step(1, [new("a", '{"n": 3}'), new("b", '{"n": 5}')])
    assert not res["a"].done and not res["b"].done
    res = step(2, [cont("a"), cont("b"), new("c", "2")])  # c joins the running batch
    assert set(res) == {"a", "b", "c"}
    res = step(3, [cont("a"), cancel("b"), cont("c")])  # b is cancelled mid-stream
    assert set(res) == {"a", "c"} and res["a"].done and res["c"].done
    assert chunks["a"] == [{"i": 0, "of": 3}, {"i": 1, "of": 3}, {"i": 2, "of": 3}]
    assert chunks["b"] == [{"i": 0, "of": 5}, {"i": 1, "of": 5}]
    assert chunks["c"] == [{"i": 0, "of": 2}, {"i": 1, "of": 2}]
    only_cancel = w.infer(4, [cancel("zzz")])[0]
    assert only_cancel.final and only_cancel.results == ()
    gone = w.infer(5, [cont("a")])[0]  # a finished: no longer active
    assert gone.results[0].status == 500 and "not active" in gone.results[0].message
    log = w.stderr()
    assert "STEP frame=1 new=a,b continuing=- cancelled=-" in log
    assert "STEP frame=2 new=c continuing=a,b cancelled=-" in log
    assert "STEP frame=3 new=- continuing=a,c cancelled=b" in log
    assert "CANCEL ids=b" in log


def test_streaming_intermediate_replies_without_continuous_batching(start_worker) -> None:
    w = start_worker()
    assert w.load(STREAMING, "streaming_handler.py").status == 200
    replies = w.infer(7, [new("a", "3"), new("b", "1")])
    assert [r.final for r in replies] == [False, False, True]
    assert [json.loads(r.body) for rep in replies for r in rep.results if r.request_id == "a"] == [
        {"i": 0, "of": 3}, {"i": 1, "of": 3}, {"i": 2, "of": 3}]
    assert all(not r.done for rep in replies[:-1] for r in rep.results)
    assert all(r.done for r in replies[-1].results)


@pytest.fixture
def tiny_archive(tmp_path: Path) -> Path:
    """The ts_style eager model archived with our archiver (weights generated, never committed)."""
    weights = tmp_path / "weights"
    subprocess.run([sys.executable, str(TS_STYLE / "make_weights.py"), str(weights)], check=True, capture_output=True)
    assert archiver_main([
        "--model-name", "tiny", "--version", "1.0", "--model-file", str(TS_STYLE / "model.py"),
        "--serialized-file", str(weights / "tiny.pth"), "--handler", str(TS_STYLE / "classifier_handler.py"),
        "--extra-files", str(TS_STYLE / "index_to_name.json"), "--config-file", str(TS_STYLE / "model-config.yaml"),
        "--export-path", str(tmp_path)]) == 0
    return tmp_path / "tiny.mar"


def test_unmodified_torchserve_handler(start_worker, tiny_archive: Path, tmp_path: Path) -> None:
    archive = open_archive(tiny_archive, tmp_path / "models")
    w = start_worker("W-tiny-1")
    reply = w.load(archive.model_dir, archive.handler, manifest=archive.manifest,
                   yaml_config=archive.model_yaml_config, name=archive.model_name)
    assert reply.status == 200, reply.message
    res = results_by_id(w.infer(1, [new("a", "[1, 2, 3, 4]"), new("b", "[0, 0, 0, 0]")])[0])
    for r in res.values():
        probs = json.loads(r.body)
        assert r.status == 200 and set(probs) == {"alpha", "beta", "gamma"}
        assert abs(sum(probs.values()) - 1) < 1e-5 and dict(r.headers)["x-model"] == "tiny"
    bad = w.infer(2, [new("c", "[1]")])[0].results[0]
    assert bad.status == 400 and "4 numbers" in bad.message  # PredictionException(msg, 400)


def test_torchserve_continuous_batching_handler(start_worker) -> None:
    w = start_worker()
    assert w.load(TS_STYLE, "cb_handler.py", yaml_config={"continuousBatching": True}).status == 200
    first = results_by_id(w.infer(1, [new("a", '{"n": 2}'), new("b", '{"n": 1}')])[0])
    assert not first["a"].done and first["b"].done
    second = results_by_id(w.infer(2, [cont("a")])[0])
    assert second["a"].done and json.loads(second["a"].body) == {"step": 1, "of": 2}


def test_load_failure_reports_the_exception(start_worker, tmp_path: Path) -> None:
    (tmp_path / "broken.py").write_text("raise RuntimeError('cannot init')\n")
    w = start_worker()
    reply = w.load(tmp_path, "broken.py")
    assert reply.status == 500 and "RuntimeError: cannot init" in reply.message
    w.send(Ping(1))
    assert w.recv() == Pong(1)


def test_protocol_error_exits_non_zero(start_worker) -> None:
    w = start_worker()
    assert w.sock is not None
    w.sock.sendall(HEADER.pack(b"XXXX", 1, 3, 0, 0))
    assert w.wait() == 2
    assert "protocol error" in w.stderr()


def test_peer_closing_the_socket_ends_the_worker(start_worker) -> None:
    w = start_worker()
    assert w.load(ECHO, "echo_handler.py").status == 200
    assert w.sock is not None
    w.sock.close()
    w.sock = None
    assert w.wait() == 0


def test_killed_frontend_leaves_no_worker(tmp_path: Path) -> None:
    """A parent that dies before connecting: the waiting worker notices and exits."""
    sock_dir = Path(os.path.realpath("/tmp")) / f"cwp{os.getpid()}"
    sock_dir.mkdir(exist_ok=True)
    script = (
        "import subprocess, sys, time\n"
        f"p = subprocess.Popen([sys.executable, '-m', 'backend.worker', '--sock-path', '{sock_dir}/w.sock',"
        " '--worker-id', 'W-orphan'], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)\n"
        "p.stdout.readline()\n"
        "print(p.pid, flush=True)\n"
    )
    parent = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=30,
                            cwd=Path(__file__).resolve().parents[2])
    pid = int(parent.stdout.strip())
    try:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and _alive(pid):
            time.sleep(0.05)
        assert not _alive(pid)
    finally:
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)
        for f in sock_dir.iterdir():
            f.unlink()
        sock_dir.rmdir()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is dead for our purpose (its parent, the test's child, may not have reaped it).
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except FileNotFoundError:
        return False


def test_infer_before_load(start_worker) -> None:
    w = start_worker()
    reply = w.infer(3, [new("a", "1")])[0]
    assert reply.results[0].status == 503 and "not loaded" in reply.results[0].message
