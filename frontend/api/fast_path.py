"""The inference port's fast path: ``POST``/``PUT /predictions/{model}[/{version}]`` (and
``/explanations``) and ``GET /ping``, served straight from an asyncio protocol; every other request
goes to the aiohttp application on the same connection.

Why: under echo load, aiohttp's per-request machinery (its Request, router, middleware and
StreamResponse objects) cost the frontend more CPU than everything else it does for a prediction —
jobs, batching, the codec (profiles in docs/benchmarks.md). Here a connection frames HTTP/1.1
requests itself (the head up to its blank line, then exactly Content-Length body bytes), lets
httptools (llhttp, the parser aiohttp uses too, so both agree on what is valid) check the head,
splits the checked header lines once, and writes responses as bytes.

What is served here, and what is handed over:
  * served: HTTP/1.1; POST or PUT on a prediction route, or GET /ping; a body announced by
    Content-Length, or none; a content type that is not a form;
  * handed over to aiohttp: everything else — other routes and methods, HTTP/1.0, a chunked request
    body, ``Expect``, ``Upgrade``, forms (multipart, urlencoded), a head httptools refuses (aiohttp
    answers it with its JSON 400), a folded header line, a head over 8190 bytes or 128 fields. The
    hand-over happens at a request boundary with no response pending: the bytes not yet consumed go to aiohttp's connection
    handler (``transport.set_protocol``), which keeps the connection from then on.

What a client sees is the aiohttp routes' behaviour: the same ``InferenceApi.run`` (jobs, sequence
headers, stream shapes of frontend/api/streaming.py), the same auth rule, request ids, in-flight
count and refusal during shutdown, ``request_body_timeout``, ``max_request_size``, error JSON and
metrics. Requests of one connection are answered one at a time, in order (pipelining is allowed).
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
from collections.abc import Callable
from email.utils import formatdate
from http import HTTPStatus
from typing import Any, cast
from urllib.parse import parse_qsl, unquote

import httptools
from multidict import CIMultiDict

from backend.protocol import InputParameter
from frontend.api.common import (
    REQUEST_ID_HEADER,
    SHUTTING_DOWN_MESSAGE,
    Authorizer,
    InFlight,
    body_timeout_error,
    choose_request_id,
    error_parts,
)
from frontend.api.inference import InferenceApi
from frontend.api.payload import FORM_URLENCODED, MULTIPART_FORM
from frontend.api.streaming import ResultWriter, choose_mode
from frontend.errors import ConveyorError, RequestTooLarge, ServiceUnavailable
from frontend.metrics import ServerMetrics, status_class

log = logging.getLogger(__name__)

HEAD_LIMIT = 8190  # bytes of a request head served here; a longer one is aiohttp's to refuse
MAX_HEADERS = 128  # aiohttp's limit: more is aiohttp's to refuse
KEEPALIVE_TIMEOUT = 75.0  # seconds an idle keep-alive connection stays open (aiohttp's default)
_PREDICT = re.compile(rb"/(predictions|explanations)/([^/]+)(?:/([^/]+))?")
_METHOD_START = re.compile(rb"[A-Z]{1,16}(?: |$)")  # how a request can start
_REQUEST_LINE = re.compile(rb"(GET|POST|PUT) ([^ \r\n]+) HTTP/1\.1\r\n")
_FORMS = (MULTIPART_FORM, FORM_URLENCODED)
_REASONS = {status.value: status.phrase for status in HTTPStatus}


class _Request:
    """One request served here: what the head said, and its body."""

    __slots__ = ("body", "content_length", "explain", "header_list", "headers", "keep_alive", "method", "model",
                 "query", "target", "version")

    def __init__(self, method: bytes, target: bytes, query: bytes) -> None:
        self.method = method
        self.target = target
        self.query = query
        self.header_list: list[tuple[str, str]] = []  # as received, in order
        self.headers: CIMultiDict[str] = CIMultiDict()
        self.content_length = 0
        self.body = b""
        self.keep_alive = True
        self.model: str | None = None  # None: GET /ping
        self.version: str | None = None
        self.explain = False


class _NoCallbacks:
    """httptools only checks a head here; the fields are split from the checked bytes afterwards."""

    __slots__ = ()


_NO_CALLBACKS = _NoCallbacks()


class FastPath:
    """What the fast connections of one inference listener share."""

    def __init__(self, api: InferenceApi, authorizer: Authorizer, metrics: ServerMetrics, in_flight: InFlight,
                 body_timeout: float | None, max_request_size: int, access_log: logging.Logger | None = None) -> None:
        self.api = api
        self.authorizer = authorizer
        self.in_flight = in_flight
        self.body_timeout = body_timeout
        self.max_request_size = max_request_size
        self.access_log = access_log
        self.connections: set[FastConnection] = set()
        self._http_requests = metrics.http_requests
        self._counters: dict[int, Any] = {}  # status → label child (labels() costs more than inc())
        self._date = (0, "")

    def connect(self, handover: Callable[[], asyncio.Protocol]) -> FastConnection:
        return FastConnection(self, handover)

    def count(self, status: int) -> None:
        counter = self._counters.get(status)
        if counter is None:
            counter = self._counters[status] = self._http_requests.labels("inference", status_class(status))
        counter.inc()

    def date(self) -> str:
        now = int(time.time())
        if now != self._date[0]:
            self._date = (now, formatdate(now, usegmt=True))
        return self._date[1]

    def pre_shutdown(self) -> None:
        """Idle connections close now, busy ones after their response."""
        for connection in list(self.connections):
            connection.close_when_idle()

    def close_all(self) -> None:
        for connection in list(self.connections):
            connection.transport.close()


def _head(status: int, headers: dict[str, str], rid: str, date: str, length: int | None, keep_alive: bool) -> bytes:
    lines = [f"HTTP/1.1 {status} {_REASONS.get(status, 'Unknown')}\r\n"]
    for name, value in headers.items():
        if "\n" in name or "\r" in name or "\n" in value or "\r" in value:
            log.warning("dropped response header %r: CR or LF in it", name)  # no response splitting
            continue
        lines.append(f"{name}: {value}\r\n")
    lines.append(f"{REQUEST_ID_HEADER}: {rid}\r\nDate: {date}\r\n")
    lines.append(f"Content-Length: {length}\r\n" if length is not None else "Transfer-Encoding: chunked\r\n")
    if not keep_alive:
        lines.append("Connection: close\r\n")
    lines.append("\r\n")
    return "".join(lines).encode("utf-8", "surrogateescape")


class _Writer(ResultWriter):
    """``ResultWriter`` over a fast connection's transport."""

    __slots__ = ("connection", "keep_alive", "rid", "size", "status")

    def __init__(self, connection: FastConnection, rid: str, keep_alive: bool) -> None:
        self.connection = connection
        self.rid = rid
        self.keep_alive = keep_alive
        self.status = 0  # 0: nothing written yet
        self.size = 0

    def complete(self, status: int, headers: dict[str, str], body: bytes) -> None:
        self.status = status
        self.size = len(body)
        head = _head(status, headers, self.rid, self.connection.fast.date(), len(body), self.keep_alive)
        self.connection.transport.write(head + body)

    async def start(self, status: int, headers: dict[str, str]) -> None:
        self.status = status
        self.connection.transport.write(_head(status, headers, self.rid, self.connection.fast.date(), None,
                                              self.keep_alive))

    async def write(self, data: bytes) -> None:
        connection = self.connection
        if connection.transport.is_closing():
            raise ConnectionResetError("Cannot write to closing transport")
        self.size += len(data)
        connection.transport.write(b"%x\r\n%b\r\n" % (len(data), data))
        if connection.paused:
            await connection.drain()

    async def end(self) -> None:
        if self.connection.transport.is_closing():
            raise ConnectionResetError("Cannot write to closing transport")
        self.connection.transport.write(b"0\r\n\r\n")


