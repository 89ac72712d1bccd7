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
    __slots__ = ("_items", "_ready", "closed")

    def __init__(self) -> None:
        self._items: collections.deque[WireResult | Failure] = collections.deque()
        self._ready = asyncio.Event()
        self.closed = False  # the client is gone: drop what arrives

    def deliver(self, result: WireResult) -> None:
        if not self.closed:
            self._items.append(result)
            self._ready.set()

    def fail(self, status: int, message: str) -> None:
        self.fail_error(failure_error(status, message))

    def fail_error(self, error: ConveyorError) -> None:
        if not self.closed:
            self._items.append(Failure(error))
            self._ready.set()

    async def next(self) -> WireResult | Failure:
        while not self._items:
            self._ready.clear()
            await self._ready.wait()
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
