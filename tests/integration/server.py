"""A real Conveyor server in a subprocess, for integration tests (reusable by every room).

    with ConveyorProcess(tmp_path, model_store=store, models=["echo=echo.mar"]) as server:
        requests.post(server.inference + "/predictions/echo", data=b"hi")

Ports are free ones picked at start; every wait is bounded; ``stop()`` (also on ``__exit__``) sends
SIGTERM, waits, then SIGKILLs the whole process group, so no test leaves a process behind.
"""

from __future__ import annotations

import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from collections.abc import Mapping, Sequence

import requests

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples"
STARTED = "Model server started."


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def archiver() -> list[str]:
    """torch-model-archiver from the test environment (the real pip package)."""
    exe = Path(sys.executable).parent / "torch-model-archiver"
    return [str(exe)] if exe.exists() else ["torch-model-archiver"]


def build_mar(export_path: Path, name: str, handler: Path, config_file: Path | None = None,
              version: str = "1.0", extra: Sequence[str] = ()) -> Path:
    cmd = [*archiver(), "--model-name", name, "--version", version, "--handler", str(handler),
           "--export-path", str(export_path), "--force", *extra]
    if config_file is not None:
        cmd += ["--config-file", str(config_file)]
    subprocess.run(cmd, check=True, capture_output=True, timeout=60)
    return export_path / f"{name}.mar"


class ConveyorProcess:
    def __init__(
        self,
        workdir: Path,
        model_store: Path | None = None,
        models: Sequence[str] = (),
        properties: Mapping[str, str] | None = None,
        args: Sequence[str] = ("--enable-model-api",),
        env: Mapping[str, str] | None = None,
        token_auth: bool = False,
    ) -> None:
        """``token_auth=False`` (the default, as TorchServe's own tests do) adds
        ``--disable-token-auth``; tests/integration/test_auth.py turns it on."""
        self.workdir = workdir
        workdir.mkdir(parents=True, exist_ok=True)
        self.ports = {name: free_port() for name in ("inference", "management", "metrics")}
        props = {f"{name}_address": f"http://127.0.0.1:{port}" for name, port in self.ports.items()}
        self.ports.update(grpc_inference=free_port(), grpc_management=free_port())
        props.update(grpc_inference_port=str(self.ports["grpc_inference"]),
                     grpc_management_port=str(self.ports["grpc_management"]))
        props.update(properties or {})
        self.config_path = workdir / "config.properties"
        self.config_path.write_text("".join(f"{k}={v}\n" for k, v in props.items()))
        self.pid_file = workdir / "conveyor.pid"
        self.log_path = workdir / "server.log"
        self.argv = [sys.executable, "-m", "frontend.cli", "start", "--foreground",
                     "--ts-config", str(self.config_path), "--pid-file", str(self.pid_file), *args]
        if not token_auth:
            self.argv.append("--disable-token-auth")
        if model_store is not None:
            self.argv += ["--model-store", str(model_store)]
        if models:
            self.argv += ["--models", *models]
        self.env = {**os.environ, **(env or {})}
        self.proc: subprocess.Popen[str] | None = None
        self._lines: queue.Queue[str | None] = queue.Queue()

    @property
    def inference(self) -> str:
        return f"http://127.0.0.1:{self.ports['inference']}"

    @property
    def management(self) -> str:
        return f"http://127.0.0.1:{self.ports['management']}"

    @property
    def metrics(self) -> str:
        return f"http://127.0.0.1:{self.ports['metrics']}"

    def start(self, timeout: float = 60.0) -> ConveyorProcess:
        log = self.log_path.open("ab")
        self.proc = subprocess.Popen(self.argv, cwd=self.workdir, env=self.env, stdin=subprocess.DEVNULL,
                                     stdout=subprocess.PIPE, stderr=log, text=True, start_new_session=True)
        log.close()
        threading.Thread(target=self._read_stdout, daemon=True).start()
        deadline = time.monotonic() + timeout
        try:
            while True:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError(f"server did not start within {timeout} s\n{self.log_tail()}")
                try:
                    line = self._lines.get(timeout=remaining)
                except queue.Empty:
                    continue
                if line is None:
                    raise RuntimeError(f"server exited with {self.proc.wait()} before starting\n{self.log_tail()}")
                if STARTED in line:
                    return self
        except BaseException:
            self.stop()
            raise

    def _read_stdout(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(line)
        self._lines.put(None)

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def stop(self, timeout: float = 30.0) -> int | None:
        """SIGTERM, bounded wait, then SIGKILL of the process group. Returns the exit code."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        return self.proc.returncode

    def __enter__(self) -> ConveyorProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # Conveniences -------------------------------------------------------------------------------

    def describe(self, model: str) -> dict:
        response = requests.get(f"{self.management}/models/{model}", timeout=10)
        response.raise_for_status()
        return response.json()[0]

    def worker_pids(self, model: str) -> list[int]:
        return [w["pid"] for w in self.describe(model)["workers"] if w["pid"] > 0]


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is dead for our purposes; /proc says which.
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def wait_until(predicate, timeout: float = 10.0, interval: float = 0.05) -> bool:
    """Bounded wait for a condition that has no event to wait on (another process's state)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()
