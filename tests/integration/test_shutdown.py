"""Graceful stop: SIGTERM lets an open stream finish, then every worker stops; nothing is left."""

from __future__ import annotations

import json
import signal
import threading
import time
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
