"""One backend worker process: spawn it, wait until it listens, forward its output, stop it.

The worker prints exactly one stdout line ``CONVEYOR_WORKER_LISTENING pid=<pid> sock=<path>`` when
its Unix socket accepts connections; everything else it prints (and all of stderr) is forwarded
line by line into the frontend log under ``conveyor.worker.<id>``. The last stderr lines are kept
so a failure message can say why the process died.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import signal
import subprocess
import sys
from pathlib import Path
from collections.abc import Mapping

READY_PREFIX = b"CONVEYOR_WORKER_LISTENING"
STDERR_TAIL_LINES = 20
# 128 + SIGKILL: how shells and container runtimes report a process the OOM killer took.
OOM_EXIT_CODE = 137


class SpawnError(Exception):
    """The process exited or stayed silent before it listened. The message carries its stderr tail."""


class _PipeProtocol(asyncio.StreamReaderProtocol):
    def eof_received(self) -> bool:
        super().eof_received()
        return False  # the pipe is done: close its transport (uvloop keeps it open on True)


class ChildProcess:
    """A child process driven from the event loop: its pid, its stdout and stderr as StreamReaders,
    and its exit.

    Started with ``subprocess.Popen``, whose vfork + exec runs no code in the child before exec,
    not ``asyncio.create_subprocess_exec``: under uvloop that forks and runs uvloop's at-fork hook
    (``PyOS_AfterFork_Child``) in the child, which can crash the child (SIGSEGV before exec) while
    other threads of the frontend — gRPC's — are busy. The exit is watched with a pidfd."""

    __slots__ = ("_exited", "_pidfd", "popen", "stderr", "stdout")

    def __init__(self, popen: subprocess.Popen[bytes], stdout: asyncio.StreamReader,
                 stderr: asyncio.StreamReader) -> None:
        self.popen = popen
        self.stdout = stdout
        self.stderr = stderr
        loop = asyncio.get_running_loop()
        self._exited: asyncio.Future[int] = loop.create_future()
        self._pidfd = os.pidfd_open(popen.pid)
        loop.add_reader(self._pidfd, self._on_exit)
        self._on_exit()  # it may be gone already

    @classmethod
    async def start(cls, argv: list[str], env: Mapping[str, str] | None, cwd: str | None) -> ChildProcess:
        popen = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 env=dict(env) if env is not None else None, cwd=cwd,
                                 # Own session: a Ctrl-C on the terminal reaches only the frontend, which
                                 # then stops its workers in order; killpg takes a handler's children too.
                                 start_new_session=True)
        loop = asyncio.get_running_loop()
        readers = []
        for pipe in (popen.stdout, popen.stderr):
            reader = asyncio.StreamReader(limit=1 << 20)
            await loop.connect_read_pipe(lambda r=reader: _PipeProtocol(r), pipe)
            readers.append(reader)
        return cls(popen, readers[0], readers[1])

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def returncode(self) -> int | None:
        return self.popen.returncode

    def _on_exit(self) -> None:
        if self._exited.done() or self.popen.poll() is None:
            return
        asyncio.get_running_loop().remove_reader(self._pidfd)
        os.close(self._pidfd)
        self._exited.set_result(self.popen.returncode)

    async def wait(self) -> int:
        return await asyncio.shield(self._exited)


