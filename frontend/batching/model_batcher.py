"""ModelBatcher: one per model version. Owns the job queue (or the sequence table) and one
aggregator per worker; picks the policy from ``BatchConfig`` (dynamic, continuous, sequence,
sequence + continuous).

Who calls what, and when:

* API layer: ``submit(job)`` — raises QueueFull, SequenceLimit (503, ``retry_after``),
  SequenceClosed / SequenceExpired / SequenceWorkerLost (410), SequenceUnknown (404),
  SequenceAlreadyOpen (409) or SequenceError (400) synchronously, so the client gets its error at
  once. ``cancel(job)`` when the client disconnects or cancels.
* Worker layer: ``add_worker`` / ``remove_worker`` (scale-down, after the worker drained) /
  ``worker_lost`` (returns the in-flight jobs to fail with the worker's cause), and drives each
  aggregator. Every worker-loop iteration starts with ``tick()`` and fails what it returns.
* Listeners (``add_listener``) run whenever some worker may have work: a new job, a cancel, a job
  requeued, or failures waiting for ``tick()``. Wire them to wake the model's idle worker loops.
"""

from __future__ import annotations

from collections.abc import Callable

from frontend.batching.base import Aggregator, BatchConfig, Clock, JobQueue
from frontend.batching.continuous_batching import ContinuousBatching
from frontend.batching.dynamic_batching import DynamicBatching
from frontend.batching.sequence_batching import SequenceBatching
from frontend.batching.sequence_continuous_batching import SequenceContinuousBatching
from frontend.batching.sequence_table import Failure, SequenceTable
from frontend.errors import RequestTimeout
from frontend.jobs import Job, JobState

# Client deadlines of queued jobs are checked by tick() at most this often (clock seconds): each
# check scans the queues, and tick() runs once per worker-loop iteration.
JOB_DEADLINE_SCAN_INTERVAL = 0.01


