"""Graceful stop: SIGTERM lets an open stream finish, then every worker stops; past
graceful_shutdown_timeout the rest fails with a clear error; nothing is left (checked by pid).
SIGKILL of the frontend: the workers notice the closed socket and exit on their own."""

from __future__ import annotations

import json
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests

from tests.integration.server import ConveyorProcess, pid_alive, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]


def test_sigterm_finishes_open_stream_then_stops_workers(model_store: Path, tmp_path: Path) -> None:
    server = ConveyorProcess(tmp_path, model_store=model_store, models=["echo=echo.mar", "streaming=streaming.mar"],
                             properties={"default_workers_per_model": "1"}).start()
    try:
        pids = server.worker_pids("echo") + server.worker_pids("streaming")
        chunks: list[dict] = []

        def stream() -> None:
            with requests.post(f"{server.inference}/predictions/streaming", json={"n": 10, "step_ms": 100},
                               stream=True, timeout=30) as response:
                for chunk in response.iter_content(chunk_size=None):
                    chunks.append(json.loads(chunk))

        reader = threading.Thread(target=stream)
        reader.start()
        assert wait_until(lambda: len(chunks) >= 1, timeout=10)
        started = time.monotonic()
        assert server.proc is not None
        server.proc.send_signal(signal.SIGTERM)
        reader.join(30)
        assert [c["i"] for c in chunks] == list(range(10))  # the in-flight stream completed
        assert server.proc.wait(30) == 0
        assert time.monotonic() - started < 20
        assert wait_until(lambda: not any(pid_alive(p) for p in pids), timeout=10)
        assert not server.pid_file.exists()
        assert "Model server stopped." in server.log_tail()
    finally:
        server.stop()


def _sock_dir(pid: int) -> Path:
    """The directory of a worker's Unix socket (in the server's work directory), from its command line."""
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    return Path(argv[argv.index(b"--sock-path") + 1].decode()).parent


def _refused(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
    except OSError:
        return True
    return False


def test_conveyor_stop_past_the_grace_fails_the_rest_clearly(model_store: Path, tmp_path: Path) -> None:
    """graceful_shutdown_timeout=5: 4 long streams (20 s) run and 1 waits in the queue when
    `conveyor stop` comes; the ports stop accepting, the streams end with an error chunk, the queued
    request gets 503, and nothing is left: workers (by pid), sockets, pid file."""
    server = ConveyorProcess(tmp_path, model_store=model_store, models=["echo=echo.mar", "streaming=streaming.mar"],
                             properties={"default_workers_per_model": "1", "graceful_shutdown_timeout": "5"}).start()
    try:
        pids = server.worker_pids("echo") + server.worker_pids("streaming")
        work_dir = _sock_dir(pids[0]).parent
        url = f"{server.inference}/predictions/streaming"
        running: list[int] = []

        def stream() -> str:
            text = b""
            with requests.post(url, json={"n": 200, "step_ms": 100}, stream=True, timeout=60) as response:
                for chunk in response.iter_content(chunk_size=None):
                    if not text:
                        running.append(1)
                    text += chunk
            return text.decode()

        with ThreadPoolExecutor(6) as pool:
            streams = [pool.submit(stream) for _ in range(4)]
            assert wait_until(lambda: len(running) == 4, timeout=20)
            queued = pool.submit(requests.post, url, json={"n": 2}, timeout=60)
            assert wait_until(lambda: server.describe("streaming")["jobQueueStatus"]["pendingRequests"] == 1,
                              timeout=20)
            stopping = pool.submit(subprocess.run, [sys.executable, "-m", "frontend.cli", "stop", "--pid-file",
                                                    str(server.pid_file)], capture_output=True, text=True, timeout=60)
            # New connections are refused at once, while the streams still have their grace.
            assert wait_until(lambda: _refused(server.ports["inference"]), timeout=20)
            assert not all(s.done() for s in streams)
            stop = stopping.result()
            assert stop.returncode == 0, stop.stderr
            for result in (s.result() for s in streams):
                error = json.loads(result[result.rindex('{"code": '):])
                assert error["code"] == 503 and "shutting down" in error["message"]
                assert "graceful_shutdown_timeout=5" in error["message"]
            refused = queued.result()
            assert refused.status_code == 503 and "shutting down" in refused.json()["message"]
        assert server.proc is not None and server.proc.wait(30) == 0
        assert wait_until(lambda: not any(pid_alive(p) for p in pids), timeout=10)
        assert not work_dir.exists() and not server.pid_file.exists()
    finally:
        server.stop()


def test_frontend_sigkill_workers_exit_on_their_own(model_store: Path, tmp_path: Path) -> None:
    server = ConveyorProcess(tmp_path, model_store=model_store, models=["echo=echo.mar", "streaming=streaming.mar"],
                             properties={"default_workers_per_model": "1"}).start()
    work_dir: Path | None = None
    try:
        pids = server.worker_pids("echo") + server.worker_pids("streaming")
        work_dir = _sock_dir(pids[0]).parent
        assert server.proc is not None
        server.proc.kill()  # SIGKILL: no cleanup of any kind in the frontend
        server.proc.wait(10)
        # Each worker sees its socket close (EOF) and exits; nobody is left to reap it, so a zombie
        # counts as gone (pid_alive).
        assert wait_until(lambda: not any(pid_alive(p) for p in pids), timeout=15)
    finally:
        server.stop()
        if work_dir is not None:
            shutil.rmtree(work_dir, ignore_errors=True)  # the frontend could not remove it
