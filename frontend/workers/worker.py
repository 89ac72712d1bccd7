"""One worker slot of a model version: supervises a backend process and runs its step loop.

Lifecycle (one state machine, transitions only in ``_set_state``)::

    STARTING ──▶ READY ──▶ DRAINING ──▶ STOPPED          (scale-down / unregister / shutdown)
       │           │
       └───────────┴──▶ BACKOFF ──▶ STARTING ...        (process died, hung, broke the protocol)

The step loop is the only code that touches the worker's socket (DESIGN §1)::

    clear the wake event; report what batcher.tick() failed (timeouts, expired sequences)
    frame = aggregator.next_frame()
    no frame  → sleep until the batcher signals work, aggregator.wake_at() or batcher.next_deadline()
    a frame   → send it; read INFER_REPLYs (each within responseTimeout) until reply.final,
                handing every (job, result) from aggregator.on_reply() to job.sink.deliver()

The loop does not know which batching policy runs behind the aggregator.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass
from enum import IntEnum
from pathlib import Path
from typing import Callable, Mapping

from backend.protocol import (
    ConnectionClosed, InferReply, LoadReply, LoadRequest, ProtocolError, Shutdown, read_message, write_message,
)
from frontend.batching.base import Aggregator
from frontend.batching.model_batcher import ModelBatcher
from frontend.errors import WorkerError
from frontend.jobs import Job, JobState
from frontend.metrics import ServerMetrics
from frontend.sinks import report_failure
from frontend.workers.process import SpawnError, WorkerProcess, describe_exit

log = logging.getLogger(__name__)

# TorchServe's restart back-off (seconds), a Fibonacci series; capped by maxRetryTimeoutInSec.
BACKOFF_SERIES = (0, 1, 1, 2, 3, 5, 8, 13, 21, 34, 55, 89, 144, 233, 377, 610)
SHUTDOWN_GRACE = 5.0  # seconds a worker gets to exit after SHUTDOWN before it is killed
_FRAME_OVERHEAD = 1 << 20  # room for ids, headers and framing beyond the result bodies


class WorkerState(IntEnum):
    STARTING = 0  # process spawning or model loading
    READY = 1  # serving
    DRAINING = 2  # finishing in-flight work, takes nothing new
    BACKOFF = 3  # failed; waiting before the next start
    STOPPED = 4

    @property
    def describe_name(self) -> str:
        """TorchServe's describe-model status words."""
        return _DESCRIBE_NAMES[self]


_DESCRIBE_NAMES = {
    WorkerState.STARTING: "STARTING", WorkerState.READY: "READY", WorkerState.DRAINING: "UNLOADING",
    WorkerState.BACKOFF: "ERROR", WorkerState.STOPPED: "STOPPED",
}


_ALLOWED: dict[WorkerState, frozenset[WorkerState]] = {
    WorkerState.STARTING: frozenset({WorkerState.READY, WorkerState.BACKOFF, WorkerState.STOPPED, WorkerState.DRAINING}),
    WorkerState.READY: frozenset({WorkerState.DRAINING, WorkerState.BACKOFF, WorkerState.STOPPED}),
    WorkerState.DRAINING: frozenset({WorkerState.STOPPED, WorkerState.BACKOFF}),
    WorkerState.BACKOFF: frozenset({WorkerState.STARTING, WorkerState.STOPPED}),
    WorkerState.STOPPED: frozenset(),
}


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    """What every worker of one model version is started with."""

    model_name: str
    model_version: str
    model_dir: str
    handler: str
    batch_size: int
    max_request_size: int
    max_response_size: int
    startup_timeout: float  # seconds: spawn + LOAD
    response_timeout: float  # seconds: one INFER step (between replies)
    max_retry_timeout: float  # seconds: cap of the restart back-off
    manifest: Mapping
    model_yaml_config: Mapping
    sock_dir: Path
    env: Mapping[str, str] | None = None


class WorkerFailure(Exception):
    """Why a worker had to be replaced; the message names the worker and the cause."""


