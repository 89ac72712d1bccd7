"""Fixtures for the backend tests: a real worker process driven over its socket, isolated imports."""

from __future__ import annotations

import json
import os
import select
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from collections.abc import Iterator, Sequence

import pytest

from backend.protocol import (
    InferReply,
    InferRequest,
    InputParameter,
    LoadReply,
    LoadRequest,
    Message,
    RequestState,
    WireRequest,
    recv_message,
    send_message,
)

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples"


def new(rid: str, body: bytes | str = b"", content_type: str = "application/json",
        headers: Sequence[tuple[str, str]] = (), sequence_id: str = "") -> WireRequest:
    value = body.encode() if isinstance(body, str) else body
    return WireRequest(rid, RequestState.NEW, sequence_id, headers=tuple(headers),
                       parameters=(InputParameter("body", content_type, value),))


def cont(rid: str) -> WireRequest:
    return WireRequest(rid, RequestState.CONTINUE)


def cancel(rid: str) -> WireRequest:
    return WireRequest(rid, RequestState.CANCEL)


class WorkerProcess:
    """``python -m backend.worker`` plus one connected socket; ``close()`` always leaves no process."""

    def __init__(self, workdir: Path, worker_id: str = "W-test-1", extra_args: Sequence[str] = ()) -> None:
        # Unix socket paths are limited to ~108 bytes: keep them short, away from pytest's long tmp paths.
        self._sockdir = tempfile.mkdtemp(prefix="cw")
        self.sock_path = os.path.join(self._sockdir, "w.sock")
        self.worker_id = worker_id
        self.stderr_path = workdir / f"{worker_id}.stderr"
        self._stderr = open(self.stderr_path, "wb")
        self.sock: socket.socket | None = None
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "backend.worker", "--sock-path", self.sock_path, "--worker-id", worker_id,
             *extra_args],
            stdout=subprocess.PIPE, stderr=self._stderr, cwd=REPO,
        )
        self.ready_line = self._read_ready_line(timeout=20)

    def _read_ready_line(self, timeout: float) -> str:
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not ready:
            raise AssertionError(f"worker printed nothing in {timeout}s; stderr: {self.stderr()}")
        return self.proc.stdout.readline().decode().rstrip("\n")

    def connect(self) -> WorkerProcess:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(60)
        self.sock.connect(self.sock_path)
        return self

    def send(self, msg: Message) -> None:
        assert self.sock is not None
        send_message(self.sock, msg)

    def recv(self) -> Message:
        assert self.sock is not None
        return recv_message(self.sock)

    def load(self, model_dir: Path | str, handler: str, batch_size: int = 4, manifest: dict | None = None,
             yaml_config: dict | None = None, max_response_size: int = 6553500, name: str = "m") -> LoadReply:
        self.send(LoadRequest(name, str(model_dir), handler, self.worker_id, batch_size, -1, max_response_size,
                              json.dumps(manifest or {}), json.dumps(yaml_config or {})))
        reply = self.recv()
        assert isinstance(reply, LoadReply)
        return reply

    def infer(self, frame_id: int, requests: Sequence[WireRequest]) -> list[InferReply]:
        """Send one frame; every reply up to and including the final one."""
        self.send(InferRequest(frame_id, tuple(requests)))
        replies: list[InferReply] = []
        while True:
            reply = self.recv()
            assert isinstance(reply, InferReply), reply
            assert reply.frame_id == frame_id
            replies.append(reply)
            if reply.final:
                return replies

    def stderr(self) -> str:
        self._stderr.flush()
        return self.stderr_path.read_text(errors="replace")

    def wait(self, timeout: float = 10) -> int:
        return self.proc.wait(timeout=timeout)

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None
        try:
            self.proc.wait(timeout=5)  # end of stream makes the worker exit by itself
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=5)
        finally:
            if self.proc.stdout is not None:
                self.proc.stdout.close()
            self._stderr.close()
            shutil.rmtree(self._sockdir, ignore_errors=True)


@pytest.fixture
def start_worker(tmp_path: Path) -> Iterator:
    started: list[WorkerProcess] = []

    def start(worker_id: str = "W-test-1", extra_args: Sequence[str] = (), connect: bool = True) -> WorkerProcess:
        w = WorkerProcess(tmp_path, worker_id, extra_args)
        started.append(w)
        return w.connect() if connect else w

    yield start
    for w in started:
        w.close()


@pytest.fixture
def isolated_imports() -> Iterator[None]:
    """Undo what loading a handler in-process does: sys.path entries and modules from temp dirs."""
    saved_path = list(sys.path)
    saved_modules = set(sys.modules)
    saved_cwd = os.getcwd()
    yield
    sys.path[:] = saved_path
    tmp = tempfile.gettempdir()
    for name in set(sys.modules) - saved_modules:
        origin = getattr(sys.modules[name], "__file__", None) or ""
        if origin.startswith(tmp):
            del sys.modules[name]
    os.chdir(saved_cwd)
