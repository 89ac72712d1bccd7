"""Job results → HTTP responses: the writers that turn a ResponseSink's results into a reply.

A job's first result decides the shape of the response:
  * done at once, or a failure → one complete response (status, headers, body of that result);
    TorchServe sends a broken one when a stream's first result is already the last;
  * more follow (done=False)   → streamed, with the status and headers of the first result and the
    header ``ts_stream_next: true`` (what a TorchServe client sees on a streamed response):
      - HTTP chunked, one chunk per result, by default (TorchServe streams whenever the handler does);
      - Server-Sent Events, one ``data:`` event per result, when the client sent
        ``Accept: text/event-stream``;
      - buffered: the results' bodies joined into one complete response once the last one is in,
        for HTTP/1.0 clients (no chunked encoding) and for a client that sends
        ``x-conveyor-stream: false`` (a non-streaming client of a streaming model).
A failure after streaming began (a handler error in a later step, the worker lost, a timeout) is
written as a final error chunk — TorchServe's JSON error object and a newline; SSE: an ``error``
event — and ends the response, so a client never waits on a stream that will not end. A buffered
response that fails answers with the error alone.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Mapping
from enum import Enum

from aiohttp import web

from backend.protocol import WireResult
from frontend.errors import ConveyorError, PredictionError
from frontend.sinks import Failure, ResponseSink

# Result headers that describe the framing of the backend's message, not the HTTP response.
# ``ts_stream_next`` is TorchServe's per-message "more follow" flag; here the result's ``done`` says
# that, and the response gets the header from ``respond`` according to its shape.
_SKIP_HEADERS = frozenset({"content-length", "content-type", "transfer-encoding", "connection", "keep-alive",
                           "x-request-id", "ts_stream_next"})
STREAM_NEXT_HEADER = "ts_stream_next"
# Request header by which a client of a streaming model asks for the whole output in one response.
STREAM_REQUEST_HEADER = "x-conveyor-stream"
_NO = frozenset({"false", "0", "no", "off"})
_ERROR_BODY_LIMIT = 1000  # characters of a failed result's body quoted in an error chunk


class StreamMode(Enum):
    CHUNKED = "chunked"
    SSE = "sse"
    BUFFERED = "buffered"


def choose_mode(version: tuple[int, int], headers: Mapping[str, str]) -> StreamMode:
    """How a streamed result reaches this client (see the module docstring)."""
    if version < (1, 1) or headers.get(STREAM_REQUEST_HEADER, "").strip().lower() in _NO:
        return StreamMode.BUFFERED
    if "text/event-stream" in headers.get("Accept", ""):
        return StreamMode.SSE
    return StreamMode.CHUNKED


class ResultWriter(ABC):
    """One HTTP response in the making, whatever writes it: aiohttp (``AiohttpWriter``) or the
    inference port's fast path (frontend/api/fast_path.py). ``respond`` calls either ``complete``
    once, or ``start`` then ``write``s then ``end``."""

    __slots__ = ()

    @abstractmethod
    def complete(self, status: int, headers: dict[str, str], body: bytes) -> None:
        """A whole response (``headers`` holds its Content-Type)."""

    @abstractmethod
    async def start(self, status: int, headers: dict[str, str]) -> None:
        """The head of a streamed response (chunked, or SSE when Content-Type says so)."""

    @abstractmethod
    async def write(self, data: bytes) -> None:
        """One piece of a started stream; raises ConnectionError when the client is gone."""

    @abstractmethod
    async def end(self) -> None:
        """The end of a started stream."""


class AiohttpWriter(ResultWriter):
    """``ResultWriter`` over an aiohttp request; ``response`` is what the route handler returns."""

    __slots__ = ("request", "response")

    def __init__(self, request: web.Request) -> None:
        self.request = request
        self.response: web.StreamResponse | None = None

    def complete(self, status: int, headers: dict[str, str], body: bytes) -> None:
        self.response = web.Response(body=body, status=status, headers=headers)

    async def start(self, status: int, headers: dict[str, str]) -> None:
        self.response = web.StreamResponse(status=status, headers=headers)
        await self.response.prepare(self.request)  # chunked: HTTP/1.1 without a Content-Length

    async def write(self, data: bytes) -> None:
        assert self.response is not None
        await self.response.write(data)

    async def end(self) -> None:
        assert self.response is not None
        await self.response.write_eof()


def _result_error(result: WireResult) -> ConveyorError:
    message = result.message or result.body[:_ERROR_BODY_LIMIT].decode("utf-8", "replace")
    return PredictionError(result.status, message or f"prediction failed with status {result.status}")


def _headers(result: WireResult, extra: dict[str, str]) -> dict[str, str]:
    # ``extra`` (the frontend's own, e.g. the sequence id) replaces a handler header of the same
    # name in any case: HTTP names are case-insensitive, so keeping both would duplicate it.
    skip = _SKIP_HEADERS | {name.lower() for name in extra} if extra else _SKIP_HEADERS
    headers = {name: value for name, value in result.headers if name.lower() not in skip}
    headers.update(extra)
    return headers


def complete_parts(result: WireResult, extra: dict[str, str], body: bytes | None = None) -> tuple[int, dict[str, str], bytes]:
    """One whole response as (status, headers, body). A handler error without a body of its own
    becomes TorchServe's JSON."""
    if result.status >= 400 and not result.body and body is None:
        error = _result_error(result)
        return error.status, {**extra, "Content-Type": "application/json"}, json.dumps(error.to_json()).encode()
    headers = _headers(result, extra)
    # The handler's content type (with its charset) goes out as given.
    headers["Content-Type"] = result.content_type or "application/octet-stream"
    return result.status, headers, result.body if body is None else body


