"""Test helpers for aggregators: a fake clock, jobs and replies built by hand."""

from __future__ import annotations

from backend.protocol import InferReply, InputParameter, RequestFlags, RequestState, WireResult
from frontend.batching.base import BatchConfig, Frame
from frontend.batching.model_batcher import ModelBatcher
from frontend.jobs import Job


class FakeClock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def make_jobs(
    n: int, prefix: str = "r", model: str = "m", sequence_id: str = "", start: int = 0,
    flags: RequestFlags = RequestFlags.NONE,
) -> list[Job]:
    return [
        Job(
            f"{prefix}{i}", model, parameters=(InputParameter("body", "text/plain", str(i).encode()),),
            sequence_id=sequence_id, flags=flags,
        )
        for i in range(start, start + n)
    ]


def seq_job(request_id: str, sequence_id: str, *, start: bool = False, end: bool = False, deadline: float | None = None) -> Job:
    """One job of a sequence, optionally flagged SEQUENCE_START / SEQUENCE_END."""
    flags = RequestFlags.NONE
    if start:
        flags |= RequestFlags.SEQUENCE_START
    if end:
        flags |= RequestFlags.SEQUENCE_END
    return Job(
        request_id, "m", parameters=(InputParameter("body", "text/plain", request_id.encode()),),
        sequence_id=sequence_id, flags=flags, deadline=deadline,
    )


def ids(jobs) -> list[str]:
    return [job.request_id for job in jobs]


def wire(frame: Frame) -> list[tuple[str, RequestState]]:
    """The frame as sent: (request id, state) per entry, in wire order."""
    return [(req.request_id, req.state) for req in frame.to_wire().requests]


def results(frame_id: int, *items: WireResult, final: bool = True) -> InferReply:
    return InferReply(frame_id, final, items)


def reply(frame: Frame, done: bool | dict[str, bool] = True, final: bool = True) -> InferReply:
    """A reply with one result per NEW/CONTINUE job of the frame; ``done`` may differ per request id."""
    results = []
    for job in frame.new_jobs + frame.continuing_jobs:
        is_done = done if isinstance(done, bool) else done.get(job.request_id, False)
        results.append(WireResult(job.request_id, 200, is_done, body=job.request_id.encode()))
    return InferReply(frame.frame_id, final, results)


def make_batcher(clock: FakeClock, **config) -> ModelBatcher:
    return ModelBatcher("m", BatchConfig(**config), clock)
