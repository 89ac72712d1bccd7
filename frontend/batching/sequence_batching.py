"""Sequence batching: each worker serves its pinned sequences, one job per sequence in flight, in
arrival order, up to ``batch_size`` sequences per frame.

The sequence lifecycle (pinning, limits, end, timeouts, tombstones) lives in ``SequenceTable``;
this aggregator only builds frames from the table's ready sequences and tells it when jobs leave.
Per step: the worker's own sequences with a waiting job, in turn (a sequence just served goes to the
back), then unpinned sequences it claims (pinning them to itself) while the frame has room. A job
of a sequence is sent only when the previous one has left, so the handler never sees two requests
of one sequence at once. Like dynamic batching, an idle worker waits up to ``max_batch_delay`` for
``batch_size`` sequences to be ready; a handler may stream several replies for one frame; every job
of a frame leaves at its final reply.

After each reply the handler's end header (``BatchConfig.sequence_end_header``, value
``<id>[;<id>...]``) closes the named sequences of this worker at once; a job flagged SEQUENCE_END
closes its sequence when it leaves. Both are applied after all results of the reply are delivered,
so a stream's last chunk in the same reply is never lost.
"""

from __future__ import annotations

from frontend.batching.base import BatchConfig, Clock, Delivery
from frontend.batching.sequence_table import Sequence, SequenceTable
from frontend.batching.step import StepAggregator
from frontend.jobs import Job


class SequenceBatching(StepAggregator):
    continuous = False

    def __init__(self, worker_id: str, config: BatchConfig, clock: Clock, table: SequenceTable) -> None:
        super().__init__(worker_id, config, clock)
        self.table = table
        self._picked: list[Sequence] = []

    def _before_step(self, now: float) -> None:
        self.table.expire(now)  # keeps wake_at in the future; failures wait in the table's outbox

    def _gather(self, now: float) -> int:
        in_batch = {job.sequence_id for job in self._running.values()}
        room = self.config.batch_size - len(in_batch)
        picked = []
        for seq in self.table.ready(self.worker_id):
            if seq.in_flight or seq.sequence_id in in_batch:
                if self.continuous and seq.worker_id == self.worker_id:
                    picked.append(seq)  # joins its own running stream's step: takes no new slot
                continue
            if room > 0:
                picked.append(seq)
                room -= 1
        self._picked = picked
        return len(picked)

    def _admit(self, now: float) -> list[Job]:
        picked, self._picked = self._picked, []
        return [self.table.take_job(seq, self.worker_id) for seq in picked]

    def _left(self, job: Job, now: float) -> None:
        self.table.job_left(job, now)

    def _after_reply(self, delivered: list[Delivery], now: float) -> None:
        ended: list[str] = []
        for _job, result in delivered:
            if result.headers:
                ended += self.table.end_ids(result.headers)
        if ended:
            self.table.close_by_handler(ended, self.worker_id, now)

    def _extra_wake_at(self) -> float | None:
        return self.table.next_deadline()
