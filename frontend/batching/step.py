"""StepAggregator: the step loop shared by continuous batching and both sequence policies.

One frame is one *step*. A job is RUNNING from the frame that first carries it (NEW, with payload)
until it *leaves*; while it runs it may be carried again (CONTINUE, id only) in later frames. The
subclass decides what may join a step (``_gather`` / ``_admit``) and hears when a job leaves
(``_left``); this class owns everything else, in one place:

* **Leaving.** A job leaves when a result for it says ``done``; when a result has status >= 400 (a
  failure is terminal whatever ``done`` says: the result is delivered with ``done=True`` so the sink
  closes the stream, and one that was not done is CANCELled so the backend frees it); when the
  client cancels it (``job.cancel_requested``: the next frame carries exactly one CANCEL for it and
  it never appears again); when it was failed from outside (its sequence was closed or expired:
  same CANCEL, nothing delivered); or when the final reply of a frame has no result for it (it is
  failed with a 500 and, in continuous mode, CANCELled so the backend frees whatever it kept).
* **Waiting.** A busy worker (something running, or a CANCEL owed) never waits: whatever can join
  is admitted at once, between two steps. An idle worker returns None until something can join;
  then, if fewer than ``batch_size`` units can join, it waits at most ``max_batch_delay`` after it
  first saw work (``wake_at``) to gather more — the one place a delay is ever spent.
* **Counting.** ``num_steps``, ``last_batch_size`` (NEW + CONTINUE of the last frame) and
  ``num_cancels_sent`` for metrics (see ``Aggregator.stats``).

``continuous = False`` (sequence batching without continuous batching) keeps the same rules but
every job of a frame leaves at that frame's final reply, as in dynamic batching.
"""

from __future__ import annotations

from dataclasses import replace

from backend.protocol import InferReply, WireResult
from frontend.batching.base import Aggregator, BatchConfig, Clock, Delivery, Frame
from frontend.jobs import Job, JobState

NO_RESULT_MESSAGE = "the handler returned no result for this request"


def is_terminal(result: WireResult) -> bool:
    """A result after which its request id gets nothing more."""
    return result.done or result.status >= 400