class ModelBatcher:
    def __init__(self, model_name: str, config: BatchConfig, clock: Clock, source: str = "model configuration") -> None:
        """``source`` names where ``config`` came from, for InvalidConfig messages (raised here)."""
        config.validate(source)
        self.model_name = model_name
        self.config = config
        self.clock = clock
        self.queue = JobQueue(config.job_queue_size, model_name)  # unused by sequence policies
        self.aggregators: dict[str, Aggregator] = {}
        self._listeners: list[Callable[[], None]] = []
        self.queue.add_listener(self._notify)
        # Sequence policies keep their jobs in the table, per sequence, instead of the queue.
        self.sequences: SequenceTable | None = (
            SequenceTable(model_name, config, clock, self._notify) if config.sequence else None
        )
        self._next_deadline_scan = float("-inf")

    def add_listener(self, callback: Callable[[], None]) -> None:
        self._listeners.append(callback)

    def _notify(self) -> None:
        for callback in self._listeners:
            callback()

    @property
    def policy(self) -> str:
        return self.config.policy

    # Requests ------------------------------------------------------------------------------------

    def submit(self, job: Job) -> None:
        """Queue a job, or raise the error the client gets (see the module docstring)."""
        if self.sequences is not None:
            self.sequences.submit(job)
        else:
            self.queue.put(job)

    def cancel(self, job: Job) -> None:
        """The client is gone or asked to stop; acted on at the next step of the owning aggregator
        (a queued sequence job leaves its sequence at once, without effect on the sequence)."""
        if job.state.finished:
            return
        job.cancel_requested = True
        if self.sequences is not None and job.state == JobState.QUEUED:
            self.sequences.withdraw(job)
        self._notify()

    @property
    def queue_depth(self) -> int:
        """Jobs accepted and not yet sent (model queue, plus every sequence's waiting jobs)."""
        return len(self.queue) + (self.sequences.num_waiting if self.sequences is not None else 0)

    # Time ----------------------------------------------------------------------------------------

    def tick(self) -> list[Failure]:
        """Enforce time and collect failures. Call at the start of every worker-loop iteration
        (and from a model-level timer at ``next_deadline()`` if the model may have no worker).
        Returns ``(job, error)`` pairs: jobs already moved to FAILED / EXPIRED that the caller only
        reports (``job.sink.fail(error.status, error.message)``, or the error's JSON). They are:
        sequences that expired (idle / absolute: SequenceExpired), were closed by a handler header
        or an end flag (queued jobs behind it: SequenceClosed), or whose worker died or was stopped
        (their waiting jobs: SequenceWorkerLost); and queued jobs past their client deadline
        (``job.deadline``: RequestTimeout 408)."""
        now = self.clock()
        out: list[Failure] = []
        if now >= self._next_deadline_scan:
            self._next_deadline_scan = now + JOB_DEADLINE_SCAN_INTERVAL
            expired = self.queue.remove_expired(now)
            if self.sequences is not None:
                expired += self.sequences.remove_expired_jobs(now)
            for job in expired:
                job.transition(JobState.EXPIRED)
                out.append((job, RequestTimeout(
                    f"request '{job.request_id}' of model '{self.model_name}' waited in the queue past its client timeout"
                )))
        if self.sequences is not None:
            self.sequences.expire(now)
            out += self.sequences.take_failures()
        return out

    def next_deadline(self) -> float | None:
        """Earliest clock time at which ``tick()`` has a sequence to expire (None: none)."""
        return self.sequences.next_deadline() if self.sequences is not None else None

    # Workers -------------------------------------------------------------------------------------

    def add_worker(self, worker_id: str) -> Aggregator:
        if self.sequences is not None:
            self.sequences.add_worker(worker_id)
        aggregator = self._make_aggregator(worker_id)
        self.aggregators[worker_id] = aggregator
        return aggregator

    def _make_aggregator(self, worker_id: str) -> Aggregator:
        config, clock = self.config, self.clock
        if self.sequences is not None:
            cls = SequenceContinuousBatching if config.continuous else SequenceBatching
            return cls(worker_id, config, clock, self.sequences)
        if config.continuous:
            return ContinuousBatching(worker_id, config, clock, self.queue)
        return DynamicBatching(worker_id, config, clock, self.queue)

    def remove_worker(self, worker_id: str) -> None:
        """Scale-down after the worker's in-flight work drained: unsent jobs go back to the queue.
        Sequence policies: the worker's open sequences end as LOST (their state goes with the
        process); their waiting jobs come out of the next ``tick()`` with SequenceWorkerLost."""
        aggregator = self.aggregators.pop(worker_id, None)
        if aggregator is not None:
            self._requeue(aggregator.close())
        if self.sequences is not None:
            self.sequences.remove_worker(worker_id)

    def worker_lost(self, worker_id: str) -> list[Job]:
        """The worker died: returns its in-flight jobs (the caller fails them with the worker's
        cause); unsent jobs requeue. Sequence policies: that worker's sequences (only) become LOST
        tombstones; their waiting jobs come out of the next ``tick()`` with SequenceWorkerLost."""
        aggregator = self.aggregators.pop(worker_id, None)
        lost: list[Job] = []
        if aggregator is not None:
            lost = aggregator.on_worker_lost()
            self._requeue(aggregator.close())
        if self.sequences is not None:
            self.sequences.worker_lost(worker_id)
        return lost

    def _requeue(self, jobs: list[Job]) -> None:
        for job in reversed(jobs):
            if job.state != JobState.QUEUED:
                job.transition(JobState.QUEUED)
            self.queue.put_front(job)
        if jobs:
            self._notify()

    # Introspection (management describe, metrics) ------------------------------------------------

    def describe_sequences(self) -> dict | None:
        """Open sequences per worker and lifetime counts (opened / closed / expired / lost); None
        when the model does not use sequence batching."""
        return self.sequences.describe() if self.sequences is not None else None

    def describe_state(self) -> dict[str, int]:
        """What the batcher holds now (describe's ``state``): queued jobs, and for sequence policies
        the table's (``SequenceTable.describe_state``). Per worker: ``Aggregator.describe_state``."""
        state = {"num_queued": len(self.queue)}
        if self.sequences is not None:
            state.update(self.sequences.describe_state())
        return state

    def stats(self) -> dict[str, dict[str, int]]:
        """Per-worker step counters: num_steps, last_batch_size (active batch size), num_cancels_sent, num_active."""
        return {worker_id: aggregator.stats() for worker_id, aggregator in self.aggregators.items()}
