"""Dynamic batching (the default policy): up to ``batch_size`` new jobs per frame, waiting at most
``max_batch_delay`` after the first one. A frame's jobs stay until the backend's final reply; a
handler may stream several replies for one frame (``send_intermediate_predict_response``).
"""

from __future__ import annotations

from backend.protocol import InferReply, WireResult
from frontend.batching.base import Aggregator, BatchConfig, Clock, Delivery, Frame, JobQueue
from frontend.jobs import Job, JobState

NO_RESULT_MESSAGE = "the handler returned no result for this request"


class InFlight:
    """Jobs of the outstanding frame(s), by request id. Shared bookkeeping for every policy."""

    __slots__ = ("jobs",)

    def __init__(self) -> None:
        self.jobs: dict[str, Job] = {}

    def send(self, job: Job, worker_id: str, now: float) -> None:
        if job.state == JobState.QUEUED:
            job.transition(JobState.RUNNING)
            job.sent_at = now
            job.worker_id = worker_id
        self.jobs[job.request_id] = job

    def match(self, reply: InferReply, now: float) -> list[Delivery]:
        """Pair each result with its job; a result marked done retires the job."""
        out: list[Delivery] = []
        for result in reply.results:
            job = self.jobs.get(result.request_id)
            if job is None:  # cancelled or failed meanwhile: nobody waits for it
                continue
            if job.first_result_at is None:
                job.first_result_at = now
            job.num_results += 1
            if result.done:
                del self.jobs[result.request_id]
                if job.state == JobState.RUNNING:
                    job.transition(JobState.DONE)
            out.append((job, result))
        return out

    def take_all(self) -> list[Job]:
        jobs = list(self.jobs.values())
        self.jobs.clear()
        return jobs

    def __len__(self) -> int:
        return len(self.jobs)


class DynamicBatching(Aggregator):
    def __init__(self, worker_id: str, config: BatchConfig, clock: Clock, queue: JobQueue) -> None:
        super().__init__(worker_id, config, clock)
        self.queue = queue
        self._gathered: list[Job] = []
        self._first_at: float | None = None  # clock time the first gathered job was taken
        self._in_flight = InFlight()
        self._closed = False

    def _gather(self) -> None:
        kept = []
        for job in self._gathered:
            if job.cancel_requested:
                job.transition(JobState.CANCELLED)  # taken from the queue, never sent
            else:
                kept.append(job)
        self._gathered = kept
        if not self._gathered:
            self._first_at = None
        while not self._closed and len(self._gathered) < self.config.batch_size:
            queued = self.queue.pop()
            if queued is None:
                break
            if self._first_at is None:
                self._first_at = self.clock()
            self._gathered.append(queued)

    def next_frame(self) -> Frame | None:
        self._gather()
        if not self._gathered:
            return None
        now = self.clock()
        full = len(self._gathered) >= self.config.batch_size
        assert self._first_at is not None
        if not full and not self._closed and now < self._first_at + self.config.max_batch_delay:
            return None
        frame = self._new_frame()
        for job in self._gathered:
            self._in_flight.send(job, self.worker_id, now)
            frame.new_jobs.append(job)
        self._gathered = []
        self._first_at = None
        self._record_step(frame)
        return frame

    def wake_at(self) -> float | None:
        if self._first_at is None:
            return None
        return self._first_at + self.config.max_batch_delay

    def on_reply(self, reply: InferReply) -> list[Delivery]:
        out = self._in_flight.match(reply, self.clock())
        if reply.final:
            # Every request of a frame gets an answer: one the handler skipped is failed, not lost.
            for job in self._in_flight.take_all():
                job.transition(JobState.DONE)
                out.append((job, WireResult(job.request_id, 500, True, NO_RESULT_MESSAGE)))
        return out

    def on_worker_lost(self) -> list[Job]:
        for job in reversed(self._gathered):
            job.transition(JobState.QUEUED)
            self.queue.put_front(job)
        self._gathered = []
        self._first_at = None
        return self._in_flight.take_all()

    def close(self) -> list[Job]:
        self._closed = True
        jobs, self._gathered, self._first_at = self._gathered, [], None
        return jobs

    @property
    def num_active(self) -> int:
        return len(self._in_flight)

    @property
    def num_gathered(self) -> int:
        return len(self._gathered)
