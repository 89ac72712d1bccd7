"""Job sinks of the API layers: where a worker loop's results for one request go.

``ResponseSink`` is the JobSink (frontend/jobs.py) of one client request: results queue up until
the request's coroutine takes them. ``deliver``/``fail`` run on the event loop (worker loops,
the batcher's ``tick`` failures), never block and never raise. A failure keeps its typed error
when there is one, so the client sees e.g. ``SequenceExpiredException`` rather than a bare 410.
"""

from __future__ import annotations

import asyncio
import collections
from dataclasses import dataclass

from backend.protocol import WireResult
from frontend.errors import ConveyorError, RequestTimeout, ServiceUnavailable, WorkerError
from frontend.jobs import Job


@dataclass(frozen=True, slots=True)
class Failure:
    """A job ended without a handler result (worker lost, timeout, sequence rule...)."""

    error: ConveyorError


def failure_error(status: int, message: str) -> ConveyorError:
    """A typed error for a failure that arrived as (status, message) only."""
    error: ConveyorError
    if status == 408:
        error = RequestTimeout(message)
    elif status == 503:
        error = ServiceUnavailable(message)
    else:
        error = WorkerError(message)
        error.status = status  # e.g. 507 for a worker killed out of memory
    return error


class ResponseSink:
    """One consumer (the request's coroutine) awaits ``next``; while it waits, ``_waiter`` is the
    future it sleeps on (a bare future: cheaper than an asyncio.Event on this per-request path)."""

    __slots__ = ("_items", "_waiter", "closed")

    def __init__(self) -> None:
        self._items: collections.deque[WireResult | Failure] = collections.deque()
        self._waiter: asyncio.Future[None] | None = None
        self.closed = False  # the client is gone: drop what arrives

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def deliver(self, result: WireResult) -> None:
        if not self.closed:
            self._items.append(result)
            self._wake()

    def fail(self, status: int, message: str) -> None:
        self.fail_error(failure_error(status, message))

    def fail_error(self, error: ConveyorError) -> None:
        if not self.closed:
            self._items.append(Failure(error))
            self._wake()

    async def next(self) -> WireResult | Failure:
        while not self._items:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        return self._items.popleft()

    def close(self) -> None:
        self.closed = True
        self._items.clear()


def report_failure(job: Job, error: ConveyorError) -> None:
    """Hand a typed error to a job's sink (typed when the sink keeps types, else status+message)."""
    sink = job.sink
    if isinstance(sink, ResponseSink):
        sink.fail_error(error)
    elif sink is not None:
        sink.fail(error.status, error.message)
