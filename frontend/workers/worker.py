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

The loop does not know which batching policy runs behind the aggregator. With continuous batching
one frame is one step, and a busy worker goes from a final reply straight to the next frame (new
jobs join there, a cancelled job's CANCEL goes there); ``StepMeter`` times that turnaround.

State probe (``probe_state``, for ``GET /models/{m}?state=true`` and the soak's leak check): the
next frame carries one extra CONTINUE for the reserved id ``#state`` (backend/service.py), or an
idle worker sends a frame (id 0, never an aggregator's) with it alone; the backend answers it last
in the final reply with its ``active`` table size and the handler's live counts. Aggregators ignore
a result for an id they do not hold, so no job sees it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass
from enum import IntEnum
from pathlib import Path
from collections.abc import Callable, Mapping

from backend.protocol import (
    ConnectionClosed, InferReply, InferRequest, LoadReply, LoadRequest, Message, ProtocolError,
    RequestState, Shutdown, WireRequest, WireResult, decode_payload, read_frame, read_message, write_message,
)
from frontend.batching.base import Aggregator, Frame
from frontend.batching.model_batcher import ModelBatcher
from frontend.jobs import Job, JobState
from frontend.metrics import ServerMetrics
from frontend.sinks import failure_error, report_failure
from frontend.workers.process import SpawnError, WorkerProcess, describe_exit

log = logging.getLogger(__name__)

# TorchServe's restart back-off (seconds), a Fibonacci series; capped by maxRetryTimeoutInSec.
BACKOFF_SERIES = (0, 1, 1, 2, 3, 5, 8, 13, 21, 34, 55, 89, 144, 233, 377, 610)
SHUTDOWN_GRACE = 5.0  # seconds a worker gets to exit after SHUTDOWN before it is killed
_FRAME_OVERHEAD = 1 << 20  # room for ids, headers and framing beyond the result bodies
# State probe (module docstring). The id matches backend/service.py's STATE_PROBE_ID (a test checks)
# and no client request can have it ('#' is outside frontend/api/common.py's _CLIENT_ID).
STATE_PROBE_ID = "#state"
_STATE_PROBE = WireRequest(STATE_PROBE_ID, RequestState.CONTINUE)
PROBE_FRAME_ID = 0  # aggregators number their frames from 1


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
    """Why a worker had to be replaced; the message names the worker and the cause. ``status`` is
    what its in-flight jobs get: 500, or 507 when the process died out of memory."""

    def __init__(self, message: str, status: int = 500) -> None:
        super().__init__(message)
        self.status = status


def fail_jobs(jobs: list[Job], message: str, status: int = 500) -> None:
    """End jobs that a worker can no longer answer; each client gets ``message`` with ``status``
    (a WorkerError; 503: ServiceUnavailable, e.g. at shutdown)."""
    for job in jobs:
        if not job.state.finished:
            job.transition(JobState.FAILED)
            report_failure(job, failure_error(status, message))


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
        gpu_id: int = -1, on_state: Callable[[Worker], None] | None = None,
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
        self._stop_reason = ""  # what in-flight jobs are told when a stop past its timeout fails them
        # State probes: one asked for and not sent yet, and one riding on the outstanding frame.
        self._probe: asyncio.Future[dict[str, int] | None] | None = None
        self._probe_sent: asyncio.Future[dict[str, int] | None] | None = None
        self._meter: StepMeter | None = None  # the running step loop's

    # Control (called by the pool) -----------------------------------------------------------------

    def start(self) -> None:
        self._task = asyncio.create_task(self._supervise(), name=f"worker-{self.worker_id}")

    def wake(self) -> None:
        self._wake.set()

    async def first_load(self) -> str:
        """'' once the model loaded for the first time, else the first failure's message."""
        return await asyncio.shield(self._first_load)

    async def probe_state(self, timeout: float) -> dict[str, int] | None:
        """The backend's per-request state after its next frame (module docstring): ``num_active``
        and the handler's ``num_live_requests`` / ``num_live_sequences`` if it has them. None when
        the worker is not serving or gave no answer within ``timeout`` seconds."""
        if self.state != WorkerState.READY:
            return None
        if self._probe is None or self._probe.done():
            self._probe = asyncio.get_running_loop().create_future()
        probe = self._probe
        self._wake.set()
        try:
            return await asyncio.wait_for(asyncio.shield(probe), timeout)
        except TimeoutError:
            return None

    def describe_state(self) -> dict[str, int]:
        """What the frontend holds for this worker now: its aggregator's jobs (running, gathered,
        CANCELs owed) and the streams whose chunk timing the step loop tracks. All 0 when idle."""
        aggregator = self.batcher.aggregators.get(self.worker_id)
        state = aggregator.describe_state() if aggregator is not None else {
            "num_running": 0, "num_gathered": 0, "num_cancels_owed": 0}
        state["num_timed_streams"] = self._meter.num_timed if self._meter is not None else 0
        return state

    def _end_probes(self) -> None:
        """The step loop ended: nobody will answer the probes it had."""
        for probe in (self._probe, self._probe_sent):
            if probe is not None and not probe.done():
                probe.set_result(None)
        self._probe = self._probe_sent = None

    async def stop(self, timeout: float | None = None, reason: str = "") -> None:
        """Drain (finish in-flight work, take nothing new), send SHUTDOWN, reap. After ``timeout``
        seconds the slot is cancelled: its in-flight jobs then fail (503 with ``reason`` when
        given) and the process is killed."""
        self._stop_reason = reason or self._stop_reason
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
                    except TimeoutError:
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
        except TimeoutError:
            pass
        status = f", {describe_exit(proc.returncode)}" if proc.returncode is not None else ""
        oom = proc.out_of_memory()
        return WorkerFailure(f"model '{self.spec.model_name}' worker {self.worker_id} (pid {proc.pid}) "
                             f"{what}{status}{' (out of memory)' if oom else ''}{proc.stderr_summary()}",
                             status=507 if oom else 500)

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
            except TimeoutError:
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
            if isinstance(exc, WorkerFailure):
                fail_jobs(lost, str(exc), exc.status)
            elif self._stop_reason:
                fail_jobs(lost, self._stop_reason, 503)
            else:
                fail_jobs(lost, f"worker {self.worker_id} was stopped")
            if not loop_task.done():
                loop_task.cancel()
                await asyncio.gather(loop_task, return_exceptions=True)
            raise
        finally:
            exit_task.cancel()
            self._end_probes()
            self._meter = None

    async def _step_loop(self, aggregator: Aggregator, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        clock = self.batcher.clock
        loop = asyncio.get_running_loop()
        max_payload = self.spec.batch_size * (self.spec.max_response_size + 4096) + _FRAME_OVERHEAD
        timeout = self.spec.response_timeout
        meter = self._meter = StepMeter(self.metrics, self.spec.model_name, self.worker_id)
        # perf_counter() when the last final reply's bytes were in; None after an idle wait, so the
        # overhead timer measures only back-to-back steps of a busy worker.
        replied_at: float | None = None
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
            probe, self._probe = self._probe, None
            if probe is not None and probe.done():
                probe = None
            if frame is None:
                replied_at = None
                if probe is not None:  # idle: a frame with the probe alone
                    self._probe_sent = probe
                    write_message(writer, InferRequest(PROBE_FRAME_ID, (_STATE_PROBE,)))
                    await writer.drain()
                    async with asyncio.timeout(timeout):
                        reply, _ = await _read_reply(reader, max_payload)
                    if not isinstance(reply, InferReply) or reply.frame_id != PROBE_FRAME_ID or not reply.final:
                        raise ProtocolError(f"expected the final INFER_REPLY for state probe frame {PROBE_FRAME_ID}, "
                                            f"got {type(reply).__name__}")
                    probe.set_result(probe_counts(reply))
                    self._probe_sent = None
                    continue
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
            meter.frame_built(frame, clock())
            wire = frame.to_wire()
            if probe is not None:
                self._probe_sent = probe
                wire = InferRequest(wire.frame_id, (*wire.requests, _STATE_PROBE))
            write_message(writer, wire)
            await writer.drain()
            if replied_at is not None:
                meter.overhead(time.perf_counter() - replied_at, frame)
            while True:
                # asyncio.timeout, not wait_for: on 3.11 wait_for wraps the read in a Task of its own.
                async with asyncio.timeout(timeout):
                    reply, received_at = await _read_reply(reader, max_payload)
                if not isinstance(reply, InferReply) or reply.frame_id != frame.frame_id:
                    got = f"frame {reply.frame_id}" if isinstance(reply, InferReply) else type(reply).__name__
                    raise ProtocolError(f"expected INFER_REPLY for frame {frame.frame_id}, got {got}")
                now = clock()
                for job, result in aggregator.on_reply(reply):
                    meter.result(job, result, now)
                    if job.sink is not None:
                        job.sink.deliver(result)
                if reply.final:
                    replied_at = received_at
                    if probe is not None:
                        probe.set_result(probe_counts(reply))
                        self._probe_sent = None
                    break


def probe_counts(reply: InferReply) -> dict[str, int] | None:
    """The backend's answer to a state probe in a final reply (None: none, or not understood)."""
    for result in reversed(reply.results):
        if result.request_id == STATE_PROBE_ID:
            try:
                counts = json.loads(result.body) if result.status == 200 else None
            except ValueError:
                return None
            if isinstance(counts, dict) and all(isinstance(v, int) for v in counts.values()):
                return counts
            return None
    return None


async def _read_reply(reader: asyncio.StreamReader, max_payload: int) -> tuple[Message, float]:
    """``read_message``, split so the step-overhead timer starts once the reply's bytes are in:
    decoding them is frontend work, waiting for them is not. Returns (message, perf_counter())."""
    msg_type, payload = await read_frame(reader, max_payload)
    received_at = time.perf_counter()
    return decode_payload(msg_type, payload), received_at


class StepMeter:
    """The step loop's metrics for one worker (issue 5 §6), with the label children bound once.

    Per frame: steps, active batch size (NEW + CONTINUE), CANCEL entries, queue wait of NEW jobs.
    Per result: time to first chunk (accepted → first successful result handed to the sink) and
    time between two results of one request. Per back-to-back step: the frontend's overhead, also
    logged at DEBUG (``frontend.workers.worker``) so a benchmark can take exact percentiles.
    """

    __slots__ = (
        "_batch_size",
        "_between",
        "_cancels",
        "_debug",
        "_first",
        "_last_at",
        "_overhead",
        "_queue",
        "_steps",
        "worker_id",
    )

    def __init__(self, metrics: ServerMetrics, model_name: str, worker_id: str) -> None:
        self.worker_id = worker_id
        self._steps = metrics.steps.labels(model_name)
        self._batch_size = metrics.batch_size.labels(model_name)
        self._cancels = metrics.cancels_sent.labels(model_name)
        self._queue = metrics.queue_latency.labels(model_name)
        self._first = metrics.time_to_first_chunk.labels(model_name)
        self._between = metrics.time_between_chunks.labels(model_name)
        self._overhead = metrics.step_overhead.labels(model_name)
        # request id → clock() of its last result. Bounded: an entry leaves with its request's
        # terminal result or its CANCEL entry, and the whole map with the loop (worker lost).
        self._last_at: dict[str, float] = {}
        self._debug = log.isEnabledFor(logging.DEBUG)

    @property
    def num_timed(self) -> int:
        """Streams whose time between chunks is being measured (0 when none runs)."""
        return len(self._last_at)

    def frame_built(self, frame: Frame, now: float) -> None:
        self._steps.inc()
        self._batch_size.observe(len(frame.new_jobs) + len(frame.continuing_jobs))
        for job in frame.new_jobs:
            self._queue.observe(max(0.0, now - job.created_at))
        if frame.cancelled_jobs:
            self._cancels.inc(len(frame.cancelled_jobs))
            for job in frame.cancelled_jobs:
                self._last_at.pop(job.request_id, None)

    def result(self, job: Job, result: WireResult, now: float) -> None:
        previous = self._last_at.pop(job.request_id, None)
        if previous is not None:
            self._between.observe(max(0.0, now - previous))
        elif result.status < 400:
            self._first.observe(max(0.0, now - job.created_at))
        if not result.done:  # aggregators deliver every terminal result (failures too) as done
            self._last_at[job.request_id] = now

    def overhead(self, seconds: float, frame: Frame) -> None:
        self._overhead.observe(seconds)
        if self._debug:
            log.debug("worker %s step overhead %.1f us batch=%d", self.worker_id, seconds * 1e6,
                      len(frame.new_jobs) + len(frame.continuing_jobs))
