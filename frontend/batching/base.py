"""The one interface every batching policy implements, and the types it speaks.

A worker loop (frontend/workers/) drives exactly one Aggregator::

    while running:
        for job, error in batcher.tick(): job.sink.fail(error.status, error.message)   # timeouts etc.
        frame = aggregator.next_frame()            # pure: pulls jobs, decides what to send now
        if frame is None:
            wait until aggregator.wake_at() or until the model's batcher signals new work
            continue
        send frame.to_wire(); then for each INFER_REPLY until reply.final:
            for job, result in aggregator.on_reply(reply): job.sink.deliver(result)

``batcher`` is the model's ModelBatcher (model_batcher.py documents ``tick``).

Aggregators are pure logic over queues and an injected ``clock`` (monotonic seconds): no sockets,
no event loop, no ``time.time()``. Tests drive them with a fake clock and hand-built replies.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections import deque
from dataclasses import dataclass, field
from collections.abc import Callable, Iterator

from backend.protocol import InferReply, InferRequest, WireResult
from frontend.errors import InvalidConfig, QueueFull
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
    # Result header by which a handler ends sequences at once: value "<id>[;<id>...]"
    # (config.properties ts_header_key_sequence_end; matched case-insensitively).
    sequence_end_header: str = "ts_request_sequence_end"

    @property
    def policy(self) -> str:
        """The aggregator this config selects: dynamic, continuous, sequence or sequence_continuous."""
        if self.sequence:
            return "sequence_continuous" if self.continuous else "sequence"
        return "continuous" if self.continuous else "dynamic"

    def validate(self, source: str) -> None:
        """Raise InvalidConfig for the first value that breaks a rule, naming the key as the user
        writes it (model-config.yaml / register parameters), the value as written and ``source``."""
        ints = (
            ("batch_size", 1), ("job_queue_size", 1), ("max_num_sequence", 1),
            ("max_sequence_job_queue_size", 1), ("max_tombstones", 0),
        )
        for name, minimum in ints:
            value = getattr(self, name)
            if type(value) is not int or value < minimum:
                _invalid(name, value, source, f"must be an integer >= {minimum}")
        for name in ("max_batch_delay", "sequence_max_idle", "tombstone_ttl"):
            value = getattr(self, name)
            if not _is_number(value) or value < 0:
                _invalid(name, value, source, "must be a number >= 0")
        if self.sequence_timeout is not None and (not _is_number(self.sequence_timeout) or self.sequence_timeout <= 0):
            _invalid("sequence_timeout", self.sequence_timeout, source, "must be > 0, or unset for no absolute limit")
        if self.sequence and self.sequence_max_idle <= 0:
            # TorchServe accepts this and then expires every sequence at its first poll.
            _invalid(
                "sequence_max_idle", self.sequence_max_idle, source,
                "must be > 0 when sequenceBatching is true (0 would expire every sequence at once)",
            )
        if self.sequence and not (isinstance(self.sequence_end_header, str) and self.sequence_end_header.strip()):
            _invalid("sequence_end_header", self.sequence_end_header, source, "must be a non-empty header name")


# How each BatchConfig field is spelled by the user, and the factor from seconds to the user's unit.
CONFIG_KEYS: dict[str, tuple[str, float]] = {
    "batch_size": ("batchSize", 1),
    "max_batch_delay": ("maxBatchDelay", 1000),
    "job_queue_size": ("jobQueueSize", 1),
    "continuous": ("continuousBatching", 1),
    "sequence": ("sequenceBatching", 1),
    "sequence_max_idle": ("sequenceMaxIdleMSec", 1000),
    "sequence_timeout": ("sequenceTimeoutMSec", 1000),
    "max_num_sequence": ("maxNumSequence", 1),
    "max_sequence_job_queue_size": ("maxSequenceJobQueueSize", 1),
    "sequence_strict_start": ("sequenceStrictStart", 1),
    "tombstone_ttl": ("sequenceTombstoneTtlMSec", 1000),
    "max_tombstones": ("maxSequenceTombstones", 1),
    "sequence_end_header": ("ts_header_key_sequence_end", 1),
}


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _invalid(name: str, value: object, source: str, rule: str) -> None:
    key, factor = CONFIG_KEYS[name]
    shown = value
    if factor != 1 and _is_number(value):
        scaled = value * factor  # type: ignore[operator]
        shown = int(round(scaled)) if abs(scaled - round(scaled)) < 1e-6 else scaled
    raise InvalidConfig(f"invalid {key}: {shown!r} in {source}: {rule}")


@dataclass(slots=True)
class Frame:
    """The per-step plan: what one INFER frame carries. Built by an aggregator, sent by the worker loop."""

    frame_id: int
    new_jobs: list[Job] = field(default_factory=list)  # sent with headers and payload (NEW)
    continuing_jobs: list[Job] = field(default_factory=list)  # already in the backend (CONTINUE, id only)
    cancelled_jobs: list[Job] = field(default_factory=list)  # the backend must free them (CANCEL, id only)
    # Optional wire order over the three lists (sequence aggregators: each sequence's entries together,
    # in arrival order). Empty: NEW entries, then CONTINUE, then CANCEL.
    order: list[Job] = field(default_factory=list)

    def to_wire(self) -> InferRequest:
        if self.order:
            new_ids = {job.request_id for job in self.new_jobs}
            cancel_ids = {job.request_id for job in self.cancelled_jobs}
            ordered = [
                job.to_wire_new() if job.request_id in new_ids
                else job.to_wire_cancel() if job.request_id in cancel_ids
                else job.to_wire_continue()
                for job in self.order
            ]
            return InferRequest(self.frame_id, ordered)
        requests = [job.to_wire_new() for job in self.new_jobs]
        requests += [job.to_wire_continue() for job in self.continuing_jobs]
        requests += [job.to_wire_cancel() for job in self.cancelled_jobs]
        return InferRequest(self.frame_id, requests)

    @property
    def num_requests(self) -> int:
        return len(self.new_jobs) + len(self.continuing_jobs) + len(self.cancelled_jobs)


class JobQueue:
    """A bounded FIFO of jobs. ``put`` raises QueueFull; listeners run on every put (they wake workers)."""

    __slots__ = ("_jobs", "_listeners", "capacity", "model_name")

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
            gone = {id(job) for job in expired}
            self._jobs = deque(job for job in self._jobs if id(job) not in gone)
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
        # Counters for metrics (read by the frontend; only the aggregator writes them).
        self.num_steps = 0  # frames built
        self.last_batch_size = 0  # NEW + CONTINUE entries of the last frame (the active batch size)
        self.num_cancels_sent = 0  # CANCEL entries sent

    def _record_step(self, frame: Frame) -> None:
        self.num_steps += 1
        self.last_batch_size = len(frame.new_jobs) + len(frame.continuing_jobs)
        self.num_cancels_sent += len(frame.cancelled_jobs)

    def stats(self) -> dict[str, int]:
        """Per-worker counters for metrics and describe."""
        return {
            "num_steps": self.num_steps,
            "last_batch_size": self.last_batch_size,
            "num_cancels_sent": self.num_cancels_sent,
            "num_active": self.num_active,
        }

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

    @property
    def num_gathered(self) -> int:
        """Jobs taken from the queue for the next frame and not sent yet."""
        return 0

    @property
    def num_cancels_owed(self) -> int:
        """CANCEL entries the next frame owes the backend."""
        return 0

    def describe_state(self) -> dict[str, int]:
        """The jobs this aggregator holds now (describe's per-worker ``state``): all 0 once idle."""
        return {"num_running": self.num_active, "num_gathered": self.num_gathered,
                "num_cancels_owed": self.num_cancels_owed}
