"""Continuous (iteration-level) batching: the frame holds every unfinished job plus new jobs, up to
``batch_size`` jobs in total.

Jobs already in the backend travel as CONTINUE (id only); new ones as NEW with their payload;
cancelled ones as one CANCEL each. Exactly one reply is expected per frame; each result carries
``done``. The step rules (leaving, waiting, counting) live in ``step.StepAggregator``; this class
only says who may join: the oldest jobs of the model's queue, as many as free slots allow.

Decisions:

* **Idle wait.** While anything runs (or a CANCEL is owed) new jobs join at the very next step,
  never delayed. Only an idle worker waits, at most ``max_batch_delay`` after its first job, for the
  batch to fill. Rationale: a running batch already pays the step cost, so joining it is free and
  waiting would only add latency; an idle worker's first step is a full prefill, so a short wait can
  turn N prefills into one. Set ``maxBatchDelay: 0`` for no wait at all.
* **Fairness.** Admission is FIFO from the shared queue, and a slot freed by any job (done,
  cancelled, failed) is refilled at the next step from the queue head: a long stream holds one slot
  but never blocks queued jobs from the others.
"""

from __future__ import annotations

from frontend.batching.base import BatchConfig, Clock, JobQueue
from frontend.batching.step import StepAggregator
from frontend.jobs import Job, JobState


class ContinuousBatching(StepAggregator):
    continuous = True

    def __init__(self, worker_id: str, config: BatchConfig, clock: Clock, queue: JobQueue) -> None:
        super().__init__(worker_id, config, clock)
        self.queue = queue
        self._gathered: list[Job] = []  # taken from the queue, not sent yet (idle worker gathering)

    def _gather(self, now: float) -> int:
        kept = []
        for job in self._gathered:
            if job.cancel_requested:
                job.transition(JobState.CANCELLED)  # never reached the backend: no CANCEL needed
            else:
                kept.append(job)
        room = self.config.batch_size - len(self._running) - len(kept)
        while room > 0:
            queued = self.queue.pop()  # FIFO; drops jobs cancelled while queued
            if queued is None:
                break
            kept.append(queued)
            room -= 1
        self._gathered = kept
        return len(kept)

    def _admit(self, now: float) -> list[Job]:
        jobs, self._gathered = self._gathered, []
        return jobs

    @property
    def num_gathered(self) -> int:
        return len(self._gathered)

    def _take_unsent(self) -> list[Job]:
        jobs, self._gathered = self._gathered, []
        return jobs

    def _return_unsent(self) -> None:
        for job in reversed(self._take_unsent()):
            self.queue.put_front(job)