class FastConnection(asyncio.Protocol):
    """One client connection on the inference port, until it is handed over to aiohttp."""

    def __init__(self, fast: FastPath, handover: Callable[[], asyncio.Protocol]) -> None:
        self.fast = fast
        self._handover_protocol = handover
        self.transport: asyncio.Transport = cast(asyncio.Transport, None)
        self.paused = False  # the transport's write buffer is over its high-water mark
        self._buf = bytearray()
        self._task: asyncio.Task[None] | None = None
        self._waiter: asyncio.Future[None] | None = None  # the loop waits for bytes (or a deadline)
        self._drain_waiter: asyncio.Future[None] | None = None
        self._closed = False  # connection lost, or the client sent EOF
        self._idle = False  # waiting for the next request's first bytes
        self._close_when_idle = False
        self._last_active = 0.0
        self._timer: asyncio.TimerHandle | None = None
        self._loop: asyncio.AbstractEventLoop = cast(asyncio.AbstractEventLoop, None)

    # asyncio.Protocol --------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)
        # Kept: asyncio.get_running_loop() costs a getpid() system call on every call.
        self._loop = loop = asyncio.get_running_loop()
        self._last_active = loop.time()
        self.fast.connections.add(self)
        self._task = loop.create_task(self._run())

    def data_received(self, data: bytes) -> None:
        self._buf += data
        self._wake()

    def eof_received(self) -> bool | None:
        self._closed = True
        self._wake()
        return None  # as aiohttp: a half-closed connection is closed

    def connection_lost(self, exc: Exception | None) -> None:
        self._closed = True
        self.fast.connections.discard(self)
        if self._timer is not None:
            self._timer.cancel()
        if self._task is not None and not self._task.done():
            self._task.cancel()  # a request in flight: its finally cancels the job (client gone)
        self._wake()
        self.resume_writing()

    def pause_writing(self) -> None:
        self.paused = True

    def resume_writing(self) -> None:
        self.paused = False
        waiter = self._drain_waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def drain(self) -> None:
        if self.paused and not self._closed:
            self._drain_waiter = self._loop.create_future()
            try:
                await self._drain_waiter
            finally:
                self._drain_waiter = None
        if self._closed:
            raise ConnectionResetError("Connection lost")

    def close_when_idle(self) -> None:
        self._close_when_idle = True
        if self._idle and not self._buf:
            self.transport.close()

    # The connection's loop ---------------------------------------------------------------------

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def _more(self) -> None:
        """Wait for more bytes (or EOF, or a timer's wake-up)."""
        self._waiter = self._loop.create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    async def _run(self) -> None:
        try:
            while True:
                request = await self._next_request()
                if request is None:
                    return
                keep_alive = await self._serve(request)
                if not keep_alive:
                    self.transport.close()
                    return
        except asyncio.CancelledError:
            pass  # connection lost
        except Exception:
            log.exception("fast path: connection failed")
            self.transport.close()

    async def _next_request(self) -> _Request | None:
        """The next request served here; None once the connection is closed or handed over."""
        loop = self._loop
        while True:
            buf = self._buf
            end = buf.find(b"\r\n\r\n", 0, HEAD_LIMIT + 4)
            if end >= 0:
                break
            if len(buf) > HEAD_LIMIT or self._closed or (buf and not _METHOD_START.match(buf)):
                # Too long, or not HTTP at all (e.g. a TLS hello): aiohttp answers at once.
                if buf and not self._closed:
                    self._hand_over()
                return None
            if not buf:
                if self._close_when_idle:
                    self.transport.close()
                    return None
                self._idle = True
                self._arm_idle_timer(loop)
            await self._more()
            self._idle = False
            self._last_active = loop.time()
        request = self._parse_head(end + 4)
        if request is None:
            self._hand_over()
            return None
        return await self._read_body(request, end + 4)

    def _parse_head(self, head_length: int) -> _Request | None:
        """The request if this path serves it, else None (the bytes stay for aiohttp)."""
        buf = self._buf
        line = _REQUEST_LINE.match(buf)
        if line is None:
            return None
        method, target = line.group(1), line.group(2)
        path, _, query = target.partition(b"?")
        request = _Request(method, target, query)
        if method == b"GET":
            if path != b"/ping":
                return None
        else:  # POST or PUT
            match = _PREDICT.fullmatch(path)
            if match is None:
                return None
            kind, model, model_version = match.groups()
            request.model = _segment(model)
            request.version = _segment(model_version) if model_version is not None else None
            request.explain = kind == b"explanations"
        head = bytes(buf[:head_length])
        parser = httptools.HttpRequestParser(_NO_CALLBACKS)  # one per request: 0.3 µs, no state carried over
        try:
            parser.feed_data(head)
        except httptools.HttpParserError:
            return None  # aiohttp parses it again and answers its 400
        text = head[line.end():head_length - 4].decode("utf-8", "surrogateescape")
        if "\r\n " in text or "\r\n\t" in text or text[:1] in (" ", "\t"):
            return None  # a folded line (obs-fold): aiohttp's parser decides
        # llhttp checked every line: a token, a colon, a value.
        pairs = [(name, value.strip(" \t")) for name, _, value in
                 (line.partition(":") for line in text.split("\r\n"))] if text else []
        if len(pairs) > MAX_HEADERS:
            return None
        headers = CIMultiDict(pairs)
        if "Transfer-Encoding" in headers or "Expect" in headers or "Upgrade" in headers:
            return None
        request.header_list, request.headers = pairs, headers
        request.content_length = int(headers.get("Content-Length", 0))  # llhttp accepted it: one, digits
        request.keep_alive = parser.should_keep_alive()
        return request

    async def _read_body(self, request: _Request, head_length: int) -> _Request | None:
        length = request.content_length
        content_type = request.headers.get("Content-Type", "").partition(";")[0].strip().lower()
        if content_type in _FORMS:
            self._hand_over()
            return None
        if length > self.fast.max_request_size:
            await self._refuse_too_large(request, length)
            return None
        need = head_length + length
        deadline: asyncio.TimerHandle | None = None
        expired = False
        if len(self._buf) < need and self.fast.body_timeout is not None:
            def expire() -> None:
                nonlocal expired
                expired = True
                self._wake()

            deadline = self._loop.call_later(self.fast.body_timeout, expire)
        try:
            while len(self._buf) < need:
                if self._closed:
                    return None
                if expired:
                    error = body_timeout_error(cast(float, self.fast.body_timeout), length)
                    self._answer_error(request, error, keep_alive=False)
                    self.transport.close()
                    return None
                await self._more()
        finally:
            if deadline is not None:
                deadline.cancel()
        buf = self._buf
        request.body = bytes(buf[head_length:need])
        del buf[:need]
        return request

    async def _refuse_too_large(self, request: _Request, length: int) -> None:
        """413 without reading the body (as aiohttp's route: an unknown model is still a 404), then close."""
        error: ConveyorError = RequestTooLarge(
            f"Request body of {length} bytes exceeds max_request_size ({self.fast.max_request_size} bytes)")
        try:
            if request.model is not None:
                self.fast.api.registry.get(request.model, request.version)
        except ConveyorError as exc:
            error = exc
        self._answer_error(request, error, keep_alive=False)
        self.transport.close()

    def _answer_error(self, request: _Request, error: ConveyorError, keep_alive: bool) -> int:
        writer = _Writer(self, choose_request_id(request.headers.get(REQUEST_ID_HEADER, "")), keep_alive)
        status, error_headers, body = error_parts(error)
        writer.complete(status, error_headers, body)
        self.fast.count(status)
        return status

    def _hand_over(self) -> None:
        """aiohttp's connection handler takes the connection, with the bytes not consumed yet."""
        self.fast.connections.discard(self)
        if self._timer is not None:
            self._timer.cancel()
        protocol = self._handover_protocol()
        self.transport.set_protocol(protocol)
        protocol.connection_made(self.transport)
        if self.paused:
            protocol.pause_writing()
        data, self._buf = bytes(self._buf), bytearray()
        if data:
            protocol.data_received(data)

    def _arm_idle_timer(self, loop: asyncio.AbstractEventLoop) -> None:
        # One timer per connection, re-armed lazily: a request does not pay for a timer of its own.
        if self._timer is None:
            self._timer = loop.call_at(self._last_active + KEEPALIVE_TIMEOUT, self._idle_check)

    def _idle_check(self) -> None:
        self._timer = None
        loop = self._loop
        if not self._idle:
            self._timer = loop.call_at(loop.time() + KEEPALIVE_TIMEOUT, self._idle_check)
        elif loop.time() >= self._last_active + KEEPALIVE_TIMEOUT:
            self.transport.close()
        else:
            self._timer = loop.call_at(self._last_active + KEEPALIVE_TIMEOUT, self._idle_check)

    # One request ---------------------------------------------------------------------------------

    async def _serve(self, request: _Request) -> bool:
        """Answer one request; returns whether the connection stays open."""
        fast = self.fast
        started = time.monotonic()
        headers = request.headers
        keep_alive = request.keep_alive and not self._close_when_idle
        writer = _Writer(self, choose_request_id(headers.get(REQUEST_ID_HEADER, "")), keep_alive)
        fast.in_flight.enter()
        try:
            if request.model is None:  # GET /ping: open, like aiohttp's route
                status, body = fast.api.ping_result()
                writer.complete(status, {"Content-Type": "application/json; charset=utf-8"}, _json(body))
            elif fast.in_flight.closing:
                writer.keep_alive = keep_alive = False
                status, error_headers, payload = error_parts(ServiceUnavailable(SHUTTING_DOWN_MESSAGE))
                writer.complete(status, error_headers, payload)
            else:
                await self._predict(request, headers, writer, started)
        except ConveyorError as exc:
            if writer.status:
                return False  # a response is on its way: it cannot become an error response
            status, error_headers, payload = error_parts(exc)
            writer.complete(status, error_headers, payload)
        except Exception as exc:  # a bug: answer 500 JSON when nothing was written, keep serving
            log.exception("unhandled error in %s %s", request.method.decode(), request.target.decode("latin-1"))
            if writer.status:
                return False
            status, error_headers, payload = error_parts(ConveyorError(f"internal error: {type(exc).__name__}"))
            writer.complete(status, error_headers, payload)
        finally:
            fast.in_flight.leave()
        fast.count(writer.status)
        if fast.access_log is not None and fast.access_log.isEnabledFor(logging.INFO):
            fast.access_log.info('%s "%s %s HTTP/1.1" %d %d', self._peer(), request.method.decode(),
                                 request.target.decode("latin-1"), writer.status, writer.size)
        return keep_alive and not self._closed

    async def _predict(self, request: _Request, headers: CIMultiDict[str], writer: _Writer, started: float) -> None:
        fast = self.fast
        fast.authorizer.check_token("inference", headers.get("Authorization"))
        assert request.model is not None
        model = fast.api.registry.get(request.model, request.version)
        parameters = [InputParameter(name, "", value.encode()) for name, value in
                      parse_qsl(request.query.decode("utf-8", "surrogateescape"), keep_blank_values=True)] if request.query else []
        parameters.append(InputParameter("body", headers.get("Content-Type", ""), request.body))
        await fast.api.run(model, writer.rid, headers, parameters, request.explain, choose_mode((1, 1), headers),
                           writer, started, request.header_list)

    def _peer(self) -> str:
        peer = self.transport.get_extra_info("peername")
        return str(peer[0]) if isinstance(peer, tuple) and peer else "-"


def _segment(raw: bytes) -> str:
    text = raw.decode("utf-8", "surrogateescape")
    return unquote(text) if "%" in text else text


def _json(body: Any) -> bytes:
    return json.dumps(body, indent=2).encode()
