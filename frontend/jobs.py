"""A Job: one client request on its way through a model's queue, an aggregator and a worker.

The API layers (HTTP, gRPC, OpenAI routes) build Jobs and await their sink; aggregators move them
between states; worker loops hand results to the sink. Aggregators never touch the sink.

State machine (one place: ``Job.transition``)::

    QUEUED ──▶ RUNNING ──▶ DONE
       │          │──────▶ CANCELLED   (client gone / cancel request; a CANCEL was sent if RUNNING)
       │          │──────▶ FAILED      (handler error, worker lost, timeout)
       └──────────┴──────▶ (CANCELLED / FAILED / EXPIRED straight from QUEUED)

States are ordered so that "is finished" is one comparison: ``state >= JobState.DONE``.
"""

from __future__ import annotations

from enum import IntEnum
from typing import Protocol
from collections.abc import Sequence

from backend.protocol import InputParameter, RequestFlags, RequestState, WireRequest, WireResult


class JobState(IntEnum):
    QUEUED = 0  # waiting in a model (or sequence) queue
    RUNNING = 1  # sent to a backend at least once, not finished
    DONE = 2  # the last result (done=True) was delivered
    CANCELLED = 3  # client disconnected or cancelled
    FAILED = 4  # error delivered to the sink
    EXPIRED = 5  # waited past its client timeout before it ran

    @property
    def finished(self) -> bool:
        return self >= JobState.DONE


_ALLOWED: dict[JobState, frozenset[JobState]] = {
    JobState.QUEUED: frozenset({JobState.RUNNING, JobState.CANCELLED, JobState.FAILED, JobState.EXPIRED, JobState.QUEUED}),
    JobState.RUNNING: frozenset({JobState.DONE, JobState.CANCELLED, JobState.FAILED, JobState.QUEUED}),
}


class JobSink(Protocol):
    """Where a job's results go. Implemented by the API layer (unary future, chunk stream)."""

    def deliver(self, result: WireResult) -> None:
        """One result from the backend (``result.done`` says whether more follow)."""

    def fail(self, status: int, message: str) -> None:
        """The job ends with an error that did not come from the handler (timeout, worker lost...)."""


class Job:
    """One request. Hot object: ``__slots__`` and no properties with side effects."""

    __slots__ = (
        "cancel_requested",
        "created_at",
        "deadline",
        "first_result_at",
        "flags",
        "headers",
        "model_name",
        "model_version",
        "num_results",
        "parameters",
        "request_id",
        "sent_at",
        "sequence_id",
        "sink",
        "state",
        "worker_id",
    )

    def __init__(
        self,
        request_id: str,
        model_name: str,
        model_version: str = "",
        headers: Sequence[tuple[str, str]] = (),
        parameters: Sequence[InputParameter] = (),
        sequence_id: str = "",
        flags: RequestFlags = RequestFlags.NONE,
        sink: JobSink | None = None,
        created_at: float = 0.0,
        deadline: float | None = None,
    ) -> None:
        self.request_id = request_id
        self.model_name = model_name
        self.model_version = model_version
        self.headers = headers
        self.parameters = parameters
        self.sequence_id = sequence_id  # "" when the model does not use sequences
        self.flags = flags
        self.sink = sink
        self.state = JobState.QUEUED
        # Set by the API layer when the client went away or asked to cancel. The aggregator acts on
        # it at the next step: drops a queued job, or sends one CANCEL for a running one.
        self.cancel_requested = False
        self.created_at = created_at  # clock() when accepted
        self.deadline = deadline  # clock() after which a still-queued job expires (client timeout)
        self.sent_at: float | None = None  # first time it went to a backend
        self.first_result_at: float | None = None
        self.num_results = 0
        self.worker_id: str | None = None  # the worker running it (set when it is sent)

    def transition(self, new: JobState) -> None:
        """The only place a job's state changes. RUNNING→QUEUED is a requeue after a worker loss."""
        if new not in _ALLOWED.get(self.state, frozenset()):
            raise RuntimeError(f"job {self.request_id}: illegal transition {self.state.name} → {new.name}")
        self.state = new

    # Wire views of this job for one step --------------------------------------------------------

    def to_wire_new(self) -> WireRequest:
        return WireRequest(self.request_id, RequestState.NEW, self.sequence_id, self.flags, self.headers, self.parameters)

    def to_wire_continue(self) -> WireRequest:
        return WireRequest(self.request_id, RequestState.CONTINUE, self.sequence_id, self.flags)

    def to_wire_cancel(self) -> WireRequest:
        return WireRequest(self.request_id, RequestState.CANCEL, self.sequence_id, self.flags)

    def __repr__(self) -> str:
        seq = f" seq={self.sequence_id}" if self.sequence_id else ""
        return f"<Job {self.request_id} {self.model_name} {self.state.name}{seq}>"