def _sse_event(data: bytes, event: str | None = None) -> bytes:
    text = data.decode("utf-8", "replace")
    lines = [f"event: {event}"] if event else []
    lines += [f"data: {line}" for line in text.splitlines() or [""]]
    return ("\n".join(lines) + "\n\n").encode()


async def respond(sink: ResponseSink, extra_headers: dict[str, str], mode: StreamMode, writer: ResultWriter) -> int:
    """Await the job's results and write them with ``writer`` in the shape the first one decides
    (``mode``: how a stream reaches this client). Returns the response's status; a failure before
    anything was written is raised (a ConveyorError), for the caller's error mapping."""
    first = await sink.next()
    if isinstance(first, Failure):
        raise first.error
    if first.done or first.status >= 400:
        status, headers, body = complete_parts(first, extra_headers)
        writer.complete(status, headers, body)
        return status
    if mode == StreamMode.BUFFERED:
        bodies = [first.body]
        while True:
            item = await sink.next()
            if isinstance(item, Failure):
                raise item.error
            if item.status >= 400:
                raise _result_error(item)
            bodies.append(item.body)
            if item.done:
                status, headers, body = complete_parts(first, extra_headers, b"".join(bodies))
                writer.complete(status, headers, body)
                return status

    headers = _headers(first, extra_headers)
    headers[STREAM_NEXT_HEADER] = "true"
    if mode == StreamMode.SSE:
        headers["Content-Type"] = "text/event-stream"
        headers["Cache-Control"] = "no-cache"
    else:
        headers["Content-Type"] = (first.content_type or "application/octet-stream").split(";")[0]
    await writer.start(first.status, headers)
    item: WireResult | Failure = first
    try:
        while True:
            if isinstance(item, Failure) or item.status >= 400:
                error = item.error if isinstance(item, Failure) else _result_error(item)
                payload = json.dumps(error.to_json()).encode()
                await writer.write(_sse_event(payload, "error") if mode == StreamMode.SSE else payload + b"\n")
                break
            if item.body:
                await writer.write(_sse_event(item.body) if mode == StreamMode.SSE else item.body)
            if item.done:
                break
            item = await sink.next()
        await writer.end()
    except ConnectionError:
        # The client went away mid-stream. The headers are sent, so there is no error to answer;
        # the caller sees the job unfinished and cancels it.
        pass
    return first.status
