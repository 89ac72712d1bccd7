"""ModelBatcher: one per model version. Owns the job queue and one aggregator per worker.

The API layer calls ``submit`` (raises QueueFull & co. synchronously, so the client gets its 503 at
once) and ``cancel``; the worker layer calls ``add_worker`` / ``remove_worker`` / ``worker_lost``
and drives each aggregator. Listeners (``add_listener``) run whenever some worker may have new
work: the frontend wires them to wake its idle worker loops.
"""

from __future__ import annotations

from typing import Callable

from frontend.batching.base import Aggregator, BatchConfig, Clock, JobQueue
from frontend.batching.dynamic_batching import DynamicBatching
from frontend.jobs import Job, JobState


class ModelBatcher:
    def __init__(self, model_name: str, config: BatchConfig, clock: Clock) -> None:
        self.model_name = model_name
        self.config = config
        self.clock = clock
        self.queue = JobQueue(config.job_queue_size, model_name)
        self.aggregators: dict[str, Aggregator] = {}
        self._listeners: list[Callable[[], None]] = []
        self.queue.add_listener(self._notify)

    def add_listener(self, callback: Callable[[], None]) -> None:
        self._listeners.append(callback)

    def _notify(self) -> None:
        for callback in self._listeners:
            callback()

    # Requests ------------------------------------------------------------------------------------

    def submit(self, job: Job) -> None:
        """Queue a job; raises QueueFull (503) when the model's queue is at capacity."""
        self.queue.put(job)

    def cancel(self, job: Job) -> None:
        """The client is gone or asked to stop; acted on at the next step of the owning aggregator."""
        if not job.state.finished:
            job.cancel_requested = True
            self._notify()

    @property
    def queue_depth(self) -> int:
        return len(self.queue)

    # Workers -------------------------------------------------------------------------------------

    def add_worker(self, worker_id: str) -> Aggregator:
        aggregator = self._make_aggregator(worker_id)
        self.aggregators[worker_id] = aggregator
        return aggregator

    def _make_aggregator(self, worker_id: str) -> Aggregator:
        return DynamicBatching(worker_id, self.config, self.clock, self.queue)

    def remove_worker(self, worker_id: str) -> None:
        """Scale-down after the worker's in-flight work drained: unsent jobs go back to the queue."""
        aggregator = self.aggregators.pop(worker_id, None)
        if aggregator is not None:
            self._requeue(aggregator.close())

    def worker_lost(self, worker_id: str) -> list[Job]:
        """The worker died: returns its in-flight jobs (the caller fails them); unsent jobs requeue."""
        aggregator = self.aggregators.pop(worker_id, None)
        if aggregator is None:
            return []
        lost = aggregator.on_worker_lost()
        self._requeue(aggregator.close())
        return lost

    def _requeue(self, jobs: list[Job]) -> None:
        for job in reversed(jobs):
            if job.state != JobState.QUEUED:
                job.transition(JobState.QUEUED)
            self.queue.put_front(job)
        if jobs:
            self._notify()
