"""A stand-in for the frontend's ContinuousBatching aggregator and the worker, for in-process tests.

`FrameDriver` keeps at most `batch_size` requests in a frame, admits queued ones between steps as
others finish, sends cancels, and calls the handler exactly as backend/service.py does: the
cancel hook first, then `context.begin_frame(...)` on the real `backend.context.Context`, then
`handle(data, context)`; a request leaves when `context.is_done(idx)`. With `step_ahead=True` it
also plays the worker that finds no next frame waiting: after every frame it calls the handler's
`step_ahead()` hook, so every following frame's cancels and new requests land after a decode-ahead.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from backend.context import Context, RequestEntry

from handlers.text_generation import HandlerConfig, TextGenerationHandler


@dataclass
class Record:
    """Everything one request received, chunk by chunk."""

    request_id: str
    chunks: list[dict[str, Any]] = field(default_factory=list)
    status: int = 200
    done: bool = False

    @property
    def text(self) -> str:
        return "".join(c.get("text", "") for c in self.chunks)

    @property
    def token_ids(self) -> list[int]:
        return [t for c in self.chunks for t in c.get("token_ids", [])]

    @property
    def final(self) -> dict[str, Any]:
        return self.chunks[-1]


def make_context(model_dir: Path | str, handler_config: dict | None = None, batch_size: int = 4) -> Context:
    yaml_config = {"continuousBatching": True, "batchSize": batch_size, "handler": {"model_path": ".", **(handler_config or {})}}
    return Context("tiny", str(model_dir), {"model": {"modelName": "tiny"}}, batch_size, None, model_yaml_config=yaml_config)


def make_handler(model_dir: Path | str, handler_config: dict | None = None, batch_size: int = 4,
                 model: Any = None, tokenizer: Any = None) -> tuple[TextGenerationHandler, Context]:
    """A handler through `initialize` (the real loading code), or wired to an already loaded model."""
    context = make_context(model_dir, handler_config, batch_size)
    handler = TextGenerationHandler()
    if model is None:
        handler.initialize(context)
    else:
        handler.setup(model, tokenizer, HandlerConfig.from_context(context), max_rows_hint=batch_size)
    return handler, context


class FrameDriver:
    def __init__(self, handler: TextGenerationHandler, context: Context, batch_size: int = 4,
                 step_ahead: bool = False) -> None:
        self.handler = handler
        self.step_ahead = step_ahead
        self.num_decoded_ahead = 0  # frames after which the hook really ran a decode forward
        self.context = context
        self.batch_size = batch_size
        self.queue: collections.deque[tuple[str, Any]] = collections.deque()
        self.active: dict[str, Any] = {}  # id -> body, in admission order
        self.new_ids: set[str] = set()
        self.cancels: list[str] = []
        self.records: dict[str, Record] = {}
        self.num_steps = 0

    def submit(self, request_id: str, body: Any) -> None:
        self.records[request_id] = Record(request_id)
        self.queue.append((request_id, body))

    def cancel(self, request_id: str) -> None:
        """The client went away: the next frame carries a CANCEL and no longer the request."""
        if self.active.pop(request_id, None) is not None:
            self.cancels.append(request_id)

    @property
    def idle(self) -> bool:
        return not self.queue and not self.active

    def step(self) -> None:
        while self.queue and len(self.active) < self.batch_size:
            request_id, body = self.queue.popleft()
            self.active[request_id] = body
            self.new_ids.add(request_id)
        cancels, self.cancels = self.cancels, []
        if cancels:
            self.handler.cancel(cancels)
        ids = list(self.active)
        entries = [RequestEntry(rid, {}, "", rid in self.new_ids) for rid in ids]
        self.new_ids.clear()
        self.context.begin_frame(entries, cancels)
        if not ids:
            return
        data = [{"body": self.active[rid]} for rid in ids]
        results = self.handler.handle(data, self.context)
        assert len(results) == len(ids)
        self.num_steps += 1
        for idx, rid in enumerate(ids):
            record = self.records[rid]
            record.chunks.append(results[idx])
            record.status = self.context.get_response_status(idx)[0]
            if self.context.is_done(idx):
                record.done = True
                del self.active[rid]
        if self.step_ahead:
            self.handler.step_ahead()
            self.num_decoded_ahead += self.handler.engine.decoded_ahead

    def run(self, max_steps: int = 10_000) -> dict[str, Record]:
        while not self.idle:
            if self.num_steps >= max_steps:
                raise AssertionError(f"not idle after {max_steps} steps: active {list(self.active)}")
            self.step()
        return self.records
