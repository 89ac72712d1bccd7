"""The one interface every batching policy implements, and the types it speaks.

A worker loop (frontend/workers/) drives exactly one Aggregator::

    while running:
        frame = aggregator.next_frame()            # pure: pulls jobs, decides what to send now
        if frame is None:
            wait until aggregator.wake_at() or until the model's batcher signals new work
            continue
        send frame.to_wire(); then for each INFER_REPLY until reply.final:
            for job, result in aggregator.on_reply(reply): job.sink.deliver(result)

Aggregators are pure logic over queues and an injected ``clock`` (monotonic seconds): no sockets,
no event loop, no ``time.time()``. Tests drive them with a fake clock and hand-built replies.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Iterator

from backend.protocol import InferReply, InferRequest, WireResult
from frontend.errors import QueueFull
from frontend.jobs import Job

Clock = Callable[[], float]
Delivery = tuple[Job, WireResult]


@dataclass(frozen=True, slots=True)
class BatchConfig:
    """Batching settings of one model version (from model-config.yaml / register parameters)."""

    batch_size: int = 1
    max_batch_delay: float = 0.1  # seconds (TorchServe's maxBatchDelay is in ms: convert at parse time)
    job_queue_size: int = 100
    continuous: bool = False  # continuousBatching
    sequence: bool = False  # sequenceBatching
    sequence_max_idle: float = 0.0  # seconds; must be > 0 when sequence is True (checked at parse)
    sequence_timeout: float | None = None  # seconds, absolute lifetime of a sequence; None: no limit
    max_num_sequence: int = 1  # open sequences per model
    max_sequence_job_queue_size: int = 1  # queued requests per sequence
    sequence_strict_start: bool = False  # unknown id without the start header → SequenceUnknown
    tombstone_ttl: float = 600.0  # seconds a closed/expired sequence id stays rejected
    max_tombstones: int = 100_000


@dataclass(slots=True)
class Frame:
    """The per-step plan: what one INFER frame carries. Built by an aggregator, sent by the worker loop."""

    frame_id: int
    new_jobs: list[Job] = field(default_factory=list)  # sent with headers and payload (NEW)
    continuing_jobs: list[Job] = field(default_factory=list)  # already in the backend (CONTINUE, id only)
    cancelled_jobs: list[Job] = field(default_factory=list)  # the backend must free them (CANCEL, id only)

    def to_wire(self) -> InferRequest:
        requests = [job.to_wire_new() for job in self.new_jobs]
        requests += [job.to_wire_continue() for job in self.continuing_jobs]
        requests += [job.to_wire_cancel() for job in self.cancelled_jobs]
        return InferRequest(self.frame_id, requests)

    @property
    def num_requests(self) -> int:
        return len(self.new_jobs) + len(self.continuing_jobs) + len(self.cancelled_jobs)


class JobQueue:
    """A bounded FIFO of jobs. ``put`` raises QueueFull; listeners run on every put (they wake workers)."""

    __slots__ = ("capacity", "model_name", "_jobs", "_listeners")

    def __init__(self, capacity: int, model_name: str = "") -> None:
        self.capacity = capacity
        self.model_name = model_name
        self._jobs: deque[Job] = deque()
        self._listeners: list[Callable[[], None]] = []

    def add_listener(self, callback: Callable[[], None]) -> None:
        self._listeners.append(callback)

    def put(self, job: Job) -> None:
        if len(self._jobs) >= self.capacity:
            raise QueueFull(f"model '{self.model_name}' job queue is full ({self.capacity} jobs)")
        self._jobs.append(job)
        for callback in self._listeners:
            callback()

    def put_front(self, job: Job) -> None:
        """Requeue a job that a lost worker never ran; it keeps its place ahead of newer jobs."""
        self._jobs.appendleft(job)

    def pop(self) -> Job | None:
        """The oldest job whose client still waits; cancelled ones are dropped on the way."""
        jobs = self._jobs
        while jobs:
            job = jobs.popleft()
            if not job.cancel_requested:
                return job
            job.transition(job.state.CANCELLED)
        return None

    def remove_expired(self, now: float) -> list[Job]:
        """Take out queued jobs whose deadline has passed (the caller answers them with 408)."""
        expired = [job for job in self._jobs if job.deadline is not None and job.deadline <= now]
        if expired:
            self._jobs = deque(job for job in self._jobs if job not in expired)
        return expired

    def __len__(self) -> int:
        return len(self._jobs)

    def __iter__(self) -> Iterator[Job]:
        return iter(self._jobs)


class Aggregator(ABC):
    """One batching policy for one worker. Owns the jobs it has taken until they finish."""

    def __init__(self, worker_id: str, config: BatchConfig, clock: Clock) -> None:
        self.worker_id = worker_id
        self.config = config
        self.clock = clock
        self._next_frame_id = 1

    def _new_frame(self) -> Frame:
        frame = Frame(self._next_frame_id)
        self._next_frame_id += 1
        return frame

    @abstractmethod
    def next_frame(self) -> Frame | None:
        """Called only when no frame is outstanding. The frame to send now, or None to wait."""

    @abstractmethod
    def wake_at(self) -> float | None:
        """Clock time at which ``next_frame`` may return a frame even if no job arrives
        (e.g. the end of maxBatchDelay); None: wait only for new work."""

    @abstractmethod
    def on_reply(self, reply: InferReply) -> list[Delivery]:
        """Match results to jobs by request id; retire finished jobs; return what to deliver.
        Results for unknown ids are ignored (a job cancelled meanwhile)."""

    @abstractmethod
    def on_worker_lost(self) -> list[Job]:
        """The backend died, hung or broke the protocol. Returns every job that was in the backend
        (the caller fails them); jobs never sent go back to the queue. The aggregator is then empty."""

    @abstractmethod
    def close(self) -> list[Job]:
        """Scale-down: stop taking new jobs; return the jobs taken but never sent (caller requeues)."""

    @property
    @abstractmethod
    def num_active(self) -> int:
        """Jobs this aggregator holds that are in the backend."""
