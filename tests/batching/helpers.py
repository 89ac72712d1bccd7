"""Test helpers for aggregators: a fake clock, jobs and replies built by hand."""

from __future__ import annotations

from backend.protocol import InferReply, InputParameter, WireResult
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


def make_jobs(n: int, prefix: str = "r", model: str = "m", sequence_id: str = "", start: int = 0) -> list[Job]:
    return [
        Job(f"{prefix}{i}", model, parameters=(InputParameter("body", "text/plain", str(i).encode()),), sequence_id=sequence_id)
        for i in range(start, start + n)
    ]


def reply(frame: Frame, done: bool | dict[str, bool] = True, final: bool = True) -> InferReply:
    """A reply with one result per NEW/CONTINUE job of the frame; ``done`` may differ per request id."""
    results = []
    for job in frame.new_jobs + frame.continuing_jobs:
        is_done = done if isinstance(done, bool) else done.get(job.request_id, False)
        results.append(WireResult(job.request_id, 200, is_done, body=job.request_id.encode()))
    return InferReply(frame.frame_id, final, results)


def make_batcher(clock: FakeClock, **config) -> ModelBatcher:
    return ModelBatcher("m", BatchConfig(**config), clock)
