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


def choose_mode(request: web.Request) -> StreamMode:
    """How a streamed result reaches this client (see the module docstring)."""
    if request.version < (1, 1) or request.headers.get(STREAM_REQUEST_HEADER, "").strip().lower() in _NO:
        return StreamMode.BUFFERED
    if "text/event-stream" in request.headers.get("Accept", ""):
        return StreamMode.SSE
    return StreamMode.CHUNKED


def _result_error(result: WireResult) -> ConveyorError:
    message = result.message or result.body[:_ERROR_BODY_LIMIT].decode("utf-8", "replace")
    return PredictionError(result.status, message or f"prediction failed with status {result.status}")


def _headers(result: WireResult, extra: dict[str, str]) -> dict[str, str]:
    # ``extra`` (the frontend's own, e.g. the sequence id) replaces a handler header of the same
    # name in any case: HTTP names are case-insensitive, so keeping both would duplicate it.
    skip = _SKIP_HEADERS | {name.lower() for name in extra}
    headers = {name: value for name, value in result.headers if name.lower() not in skip}
    headers.update(extra)
    return headers


def complete_response(result: WireResult, extra: dict[str, str], body: bytes | None = None) -> web.Response:
    """One whole response. A handler error without a body of its own becomes TorchServe's JSON."""
    if result.status >= 400 and not result.body and body is None:
        error = _result_error(result)
        return web.Response(text=json.dumps(error.to_json()), status=error.status, content_type="application/json",
                            headers=extra)
    headers = _headers(result, extra)
    # The handler's content type (with its charset) goes out as given: one header, no parsing
    # through aiohttp's content_type/charset setters on the hot path.
    headers["Content-Type"] = result.content_type or "application/octet-stream"
    return web.Response(body=result.body if body is None else body, status=result.status, headers=headers)


def _sse_event(data: bytes, event: str | None = None) -> bytes:
    text = data.decode("utf-8", "replace")
    lines = [f"event: {event}"] if event else []
    lines += [f"data: {line}" for line in text.splitlines() or [""]]
    return ("\n".join(lines) + "\n\n").encode()


async def respond(request: web.Request, sink: ResponseSink, extra_headers: dict[str, str]) -> web.StreamResponse:
    """Await the job's results and write them to the client in the shape the first one decides."""
    first = await sink.next()
    if isinstance(first, Failure):
        raise first.error
    if first.done or first.status >= 400:
        return complete_response(first, extra_headers)
    mode = choose_mode(request)
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
                return complete_response(first, extra_headers, b"".join(bodies))

    response = web.StreamResponse(status=first.status, headers=_headers(first, extra_headers))
    response.headers[STREAM_NEXT_HEADER] = "true"
    if mode == StreamMode.SSE:
        response.content_type = "text/event-stream"
        response.headers["Cache-Control"] = "no-cache"
    else:
        response.content_type = (first.content_type or "application/octet-stream").split(";")[0]
        response.enable_chunked_encoding()
    await response.prepare(request)
    item: WireResult | Failure = first
    try:
        while True:
            if isinstance(item, Failure) or item.status >= 400:
                error = item.error if isinstance(item, Failure) else _result_error(item)
                payload = json.dumps(error.to_json()).encode()
                await response.write(_sse_event(payload, "error") if mode == StreamMode.SSE else payload + b"\n")
                break
            if item.body:
                await response.write(_sse_event(item.body) if mode == StreamMode.SSE else item.body)
            if item.done:
                break
            item = await sink.next()
        await response.write_eof()
    except ConnectionError:
        # The client went away mid-stream. The headers are sent, so there is no error to answer;
        # the caller sees the job unfinished and cancels it.
        pass
    return response
