"""The sequence table: every sequence of one model, one state machine each, shared by its workers.

A *sequence* (a stateful session: a dialogue, an audio stream, an LSTM's hidden state) is a series
of jobs carrying the same sequence id. Its state lives in ONE backend worker, so the table pins it
to a worker and hands that worker its jobs one at a time, in arrival order. State machine (one
place: ``Sequence.transition``)::

    OPEN ──END-flagged job accepted──▶ ENDING ──that job left the backend──▶ CLOSED
     │  ◀──the END job was cancelled before it was sent──┘                    ▲
     │──────────────handler result header ``ts_request_sequence_end``─────────┤ (from OPEN or ENDING)
     │──────────────idle > sequenceMaxIdleMSec, or open > sequenceTimeoutMSec──▶ EXPIRED
     └──────────────its worker died or was stopped──────────────────────────▶ LOST

States are ordered so that "is finished" is one comparison (``state >= CLOSED``). A finished
sequence leaves the table at once (its capacity is free) and its id becomes a *tombstone*: every
later request with that id — with or without the start flag — is rejected with SequenceClosed /
SequenceExpired / SequenceWorkerLost (410), saying which, until the tombstone expires
(``tombstone_ttl``; at most ``max_tombstones`` are kept, oldest dropped first).

Rules for a submitted job (``submit`` raises synchronously, so the client gets its error at once):

* unknown id → opens a sequence (client-chosen ids), unless ``sequence_strict_start`` and the job
  has no SEQUENCE_START flag → SequenceUnknown (404); at ``max_num_sequence`` open → SequenceLimit (503);
* id of an OPEN sequence with SEQUENCE_START again → SequenceAlreadyOpen (409). Decision: a repeated
  START is ambiguous (reset the live state under queued jobs? a retried first request?), so it is
  refused rather than guessed; the client ends the sequence or uses a new id. (Triton instead
  aborts the old sequence and starts a new one in its slot.)
* id of an ENDING sequence → SequenceClosed: the client already sent its last request;
* more than ``max_sequence_job_queue_size`` jobs waiting in that sequence → SequenceLimit (503);
* more than ``job_queue_size`` jobs waiting in the whole model → QueueFull (503).

Pinning decision: a new sequence is pinned *at submit* to the live worker with the fewest open
sequences (ties: the earliest registered). Sequence state costs worker memory for the sequence's
whole life, so balancing open sequences balances memory; and pinning early makes affinity visible
and testable. A sequence opened while the model has no worker stays unpinned and is claimed by the
first worker that has room in a step. After pinning, affinity is absolute.

Idle time is counted only while the sequence has no job waiting or in the backend: a long stream
or a queue behind a busy worker is not idleness. The absolute timeout counts from the first request.

This module is pure: config, an injected clock, and a ``notify`` callback (wakes worker loops when
failures are waiting to be collected by ``take_failures``).
"""

from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict, deque
from dataclasses import dataclass
from enum import IntEnum
from collections.abc import Callable, Iterable, Sequence as Seq

from backend.protocol import RequestFlags
from frontend.batching.base import BatchConfig, Clock
from frontend.errors import (  # SequenceAlreadyOpen is re-exported: it used to live here
    ConveyorError, QueueFull, SequenceAlreadyOpen, SequenceClosed, SequenceError, SequenceExpired, SequenceLimit,
    SequenceUnknown, SequenceWorkerLost,
)
from frontend.jobs import Job, JobState

Failure = tuple[Job, ConveyorError]
__all__ = ["Failure", "Sequence", "SequenceAlreadyOpen", "SequenceState", "SequenceTable", "Tombstone"]


class SequenceState(IntEnum):
    OPEN = 0  # accepting jobs
    ENDING = 1  # a job with the end flag was accepted: no more jobs; closes when that job leaves
    CLOSED = 2  # ended by the client (end flag) or by the handler (end header)
    EXPIRED = 3  # idle or absolute timeout
    LOST = 4  # its worker died or was stopped: the state it held is gone

    @property
    def finished(self) -> bool:
        return self >= SequenceState.CLOSED


_ALLOWED: dict[SequenceState, frozenset[SequenceState]] = {
    SequenceState.OPEN: frozenset({SequenceState.ENDING, SequenceState.CLOSED, SequenceState.EXPIRED, SequenceState.LOST}),
    SequenceState.ENDING: frozenset({SequenceState.OPEN, SequenceState.CLOSED, SequenceState.EXPIRED, SequenceState.LOST}),
}