class WorkerProcess:
    __slots__ = ("_log", "_oom_kills_at_start", "_pumps", "_ready", "proc", "sock_path", "stderr_tail", "worker_id")

    def __init__(self, worker_id: str, sock_path: Path, proc: ChildProcess) -> None:
        self.worker_id = worker_id
        self.sock_path = sock_path
        self.proc = proc
        self.stderr_tail: collections.deque[str] = collections.deque(maxlen=STDERR_TAIL_LINES)
        self._log = logging.getLogger(f"conveyor.worker.{worker_id}")
        self._ready: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._oom_kills_at_start = oom_kill_count()
        # Both pipes are drained from the start: a worker that logs a lot while loading must never
        # block on a full pipe.
        self._pumps = [
            asyncio.create_task(self._pump(proc.stdout, is_stdout=True), name=f"worker-{worker_id}-stdout"),
            asyncio.create_task(self._pump(proc.stderr, is_stdout=False), name=f"worker-{worker_id}-stderr"),
        ]

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def returncode(self) -> int | None:
        return self.proc.returncode

    @classmethod
    async def spawn(
        cls, worker_id: str, sock_path: Path, max_request_size: int, timeout: float,
        env: Mapping[str, str] | None = None, cwd: Path | None = None,
    ) -> WorkerProcess:
        """Start ``python -m backend.worker`` and return once it listens (or raise SpawnError)."""
        proc = await ChildProcess.start(
            [sys.executable, "-m", "backend.worker",
             "--sock-path", str(sock_path), "--worker-id", worker_id, "--max-request-size", str(max_request_size)],
            env, str(cwd) if cwd else None)
        worker = cls(worker_id, sock_path, proc)
        exited = asyncio.ensure_future(proc.wait())
        try:
            done, _ = await asyncio.wait({worker._ready, exited}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
            if worker._ready not in done:
                if exited in done:
                    await worker._drain_pumps()
                    raise SpawnError(f"worker {worker_id} exited with {describe_exit(proc.returncode)} before listening"
                                     f"{worker.stderr_summary()}")
                raise SpawnError(f"worker {worker_id} did not listen within {timeout:g} s{worker.stderr_summary()}")
        except BaseException:
            exited.cancel()
            await worker.kill()
            raise
        exited.cancel()
        return worker

    async def _pump(self, stream: asyncio.StreamReader | None, is_stdout: bool) -> None:
        if stream is None:
            return
        while True:
            line = await stream.readline()
            if not line:
                return
            if is_stdout and not self._ready.done() and line.startswith(READY_PREFIX):
                self._ready.set_result(None)
                continue
            text = line.decode("utf-8", "replace").rstrip()
            if not is_stdout:
                self.stderr_tail.append(text)
            self._log.info("%s", text)

    def out_of_memory(self) -> bool:
        """Did the process die for lack of memory? Exit code 137, or SIGKILL while the kernel's
        OOM-kill count of our cgroup went up (a heuristic: another process of the cgroup may have
        been the victim at the same moment)."""
        code = self.proc.returncode
        if code == OOM_EXIT_CODE:
            return True
        if code != -signal.SIGKILL or self._oom_kills_at_start is None:
            return False
        now = oom_kill_count()
        return now is not None and now > self._oom_kills_at_start

    def stderr_summary(self) -> str:
        if not self.stderr_tail:
            return ""
        return "; last stderr lines:\n" + "\n".join(self.stderr_tail)

    async def wait(self) -> int:
        return await self.proc.wait()

    async def _drain_pumps(self) -> None:
        # The pipes close when the process (and any child holding them) exits; bounded anyway.
        _, pending = await asyncio.wait(self._pumps, timeout=2.0)
        for task in pending:
            task.cancel()
        await asyncio.gather(*self._pumps, return_exceptions=True)

    async def kill(self) -> None:
        """SIGKILL the process group, reap it, stop forwarding, remove the socket file."""
        if self.proc.returncode is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        await self.proc.wait()
        await self._drain_pumps()
        self._remove_socket()

    async def stop(self, grace: float) -> None:
        """Wait up to ``grace`` seconds for an exit the caller asked for (SHUTDOWN or EOF), then kill."""
        if self.proc.returncode is None and grace > 0:
            try:
                await asyncio.wait_for(self.proc.wait(), grace)
            except TimeoutError:
                self._log.warning("worker %s did not exit within %.1f s; killing it", self.worker_id, grace)
        await self.kill()

    def _remove_socket(self) -> None:
        try:
            self.sock_path.unlink()
        except FileNotFoundError:
            pass


def oom_kill_count() -> int | None:
    """The kernel's OOM-kill counter of this process's memory cgroup (v2 ``memory.events`` or v1
    ``memory.oom_control``); None when neither is readable."""
    candidates: list[Path] = []
    try:
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            if controllers == "":
                candidates.append(Path(f"/sys/fs/cgroup{path.rstrip('/')}/memory.events"))
            elif "memory" in controllers.split(","):
                candidates.append(Path(f"/sys/fs/cgroup/memory{path.rstrip('/')}/memory.oom_control"))
    except (OSError, ValueError):
        pass
    # Inside a container the cgroup is usually mounted as the root of the hierarchy.
    candidates += [Path("/sys/fs/cgroup/memory.events"), Path("/sys/fs/cgroup/memory/memory.oom_control")]
    for candidate in candidates:
        try:
            text = candidate.read_text()
        except OSError:
            continue
        for line in text.splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill" and value.strip().isdigit():
                return int(value)
    return None


def describe_exit(returncode: int | None) -> str:
    if returncode is None:
        return "no exit status"
    if returncode == OOM_EXIT_CODE:
        return f"exit code {OOM_EXIT_CODE} (128 + SIGKILL: killed, usually out of memory)"
    if returncode < 0:
        try:
            return f"signal {signal.Signals(-returncode).name}"
        except ValueError:
            return f"signal {-returncode}"
    return f"exit code {returncode}"
