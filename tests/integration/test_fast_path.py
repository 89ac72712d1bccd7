"""The inference port's fast path (frontend/api/fast_path.py) next to aiohttp on the same port:
what each serves, hand-over at a request boundary, pipelining, split bodies, keep-alive and close,
limits and streams. Raw sockets, so the bytes are exactly what a client sends.

Which side answered is visible: aiohttp adds its ``Server`` header, the fast path does not."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.server import ConveyorProcess, build_mar

HANDLERS = Path(__file__).parent / "handlers"

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]


@pytest.fixture(scope="module")
def server(model_store: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ConveyorProcess]:
    build_mar(model_store, "params", HANDLERS / "params_handler.py")
    with ConveyorProcess(tmp_path_factory.mktemp("fast"), model_store=model_store,
                         models=["echo=echo.mar", "streaming=streaming.mar", "params=params.mar"],
                         properties={"default_workers_per_model": "1", "max_request_size": "1000",
                                     "request_body_timeout": "1"}) as proc:
        yield proc


class Response:
    def __init__(self, status: int, headers: dict[str, str], body: bytes) -> None:
        self.status, self.headers, self.body = status, headers, body

    @property
    def fast(self) -> bool:
        return "server" not in self.headers


def post(path: str, body: bytes, headers: dict[str, str] | None = None, method: str = "POST") -> bytes:
    lines = [f"{method} {path} HTTP/1.1", "Host: test", f"Content-Length: {len(body)}"]
    lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


def get(path: str, headers: dict[str, str] | None = None) -> bytes:
    lines = [f"GET {path} HTTP/1.1", "Host: test"] + [f"{k}: {v}" for k, v in (headers or {}).items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def read_responses(sock: socket.socket, count: int, timeout: float = 20.0) -> tuple[list[Response], bool]:
    """``count`` responses (Content-Length or chunked bodies); True as well if the server then closed."""
    sock.settimeout(timeout)
    data = b""
    out: list[Response] = []
    deadline = time.monotonic() + timeout
    closed = False
    while time.monotonic() < deadline:
        while len(out) < count:
            parsed = _parse_one(data)
            if parsed is None:
                break
            response, data = parsed
            out.append(response)
        if len(out) >= count:
            break
        chunk = sock.recv(65536)
        if not chunk:
            closed = True
            break
        data += chunk
    if len(out) >= count and not closed:
        sock.settimeout(0.3)
        try:
            closed = sock.recv(1) == b""
        except TimeoutError:
            closed = False
    return out, closed


def _parse_one(data: bytes) -> tuple[Response, bytes] | None:
    if b"\r\n\r\n" not in data:
        return None
    head, _, rest = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.lower(): v for k, _, v in (line.partition(": ") for line in lines[1:])}
    status = int(lines[0].split()[1])
    if headers.get("transfer-encoding") == "chunked":
        body = b""
        while True:
            size_line, sep, after = rest.partition(b"\r\n")
            if not sep:
                return None
            size = int(size_line, 16)
            if len(after) < size + 2:
                return None
            body, rest = body + after[:size], after[size + 2:]
            if size == 0:
                return Response(status, headers, body), rest
    length = int(headers.get("content-length", "0"))
    if len(rest) < length:
        return None
    return Response(status, headers, rest[:length]), rest[length:]


def connect(server: ConveyorProcess) -> socket.socket:
    return socket.create_connection(("127.0.0.1", server.ports["inference"]), timeout=20)


def test_predictions_and_ping_are_served_fast_with_request_ids(server: ConveyorProcess) -> None:
    with connect(server) as sock:
        sock.sendall(post("/predictions/echo", b'{"a": 1}', {"Content-Type": "application/json",
                                                             "x-request-id": "client-42"}) + get("/ping"))
        (pred, ping), closed = read_responses(sock, 2)
    assert pred.fast and ping.fast and not closed
    assert pred.status == 200 and json.loads(pred.body) == {"a": 1} and pred.headers["x-batch-size"] == "1"
    assert pred.headers["x-request-id"] == "client-42" and pred.headers["content-type"].startswith("application/json")
    assert ping.status == 200 and json.loads(ping.body) == {"status": "Healthy"} and ping.headers["x-request-id"]


def test_pipelined_requests_in_order_then_hand_over_mid_connection(server: ConveyorProcess) -> None:
    bodies = [f'"{i}"'.encode() for i in range(3)]
    with connect(server) as sock:
        # Fast, fast, an aiohttp route, then a prediction again — all in one write.
        sock.sendall(post("/predictions/echo", bodies[0]) + post("/predictions/echo/1.0", bodies[1], method="PUT")
                     + get("/api-description") + post("/predictions/echo", bodies[2]))
        responses, closed = read_responses(sock, 4)
    assert [r.status for r in responses] == [200, 200, 200, 200] and not closed
    assert [r.fast for r in responses] == [True, True, False, False]  # aiohttp keeps the connection
    assert [responses[0].body, responses[1].body, responses[3].body] == bodies
    assert "openapi" in json.loads(responses[2].body)


def test_first_request_elsewhere_goes_to_aiohttp(server: ConveyorProcess) -> None:
    with connect(server) as sock:
        sock.sendall(get("/models-that-do-not-exist") + post("/predictions/echo", b"x"))
        (missing, pred), _ = read_responses(sock, 2)
    assert missing.status == 404 and not missing.fast and json.loads(missing.body)["code"] == 404
    assert pred.status == 200 and pred.body == b"x" and not pred.fast


def test_body_in_pieces_and_head_split_mid_line(server: ConveyorProcess) -> None:
    raw = post("/predictions/echo", b"0123456789" * 5)
    with connect(server) as sock:
        for piece in (raw[:7], raw[7:40], raw[40:-30], raw[-30:-1], raw[-1:]):
            sock.sendall(piece)
            time.sleep(0.02)
        (response,), closed = read_responses(sock, 1)
    assert response.fast and response.status == 200 and response.body == b"0123456789" * 5 and not closed


def test_connection_close_is_honoured(server: ConveyorProcess) -> None:
    with connect(server) as sock:
        sock.sendall(post("/predictions/echo", b"bye", {"Connection": "close"}))
        (response,), closed = read_responses(sock, 1)
    assert response.fast and response.body == b"bye" and response.headers.get("connection") == "close" and closed


@pytest.mark.parametrize("raw", [
    b"POST /predictions/echo HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n",
    b"POST /predictions/echo HTTP/1.0\r\nHost: t\r\nContent-Length: 3\r\n\r\nabc",
    b"POST /predictions/echo HTTP/1.1\r\nHost: t\r\nContent-Length: 3\r\nExpect: 100-continue\r\n\r\nabc",
], ids=["chunked-body", "http-1.0", "expect"])
def test_unusual_requests_are_handed_over_and_answered(server: ConveyorProcess, raw: bytes) -> None:
    with connect(server) as sock:
        sock.sendall(raw)
        responses, _ = read_responses(sock, 2 if b"Expect" in raw else 1)
    final = responses[-1]
    assert not final.fast and final.status == 200 and final.body == b"abc"


def test_folded_header_is_left_to_aiohttp(server: ConveyorProcess) -> None:
    with connect(server) as sock:
        sock.sendall(b"POST /predictions/echo HTTP/1.1\r\nHost: t\r\nX-Folded: a\r\n b\r\nContent-Length: 3\r\n\r\nabc")
        (response,), closed = read_responses(sock, 1)
    assert not response.fast and response.status == 400 and json.loads(response.body)["code"] == 400 and closed


def test_form_bodies_are_parsed_by_aiohttp(server: ConveyorProcess) -> None:
    with connect(server) as sock:
        sock.sendall(post("/predictions/echo", b"a=1&b=two", {"Content-Type": "application/x-www-form-urlencoded"}))
        (response,), _ = read_responses(sock, 1)
    assert not response.fast and response.status == 200 and json.loads(response.body) == {"a": "1", "b": "two"}


@pytest.mark.parametrize("target, body, headers", [
    ("/predictions/params?x=1&y=%C3%A9&empty=", b'{"k": [1, 2]}', {"Content-Type": "application/json"}),
    ("/predictions/params?x=a+b", "héllo".encode(), {"Content-Type": "text/plain; charset=utf-8"}),
    ("/predictions/params", bytes(range(256)), {"Content-Type": "application/octet-stream", "X-Custom": "v"}),
    ("/predictions/params/1.0?only=query", b"", {}),
], ids=["query-json", "query-text", "binary", "query-only"])
def test_handler_sees_the_same_input_as_through_aiohttp(server: ConveyorProcess, target: str, body: bytes,
                                                         headers: dict[str, str]) -> None:
    with connect(server) as sock:
        sock.sendall(post(target, body, headers))
        (fast,), _ = read_responses(sock, 1)
    with connect(server) as sock:  # HTTP/1.0 goes to aiohttp
        sock.sendall(post(target, body, headers).replace(b"HTTP/1.1", b"HTTP/1.0", 1))
        (slow,), _ = read_responses(sock, 1)
    assert fast.fast and not slow.fast and fast.status == slow.status == 200
    assert json.loads(fast.body) == json.loads(slow.body)
    if "?" in target:
        assert json.loads(fast.body)["params"]["x" if "x=" in target else "only"]


def test_limits_unknown_model_and_oversized_body(server: ConveyorProcess) -> None:
    with connect(server) as sock:
        sock.sendall(post("/predictions/nope", b"x"))
        (missing,), closed = read_responses(sock, 1)
        assert missing.fast and missing.status == 404 and "nope" in json.loads(missing.body)["message"] and not closed
        sock.sendall(post("/predictions/echo", b"y" * 2000))  # max_request_size=1000
        (too_large,), closed = read_responses(sock, 1)
    assert too_large.status == 413 and "max_request_size" in json.loads(too_large.body)["message"] and closed


def test_stalled_body_gets_408_and_close(server: ConveyorProcess) -> None:
    with connect(server) as sock:
        sock.sendall(post("/predictions/echo", b"12345")[:-3])  # 2 of 5 body bytes, then nothing
        (response,), closed = read_responses(sock, 1, timeout=10)
    assert response.status == 408 and "request_body_timeout=1" in json.loads(response.body)["message"] and closed


def test_streams_chunked_and_sse_from_the_fast_path(server: ConveyorProcess) -> None:
    with connect(server) as sock:
        sock.sendall(post("/predictions/streaming", b"3") + post("/predictions/streaming", b"2",
                                                                  {"Accept": "text/event-stream"}))
        (chunked, sse), closed = read_responses(sock, 2)
    assert chunked.fast and chunked.headers["ts_stream_next"] == "true" and not closed
    assert [json.loads(line)["i"] for line in chunked.body.replace(b"}{", b"}\n{").splitlines()] == [0, 1, 2]
    assert sse.headers["content-type"] == "text/event-stream"
    events = [e for e in sse.body.decode().split("\n\n") if e]
    assert [json.loads(e.removeprefix("data: "))["i"] for e in events] == [0, 1]


def test_http_metrics_count_fast_path_answers(server: ConveyorProcess) -> None:
    def count() -> float:
        with socket.create_connection(("127.0.0.1", server.ports["metrics"]), timeout=20) as sock:
            sock.sendall(get("/metrics", {"Connection": "close"}))
            (response,), _ = read_responses(sock, 1)
        for line in response.body.decode().splitlines():
            if line.startswith('conveyor_http_requests_total{api="inference",status_class="4xx"}'):
                return float(line.rsplit(" ", 1)[1])
        return 0.0

    before = count()
    with connect(server) as sock:
        sock.sendall(post("/predictions/nope", b"x") * 3)
        responses, _ = read_responses(sock, 3)
    assert all(r.fast and r.status == 404 for r in responses)
    assert count() == before + 3
