"""Sequence + continuous batching: sequence affinity and order, with streams that stay in the batch.

A streaming job of a sequence stays in the batch step after step (CONTINUE) until its result is
done. Capacity is counted in *sequences*: up to ``batch_size`` sequences per step. A later job of a
sequence that is already in the batch — typically a control request such as "cancel my stream" or
"end" — takes no new slot: it is admitted at the very next step (one new job per sequence per
step, in arrival order), so the handler sees it in the same frame as the running stream's CONTINUE
and can stop that stream. (TorchServe approximates this with a hard-coded capacity of
2 × batchSize.)

Interleaving the handler sees, within one frame: each sequence's entries are adjacent and in
arrival order (CANCEL / CONTINUE entries of earlier jobs, then the newly admitted job); across
sequences no order is promised. A handler never has to sort.

A sequence closed meanwhile (end header, end flag, timeout) has its still-running jobs failed; the
next step carries one CANCEL for each so the backend frees their state.
"""

from __future__ import annotations

from frontend.batching.base import Frame
from frontend.batching.sequence_batching import SequenceBatching
from frontend.jobs import Job


class SequenceContinuousBatching(SequenceBatching):
    continuous = True

    def _order(self, frame: Frame, before: list[Job]) -> None:
        rank = {job.request_id: i for i, job in enumerate(before)}
        older = sorted(frame.cancelled_jobs + frame.continuing_jobs, key=lambda job: rank.get(job.request_id, -1))
        groups: dict[str, list[Job]] = {}
        for job in older + frame.new_jobs:
            groups.setdefault(job.sequence_id, []).append(job)
        frame.order = [job for group in groups.values() for job in group]