class StepAggregator(Aggregator):
    #: True: unfinished jobs stay in the batch step after step (CONTINUE). False: every job of a frame
    #: leaves at the frame's final reply.
    continuous = True

    def __init__(self, worker_id: str, config: BatchConfig, clock: Clock) -> None:
        super().__init__(worker_id, config, clock)
        # Jobs in the backend, by request id, in admission order. Invariant: every job here is
        # RUNNING or was finished from outside (then the next step CANCELs and drops it).
        self._running: dict[str, Job] = {}
        self._to_cancel: list[Job] = []  # each owed exactly one CANCEL entry in the next frame
        self._awaiting: dict[str, Job] = {}  # jobs of the outstanding frame without a result yet
        self._gather_since: float | None = None  # idle worker: when it first saw work to gather
        self._closed = False

    # Hooks for the policies ------------------------------------------------------------------------

    def _before_step(self, now: float) -> None:
        """Runs first in every ``next_frame`` (sequence policies reap timed-out sequences here)."""

    def _gather(self, now: float) -> int:
        """How many units (jobs, or sequences) could join the next step now. May take jobs from a
        queue; they stay QUEUED until ``_admit`` returns them."""
        raise NotImplementedError

    def _admit(self, now: float) -> list[Job]:
        """The QUEUED jobs that join this step, in arrival order (called after ``_gather``)."""
        raise NotImplementedError

    def _take_unsent(self) -> list[Job]:
        """Jobs taken by ``_gather`` but never sent (scale-down / worker lost)."""
        return []

    def _return_unsent(self) -> None:
        """Worker lost: put jobs taken but never sent back where they came from."""

    def _left(self, job: Job, now: float) -> None:
        """``job`` left the backend (done, failed or cancelled)."""

    def _after_reply(self, delivered: list[Delivery], now: float) -> None:
        """Runs after a reply's results were matched (sequence policies read end headers here)."""

    def _extra_wake_at(self) -> float | None:
        """A deadline other than the batch delay at which ``next_frame`` has work to do."""
        return None

    def _order(self, frame: Frame, before: list[Job]) -> None:
        """Optionally set ``frame.order``; ``before`` is the running set in admission order."""

    # Aggregator ------------------------------------------------------------------------------------

    def next_frame(self) -> Frame | None:
        now = self.clock()
        self._before_step(now)
        before = list(self._running.values())
        self._sweep(now)
        busy = bool(self._running) or bool(self._to_cancel)
        new: list[Job] = []
        if not self._closed:
            available = self._gather(now)
            if available and not busy:
                if self._gather_since is None:
                    self._gather_since = now
                deadline = self._gather_since + self.config.max_batch_delay
                if available < self.config.batch_size and now < deadline:
                    return None  # idle: spend the batch delay gathering (wake_at says until when)
            if available:
                new = self._admit(now)
        if not busy and not new:
            self._gather_since = None
            return None

        frame = self._new_frame()
        frame.continuing_jobs = list(self._running.values())
        frame.cancelled_jobs, self._to_cancel = self._to_cancel, []
        for job in new:
            job.transition(JobState.RUNNING)
            job.sent_at = now
            job.worker_id = self.worker_id
            self._running[job.request_id] = job
        frame.new_jobs = new
        self._awaiting = {job.request_id: job for job in frame.new_jobs + frame.continuing_jobs}
        self._gather_since = None
        self._order(frame, before)
        self._record_step(frame)
        return frame

    def _sweep(self, now: float) -> None:
        """Running jobs that were cancelled, or failed from outside, leave and are owed a CANCEL."""
        for request_id, job in list(self._running.items()):
            if job.cancel_requested or job.state.finished:
                del self._running[request_id]
                if not job.state.finished:
                    job.transition(JobState.CANCELLED)
                    self._left(job, now)
                self._to_cancel.append(job)

    def wake_at(self) -> float | None:
        at = None
        if self._gather_since is not None and not self._running and not self._to_cancel:
            at = self._gather_since + self.config.max_batch_delay
        extra = self._extra_wake_at()
        if extra is not None and (at is None or extra < at):
            at = extra
        return at

    def on_reply(self, reply: InferReply) -> list[Delivery]:
        now = self.clock()
        out: list[Delivery] = []
        for result in reply.results:
            job = self._running.get(result.request_id)
            if job is None:  # cancelled or retired meanwhile: nobody waits for it
                continue
            self._awaiting.pop(result.request_id, None)
            if job.state.finished:  # failed from outside (its sequence ended): nothing to deliver
                if is_terminal(result):
                    del self._running[result.request_id]  # the backend is done with it: no CANCEL
                continue
            if job.first_result_at is None:
                job.first_result_at = now
            job.num_results += 1
            if is_terminal(result):
                del self._running[result.request_id]
                job.transition(JobState.DONE if result.status < 400 else JobState.FAILED)
                if not result.done:
                    result = replace(result, done=True)
                    if self.continuous:
                        self._to_cancel.append(job)  # the backend still counts it as running: free it
                self._left(job, now)
            out.append((job, result))
        if reply.final:
            missing = list(self._awaiting.values()) if self.continuous else list(self._running.values())
            self._awaiting = {}
            for job in missing:
                if self._running.pop(job.request_id, None) is None:
                    continue
                if not job.state.finished:
                    # Every request of a frame gets an answer: one the handler skipped is failed, not lost.
                    job.transition(JobState.FAILED)
                    out.append((job, WireResult(job.request_id, 500, True, NO_RESULT_MESSAGE)))
                    self._left(job, now)
                if self.continuous:
                    self._to_cancel.append(job)  # the backend may still hold its state
        self._after_reply(out, now)
        return out

    def on_worker_lost(self) -> list[Job]:
        lost = []
        for job in self._running.values():
            if job.state.finished:
                continue
            if job.cancel_requested:  # the client is gone already: nobody to tell
                job.transition(JobState.CANCELLED)
            else:
                lost.append(job)
        self._running.clear()
        self._to_cancel = []
        self._awaiting = {}
        self._gather_since = None
        self._return_unsent()
        return lost

    def close(self) -> list[Job]:
        self._closed = True
        self._gather_since = None
        return self._take_unsent()

    @property
    def num_active(self) -> int:
        return len(self._running)

    @property
    def num_cancels_owed(self) -> int:
        return len(self._to_cancel)