class Sequence:
    """One live sequence. Only the table mutates it."""

    __slots__ = (
        "end_job",
        "in_flight",
        "last_active_at",
        "opened_at",
        "reason",
        "sequence_id",
        "stamp",
        "state",
        "waiting",
        "worker_id",
    )

    def __init__(self, sequence_id: str, now: float) -> None:
        self.sequence_id = sequence_id
        self.state = SequenceState.OPEN
        self.worker_id: str | None = None  # pinned worker; None until pinned
        self.waiting: deque[Job] = deque()  # accepted, not sent; arrival order
        self.in_flight: list[Job] = []  # sent, not left; arrival order
        self.opened_at = now
        self.last_active_at = now  # last time a job arrived or left
        self.end_job: Job | None = None  # the accepted job with the end flag (state ENDING)
        self.reason = ""  # why it finished, for error messages
        self.stamp = 0  # bumped whenever its deadline may change; stale heap entries are skipped

    def transition(self, new: SequenceState, reason: str = "") -> None:
        """The only place a sequence's state changes."""
        if new not in _ALLOWED.get(self.state, frozenset()):
            raise RuntimeError(f"sequence {self.sequence_id}: illegal transition {self.state.name} → {new.name}")
        self.state = new
        if reason:
            self.reason = reason

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.in_flight

    def __repr__(self) -> str:
        return (
            f"<Sequence {self.sequence_id} {self.state.name} worker={self.worker_id} "
            f"waiting={len(self.waiting)} in_flight={len(self.in_flight)}>"
        )


@dataclass(frozen=True, slots=True)
class Tombstone:
    state: SequenceState  # CLOSED, EXPIRED or LOST
    at: float  # clock time it finished
    reason: str