def fail_jobs(jobs: list[Job], message: str) -> None:
    """End jobs that a worker can no longer answer; each client gets a WorkerError with ``message``."""
    for job in jobs:
        if not job.state.finished:
            job.transition(JobState.FAILED)
            report_failure(job, WorkerError(message))


def requeue(batcher: ModelBatcher, jobs: list[Job], wake: Callable[[], None]) -> None:
    """Put jobs a draining worker gathered but never sent back at the head of the queue, in order."""
    for job in reversed(jobs):
        if job.state != JobState.QUEUED:
            job.transition(JobState.QUEUED)
        batcher.queue.put_front(job)
    if jobs:
        wake()


class Worker:
    def __init__(
        self, worker_id: str, spec: WorkerSpec, batcher: ModelBatcher, metrics: ServerMetrics,
        gpu_id: int = -1, on_state: Callable[["Worker"], None] | None = None,
        wake_pool: Callable[[], None] = lambda: None,
    ) -> None:
        self.worker_id = worker_id
        self.spec = spec
        self.batcher = batcher
        self.metrics = metrics
        self.gpu_id = gpu_id
        self.state = WorkerState.STARTING
        self.pid: int | None = None
        self.start_time = time.time()
        self.last_error = ""
        self.num_restarts = 0
        self._failures_in_a_row = 0  # position in BACKOFF_SERIES
        self._on_state = on_state
        self._wake_pool = wake_pool  # wakes every worker of the model (requeued jobs need a taker)
        self._wake = asyncio.Event()  # set by the batcher's listener: maybe new work
        self._stopping = asyncio.Event()  # drain and stop; also cuts a back-off sleep short
        self._first_load: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        self._task: asyncio.Task[None] | None = None

    # Control (called by the pool) -----------------------------------------------------------------

    def start(self) -> None:
        self._task = asyncio.create_task(self._supervise(), name=f"worker-{self.worker_id}")

    def wake(self) -> None:
        self._wake.set()

    async def first_load(self) -> str:
        """'' once the model loaded for the first time, else the first failure's message."""
        return await asyncio.shield(self._first_load)

    async def stop(self, timeout: float | None = None) -> None:
        """Drain (finish in-flight work, take nothing new), send SHUTDOWN, reap. After ``timeout``
        seconds the slot is cancelled: its in-flight jobs then fail and the process is killed."""
        self._stopping.set()
        self._wake.set()
        if self._task is None:
            return
        done, _ = await asyncio.wait({self._task}, timeout=timeout)
        if not done:
            self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)

    # Supervision ------------------------------------------------------------------------------------

    def _set_state(self, new: WorkerState) -> None:
        if new == self.state:
            return
        if new not in _ALLOWED[self.state]:
            raise RuntimeError(f"worker {self.worker_id}: illegal transition {self.state.name} → {new.name}")
        self.state = new
        if self._on_state is not None:
            self._on_state(self)

    async def _supervise(self) -> None:
        try:
            while not self._stopping.is_set():
                self._set_state(WorkerState.STARTING)
                try:
                    await self._run_once()
                    break  # drained on request
                except WorkerFailure as exc:
                    self.last_error = str(exc)
                    log.error("%s", exc)
                    if not self._first_load.done():
                        self._first_load.set_result(str(exc))
                    if self._stopping.is_set():
                        break
                    self._set_state(WorkerState.BACKOFF)
                    self.num_restarts += 1
                    self.metrics.worker_restarts.labels(self.spec.model_name).inc()
                    attempt = self._failures_in_a_row
                    delay = min(BACKOFF_SERIES[min(attempt, len(BACKOFF_SERIES) - 1)], self.spec.max_retry_timeout)
                    self._failures_in_a_row += 1
                    log.info("restarting worker %s in %g s (attempt %d)", self.worker_id, delay, attempt + 1)
                    try:
                        await asyncio.wait_for(self._stopping.wait(), delay)
                    except asyncio.TimeoutError:
                        pass
        finally:
            if not self._first_load.done():
                self._first_load.set_result(self.last_error or f"worker {self.worker_id} stopped before it loaded")
            self.pid = None
            self._set_state(WorkerState.STOPPED)  # also on cancellation (shutdown past its grace)

    async def _run_once(self) -> None:
        """One process lifetime: spawn, load, serve until drained. Raises WorkerFailure."""
        spec = self.spec
        sock_path = spec.sock_dir / f"w{self.worker_id}.sock"
        try:
            proc = await WorkerProcess.spawn(self.worker_id, sock_path, spec.max_request_size, spec.startup_timeout, spec.env)
        except (SpawnError, OSError) as exc:
            raise WorkerFailure(f"model '{spec.model_name}' worker {self.worker_id}: {exc}") from None
        self.pid = proc.pid
        self.start_time = time.time()
        writer: asyncio.StreamWriter | None = None
        graceful = False
        try:
            reader, writer = await self._load(proc)
            self._set_state(WorkerState.READY)
            self._failures_in_a_row = 0  # a worker that loaded starts the back-off series afresh
            if not self._first_load.done():
                self._first_load.set_result("")
            log.info("worker %s (pid %d) of model '%s' is ready", self.worker_id, proc.pid, spec.model_name)
            await self._serve_until_drained(proc, reader, writer)
            graceful = True
        finally:
            if writer is not None:
                if graceful:
                    try:
                        write_message(writer, Shutdown())
                        await writer.drain()
                    except (ConnectionError, OSError):
                        pass
                writer.close()
            # Closing our end is an EOF for the worker, so it exits even without SHUTDOWN.
            await proc.stop(SHUTDOWN_GRACE if graceful else 0.0)
            self.pid = None

    async def _load(self, proc: WorkerProcess) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        spec = self.spec
        writer: asyncio.StreamWriter | None = None
        try:
            async with asyncio.timeout(spec.startup_timeout):
                reader, writer = await asyncio.open_unix_connection(str(proc.sock_path))
                write_message(writer, LoadRequest(
                    model_name=spec.model_name, model_dir=spec.model_dir, handler=spec.handler,
                    worker_id=self.worker_id, batch_size=spec.batch_size, gpu_id=self.gpu_id,
                    max_response_size=spec.max_response_size, manifest_json=json.dumps(dict(spec.manifest)),
                    model_yaml_config_json=json.dumps(dict(spec.model_yaml_config)),
                ))
                await writer.drain()
                reply = await read_message(reader)
            if not isinstance(reply, LoadReply):
                raise WorkerFailure(f"model '{spec.model_name}' worker {self.worker_id} answered LOAD with "
                                    f"{type(reply).__name__}")
            if reply.status != 200:
                raise WorkerFailure(f"model '{spec.model_name}' worker {self.worker_id} failed to load "
                                    f"(status {reply.status}): {reply.message}{proc.stderr_summary()}")
            return reader, writer
        except BaseException as exc:
            if writer is not None:
                writer.close()
            if isinstance(exc, TimeoutError):
                raise WorkerFailure(f"model '{spec.model_name}' worker {self.worker_id} did not load within "
                                    f"startupTimeout={spec.startup_timeout:g} s{proc.stderr_summary()}") from None
            if isinstance(exc, (ConnectionClosed, ProtocolError, OSError)):
                raise await self._failure(proc, f"broke off while loading ({exc})") from None
            raise

    async def _failure(self, proc: WorkerProcess, what: str) -> WorkerFailure:
        """A failure message with the exit status when the process is (about to be) gone."""
        try:
            await asyncio.wait_for(proc.wait(), 1.0)
        except asyncio.TimeoutError:
            pass
        status = f", {describe_exit(proc.returncode)}" if proc.returncode is not None else ""
        return WorkerFailure(f"model '{self.spec.model_name}' worker {self.worker_id} (pid {proc.pid}) "
                             f"{what}{status}{proc.stderr_summary()}")

    async def _serve_until_drained(self, proc: WorkerProcess, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Run the step loop while watching the process; any failure fails the in-flight jobs."""
        aggregator = self.batcher.add_worker(self.worker_id)
        loop_task = asyncio.create_task(self._step_loop(aggregator, reader, writer), name=f"worker-{self.worker_id}-loop")
        exit_task = asyncio.ensure_future(proc.wait())
        try:
            await asyncio.wait({loop_task, exit_task}, return_when=asyncio.FIRST_COMPLETED)
            if not loop_task.done():  # the process died while the loop was waiting for work
                loop_task.cancel()
                await asyncio.gather(loop_task, return_exceptions=True)
                raise await self._failure(proc, "exited")
            try:
                loop_task.result()
            except asyncio.TimeoutError:
                raise WorkerFailure(f"model '{self.spec.model_name}' worker {self.worker_id} (pid {proc.pid}) gave no "
                                    f"reply within responseTimeout={self.spec.response_timeout:g} s; killed") from None
            except ProtocolError as exc:
                raise WorkerFailure(f"model '{self.spec.model_name}' worker {self.worker_id} (pid {proc.pid}) "
                                    f"broke the protocol: {exc}; killed") from None
            except (ConnectionClosed, ConnectionError) as exc:
                raise await self._failure(proc, f"closed the connection ({exc})") from None
            except Exception as exc:  # a bug on our side: replace the worker rather than wedge the model
                log.exception("worker %s step loop failed", self.worker_id)
                raise WorkerFailure(f"model '{self.spec.model_name}' worker {self.worker_id}: internal error "
                                    f"{exc!r}") from None
            self.batcher.remove_worker(self.worker_id)  # drained: unsent jobs go back to the queue
        except BaseException as exc:
            # Whatever ended the loop abnormally (failure, shutdown cancel): the jobs that were in
            # this backend cannot be answered any more; jobs never sent stay queued for others.
            lost = self.batcher.worker_lost(self.worker_id)
            message = str(exc) if isinstance(exc, WorkerFailure) else f"worker {self.worker_id} was stopped"
            fail_jobs(lost, message)
            if not loop_task.done():
                loop_task.cancel()
                await asyncio.gather(loop_task, return_exceptions=True)
            raise
        finally:
            exit_task.cancel()

    async def _step_loop(self, aggregator: Aggregator, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        clock = self.batcher.clock
        loop = asyncio.get_running_loop()
        max_payload = self.spec.batch_size * (self.spec.max_response_size + 4096) + _FRAME_OVERHEAD
        timeout = self.spec.response_timeout
        queue_latency = self.metrics.queue_latency.labels(self.spec.model_name)
        closed = False
        while True:
            if self._stopping.is_set() and not closed:
                # Stop taking new jobs at once; jobs gathered but not sent go back to the queue.
                self._set_state(WorkerState.DRAINING)
                requeue(self.batcher, aggregator.close(), self._wake_pool)
                closed = True
            # Cleared before asking, so a submit that lands after next_frame() still wakes us.
            self._wake.clear()
            for job, error in self.batcher.tick():  # timeouts, sequence expiry: already FAILED/EXPIRED
                report_failure(job, error)
            frame = aggregator.next_frame()
            if frame is None:
                if closed and aggregator.num_active == 0:
                    return
                times = [t for t in (aggregator.wake_at(), self.batcher.next_deadline()) if t is not None]
                wake_at = min(times) if times else None
                timer = loop.call_later(max(0.0, wake_at - clock()), self._wake.set) if wake_at is not None else None
                try:
                    await self._wake.wait()
                finally:
                    if timer is not None:
                        timer.cancel()
                continue
            now = clock()
            for job in frame.new_jobs:
                queue_latency.observe(max(0.0, now - job.created_at))
            write_message(writer, frame.to_wire())
            await writer.drain()
            while True:
                reply = await asyncio.wait_for(read_message(reader, max_payload), timeout)
                if not isinstance(reply, InferReply) or reply.frame_id != frame.frame_id:
                    got = f"frame {reply.frame_id}" if isinstance(reply, InferReply) else type(reply).__name__
                    raise ProtocolError(f"expected INFER_REPLY for frame {frame.frame_id}, got {got}")
                for job, result in aggregator.on_reply(reply):
                    if job.sink is not None:
                        job.sink.deliver(result)
                if reply.final:
                    break