class SequenceTable:
    def __init__(self, model_name: str, config: BatchConfig, clock: Clock, notify: Callable[[], None] = lambda: None) -> None:
        self.model_name = model_name
        self.config = config
        self.clock = clock
        self._notify = notify
        self._open: dict[str, Sequence] = {}  # OPEN and ENDING sequences
        # Open sequences by pinned worker, in pinning order; key None holds the unpinned ones.
        self._by_worker: dict[str | None, dict[str, Sequence]] = {None: {}}
        # Sequences with waiting jobs, by pinned worker (None: unpinned). Insertion order is the
        # service order: a sequence served in a step goes to the back if it still has jobs waiting.
        self._ready: dict[str | None, dict[str, Sequence]] = {None: {}}
        self._tombstones: OrderedDict[str, Tombstone] = OrderedDict()  # oldest first
        self._deadlines: list[tuple[float, int, int, str, str]] = []  # (at, tie, stamp, id, kind)
        self._tie = itertools.count()
        self._failures: list[Failure] = []
        self._end_header = config.sequence_end_header.lower()
        self.num_waiting = 0
        # Counters for metrics.
        self.num_opened = 0
        self.num_closed = 0
        self.num_expired = 0
        self.num_lost = 0

    # Workers -----------------------------------------------------------------------------------------

    def add_worker(self, worker_id: str) -> None:
        self._by_worker.setdefault(worker_id, {})
        self._ready.setdefault(worker_id, {})

    def worker_lost(self, worker_id: str) -> None:
        """The worker died: its sequences become LOST and their waiting jobs fail (via
        ``take_failures``). Their in-flight jobs are NOT failed here: the aggregator returns them
        from ``on_worker_lost`` and the caller fails them with the worker's own cause."""
        self._drop_worker(worker_id, f"its worker '{worker_id}' died", fail_in_flight=False)

    def remove_worker(self, worker_id: str) -> None:
        """Scale-down: the worker's state goes with its process, so its sequences become LOST."""
        self._drop_worker(worker_id, f"its worker '{worker_id}' was stopped", fail_in_flight=True)

    def _drop_worker(self, worker_id: str, reason: str, fail_in_flight: bool) -> None:
        now = self.clock()
        for seq in list(self._by_worker.get(worker_id, {}).values()):
            self._finish(seq, SequenceState.LOST, reason, now, fail_in_flight)
        self._by_worker.pop(worker_id, None)
        self._ready.pop(worker_id, None)

    # Requests ----------------------------------------------------------------------------------------

    def submit(self, job: Job) -> None:
        """Accept a job into its sequence, or raise the Sequence* / QueueFull error that says why not."""
        now = self.clock()
        self.expire(now)
        sid = job.sequence_id
        model = self.model_name
        if not sid:
            raise SequenceError(f"model '{model}' uses sequence batching but request '{job.request_id}' carries no sequence id")
        start = bool(job.flags & RequestFlags.SEQUENCE_START)
        seq = self._open.get(sid)
        if seq is None:
            tomb = self._tombstone(sid, now)
            if tomb is not None:
                raise self._tombstone_error(sid, tomb)
            if self.config.sequence_strict_start and not start:
                raise SequenceUnknown(
                    f"sequence '{sid}' of model '{model}' is unknown and the request does not carry the start "
                    f"flag (sequenceStrictStart): send the start header to open a new sequence"
                )
            if len(self._open) >= self.config.max_num_sequence:
                raise SequenceLimit(
                    f"model '{model}' is at its limit of open sequences (maxNumSequence={self.config.max_num_sequence}): "
                    f"sequence '{sid}' cannot open now; retry later or end a sequence"
                )
            self._check_model_queue()
            seq = Sequence(sid, now)
            self._open[sid] = seq
            worker_id = self._least_loaded_worker()
            seq.worker_id = worker_id
            self._by_worker[worker_id][sid] = seq
            self.num_opened += 1
        else:
            if start:
                raise SequenceAlreadyOpen(
                    f"sequence '{sid}' of model '{model}' is already open: a request with the start flag must "
                    f"name a new sequence id (end the open sequence first)"
                )
            if seq.state == SequenceState.ENDING:
                raise SequenceClosed(
                    f"sequence '{sid}' of model '{model}' is ending: it already received a request with the "
                    f"end flag; start a new sequence"
                )
            if len(seq.waiting) >= self.config.max_sequence_job_queue_size:
                raise SequenceLimit(
                    f"the queue of sequence '{sid}' of model '{model}' is full (maxSequenceJobQueueSize="
                    f"{self.config.max_sequence_job_queue_size}); retry when its running request completes"
                )
            self._check_model_queue()
        seq.waiting.append(job)
        self.num_waiting += 1
        seq.last_active_at = now
        if job.flags & RequestFlags.SEQUENCE_END:
            seq.transition(SequenceState.ENDING)
            seq.end_job = job
        self._ready[seq.worker_id].setdefault(sid, seq)
        self._reschedule(seq)
        self._notify()

    def _check_model_queue(self) -> None:
        if self.num_waiting >= self.config.job_queue_size:
            raise QueueFull(f"model '{self.model_name}' job queue is full ({self.config.job_queue_size} jobs)")

    def _least_loaded_worker(self) -> str | None:
        best: str | None = None
        best_count = 0
        for worker_id, pinned in self._by_worker.items():
            if worker_id is not None and (best is None or len(pinned) < best_count):
                best, best_count = worker_id, len(pinned)
        return best

    def withdraw(self, job: Job) -> None:
        """A waiting job was cancelled by its client: it leaves without reaching the backend and
        has no effect on its sequence (a withdrawn end request does not end it)."""
        seq = self._open.get(job.sequence_id)
        if seq is None or job not in seq.waiting:
            return
        self._remove_waiting(seq, job, self.clock())
        job.transition(JobState.CANCELLED)

    def _remove_waiting(self, seq: Sequence, job: Job, now: float) -> None:
        seq.waiting.remove(job)
        self.num_waiting -= 1
        if seq.end_job is job:
            seq.end_job = None
            seq.transition(SequenceState.OPEN)
        if not seq.waiting:
            self._ready[seq.worker_id].pop(seq.sequence_id, None)
            if seq.idle:
                seq.last_active_at = now
        self._reschedule(seq)

    def remove_expired_jobs(self, now: float) -> list[Job]:
        """Waiting jobs whose client deadline passed (taken out; the caller answers them)."""
        expired = []
        for ready in self._ready.values():
            for seq in list(ready.values()):
                for job in [j for j in seq.waiting if j.deadline is not None and j.deadline <= now]:
                    self._remove_waiting(seq, job, now)
                    expired.append(job)
        return expired

    # Dispatch (called by the sequence aggregators) ----------------------------------------------------

    def ready(self, worker_id: str) -> list[Sequence]:
        """Sequences with waiting jobs this worker may serve: its own, then unpinned ones it may claim."""
        return list(self._ready.get(worker_id, {}).values()) + list(self._ready[None].values())

    def take_job(self, seq: Sequence, worker_id: str) -> Job:
        """The next job of ``seq`` goes to ``worker_id`` (pinning the sequence there if unpinned).
        The job stays QUEUED; the aggregator makes it RUNNING when it puts it in a frame."""
        if seq.worker_id is None:
            del self._by_worker[None][seq.sequence_id]
            self._ready[None].pop(seq.sequence_id, None)
            seq.worker_id = worker_id
            self._by_worker[worker_id][seq.sequence_id] = seq
        elif seq.worker_id != worker_id:
            raise RuntimeError(f"sequence {seq.sequence_id} is pinned to {seq.worker_id}, not {worker_id}")
        job = seq.waiting.popleft()
        self.num_waiting -= 1
        seq.in_flight.append(job)
        ready = self._ready[worker_id]
        ready.pop(seq.sequence_id, None)
        if seq.waiting:
            ready[seq.sequence_id] = seq  # to the back: sequences take turns
        self._reschedule(seq)
        return job

    def job_left(self, job: Job, now: float) -> None:
        """A job of a sequence left the backend (done, failed or cancelled). If it carried the end
        flag, the sequence closes now; otherwise its idle clock may start."""
        seq = self._open.get(job.sequence_id)
        if seq is None or job not in seq.in_flight:
            return  # the sequence finished meanwhile
        seq.in_flight.remove(job)
        seq.last_active_at = now
        if seq.end_job is job:
            self._finish(seq, SequenceState.CLOSED, "ended by the client's end flag", now, fail_in_flight=True)
        else:
            self._reschedule(seq)

    def end_ids(self, headers: Iterable[tuple[str, str]]) -> list[str]:
        """Sequence ids named by a result's end header (``<id>[;<id>...]``, name case-insensitive)."""
        ids: list[str] = []
        for name, value in headers:
            if name.lower() == self._end_header:
                ids.extend(part.strip() for part in value.split(";") if part.strip())
        return ids

    def close_by_handler(self, sequence_ids: Seq[str], worker_id: str, now: float) -> None:
        """The handler ended these sequences: closed at once, capacity freed, their waiting and
        still-running jobs failed. Only sequences pinned to the handler's own worker can be ended."""
        for sid in sequence_ids:
            seq = self._open.get(sid)
            if seq is not None and seq.worker_id == worker_id:
                self._finish(seq, SequenceState.CLOSED, "ended by the handler", now, fail_in_flight=True)

    # Timeouts ----------------------------------------------------------------------------------------

    def expire(self, now: float) -> None:
        """Expire sequences whose idle or absolute deadline has passed; drop old tombstones."""
        ttl = self.config.tombstone_ttl
        tombs = self._tombstones
        while tombs:
            sid, tomb = next(iter(tombs.items()))
            if tomb.at + ttl > now:
                break
            del tombs[sid]
        heap = self._deadlines
        while heap and heap[0][0] <= now:
            _at, _tie, stamp, sid, kind = heapq.heappop(heap)
            seq = self._open.get(sid)
            if seq is None or seq.stamp != stamp:
                continue  # stale entry: the sequence finished or its deadline moved
            if kind == "idle":
                reason = f"idle longer than sequenceMaxIdleMSec={_ms(self.config.sequence_max_idle)}"
            else:
                reason = f"open longer than sequenceTimeoutMSec={_ms(self.config.sequence_timeout or 0.0)}"
            self._finish(seq, SequenceState.EXPIRED, reason, now, fail_in_flight=True)

    def next_deadline(self) -> float | None:
        """The earliest clock time at which some sequence may expire (worker loops wake for it)."""
        heap = self._deadlines
        while heap:
            _at, _tie, stamp, sid, _kind = heap[0]
            seq = self._open.get(sid)
            if seq is not None and seq.stamp == stamp:
                return heap[0][0]
            heapq.heappop(heap)
        return None

    def _reschedule(self, seq: Sequence) -> None:
        seq.stamp += 1
        best: tuple[float, str] | None = None
        if self.config.sequence_timeout is not None:
            best = (seq.opened_at + self.config.sequence_timeout, "timeout")
        if seq.idle and self.config.sequence_max_idle > 0:
            at = seq.last_active_at + self.config.sequence_max_idle
            if best is None or at < best[0]:
                best = (at, "idle")
        if best is not None:
            heapq.heappush(self._deadlines, (best[0], next(self._tie), seq.stamp, seq.sequence_id, best[1]))
        if len(self._deadlines) > 64 + 4 * len(self._open):  # stale entries pile up: rebuild
            self._deadlines = [entry for entry in self._deadlines if self._is_current(entry)]
            heapq.heapify(self._deadlines)

    def _is_current(self, entry: tuple[float, int, int, str, str]) -> bool:
        seq = self._open.get(entry[3])
        return seq is not None and seq.stamp == entry[2]

    # Ending ------------------------------------------------------------------------------------------

    def _finish(self, seq: Sequence, state: SequenceState, reason: str, now: float, fail_in_flight: bool) -> None:
        seq.transition(state, reason)
        seq.stamp += 1
        sid = seq.sequence_id
        error = self._tombstone_error(sid, Tombstone(state, now, reason))
        for job in seq.waiting:
            job.transition(JobState.FAILED)
            self._failures.append((job, error))
        self.num_waiting -= len(seq.waiting)
        seq.waiting.clear()
        if fail_in_flight:
            # Still in a backend: failed now; the aggregator drops them (CANCEL in continuous mode).
            for job in seq.in_flight:
                if not job.state.finished:
                    job.transition(JobState.FAILED)
                    self._failures.append((job, error))
        seq.in_flight.clear()
        del self._open[sid]
        self._by_worker.get(seq.worker_id, {}).pop(sid, None)
        self._ready.get(seq.worker_id, {}).pop(sid, None)
        if self.config.max_tombstones > 0:
            self._tombstones[sid] = Tombstone(state, now, reason)
            self._tombstones.move_to_end(sid)
            while len(self._tombstones) > self.config.max_tombstones:
                self._tombstones.popitem(last=False)
        if state == SequenceState.CLOSED:
            self.num_closed += 1
        elif state == SequenceState.EXPIRED:
            self.num_expired += 1
        else:
            self.num_lost += 1
        if self._failures:
            self._notify()

    def _tombstone(self, sid: str, now: float) -> Tombstone | None:
        tomb = self._tombstones.get(sid)
        if tomb is not None and tomb.at + self.config.tombstone_ttl <= now:
            del self._tombstones[sid]
            return None
        return tomb

    def _tombstone_error(self, sid: str, tomb: Tombstone) -> ConveyorError:
        model = self.model_name
        if tomb.state == SequenceState.CLOSED:
            return SequenceClosed(
                f"sequence '{sid}' of model '{model}' was closed ({tomb.reason}); a closed sequence id cannot be "
                f"reused: start a new sequence"
            )
        if tomb.state == SequenceState.EXPIRED:
            return SequenceExpired(f"sequence '{sid}' of model '{model}' expired: {tomb.reason}; start a new sequence")
        return SequenceWorkerLost(
            f"sequence '{sid}' of model '{model}' was lost: {tomb.reason} and its state with it; start a new sequence"
        )

    def take_failures(self) -> list[Failure]:
        """Jobs failed by the table since the last call, each with its error. They are already in
        state FAILED; the caller only tells their sinks."""
        out, self._failures = self._failures, []
        return out

    # Introspection -----------------------------------------------------------------------------------

    def state_of(self, sequence_id: str) -> SequenceState | None:
        seq = self._open.get(sequence_id)
        if seq is not None:
            return seq.state
        tomb = self._tombstones.get(sequence_id)
        return tomb.state if tomb is not None else None

    def get(self, sequence_id: str) -> Sequence | None:
        return self._open.get(sequence_id)

    @property
    def num_open(self) -> int:
        return len(self._open)

    def describe_worker(self, worker_id: str, max_ids: int = 100) -> dict:
        """The open sequences pinned to one worker, for its entry in describe: their number and
        (the first ``max_ids`` of) their ids, in pinning order."""
        pinned = self._by_worker.get(worker_id, {})
        return {"num_open": len(pinned), "ids": list(itertools.islice(pinned, max_ids))}

    def describe(self) -> dict:
        """For management (describe) and metrics."""
        return {
            "num_open": len(self._open),
            "open_by_worker": {w: len(s) for w, s in self._by_worker.items() if w is not None},
            "num_unpinned": len(self._by_worker[None]),
            "num_waiting": self.num_waiting,
            "num_tombstones": len(self._tombstones),
            "num_opened": self.num_opened,
            "num_closed": self.num_closed,
            "num_expired": self.num_expired,
            "num_lost": self.num_lost,
        }


    def describe_state(self) -> dict[str, int]:
        """What the table holds now, for describe's ``state``. After a load ends and every sequence
        ended, all 0 but the bounded ones: ``num_tombstones`` (``max_tombstones``, TTL) and
        ``num_deadline_entries`` (stale heap entries: at most 64 + 4 × open, popped as they surface)."""
        return {
            "num_sequences_open": len(self._open),
            "num_sequence_jobs_waiting": self.num_waiting,
            "num_sequence_jobs_in_flight": sum(len(seq.in_flight) for seq in self._open.values()),
            "num_ready_sequences": sum(len(ready) for ready in self._ready.values()),
            "num_failures_unreported": len(self._failures),
            "num_tombstones": len(self._tombstones),
            "num_deadline_entries": len(self._deadlines),
        }


def _ms(seconds: float) -> int | float:
    ms = seconds * 1000
    return int(round(ms)) if abs(ms - round(ms)) < 1e-6 else ms
