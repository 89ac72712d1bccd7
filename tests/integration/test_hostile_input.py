"""Bad input on every HTTP API (inference, management, metrics): each gets a 4xx with TorchServe's
JSON error ``{"code", "type", "message"}``, and the server keeps serving (a normal request is
checked after every case). Raw sockets, so the bytes are exactly what a hostile client sends.
(The OpenAI routes have their own tests; the frontend's side of the worker socket codec is fuzzed
in test_supervision.py.)"""

from __future__ import annotations

import json
import socket
from pathlib import Path
from collections.abc import Iterator

import pytest
import requests

from tests.integration.server import ConveyorProcess, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

MAX_CONNECTIONS = 6


@pytest.fixture(scope="module")
def server(model_store: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ConveyorProcess]:
    with ConveyorProcess(tmp_path_factory.mktemp("hostile"), model_store=model_store, models=["echo=echo.mar"],
                         properties={"default_workers_per_model": "1", "max_connections": str(MAX_CONNECTIONS),
                                     "request_body_timeout": "1"}) as proc:
        yield proc


def exchange(port: int, data: bytes, half_close: bool = False, until: int | None = None) -> list[tuple[int, bytes]]:
    """Send raw bytes, read until the server closes (or ``until`` whole responses are in); returns
    every (status, body) answered."""
    with socket.create_connection(("127.0.0.1", port), timeout=20) as sock:
        sock.sendall(data)
        if half_close:
            sock.shutdown(socket.SHUT_WR)
        received = b""
        while chunk := sock.recv(65536):
            received += chunk
            if until is not None and len(parse_responses(received)) >= until:
                break
    return parse_responses(received)


def parse_responses(data: bytes) -> list[tuple[int, bytes]]:
    """Whole responses (head + Content-Length body) in ``data``; a partial one at the end is left out."""
    out = []
    while b"\r\n\r\n" in data:
        head, _, rest = data.partition(b"\r\n\r\n")
        lines = head.split(b"\r\n")
        status = int(lines[0].split()[1])
        headers = dict(line.split(b": ", 1) for line in lines[1:])
        length = int(headers.get(b"Content-Length", b"0"))
        if len(rest) < length:
            break
        out.append((status, rest[:length]))
        data = rest[length:]
    return out


def request(method: str, path: bytes | str, headers: dict[str, str] | None = None, body: bytes = b"",
            extra: bytes = b"") -> bytes:
    target = path.encode() if isinstance(path, str) else path
    lines = [f"{k}: {v}" for k, v in {"Host": "x", "Connection": "close", **(headers or {})}.items()]
    if body and "Content-Length" not in (headers or {}):
        lines.append(f"Content-Length: {len(body)}")
    return method.encode() + b" " + target + b" HTTP/1.1\r\n" + "\r\n".join(lines).encode() + extra + b"\r\n\r\n" + body


def assert_json_error(status: int, body: bytes, expected: int, says: str = "") -> None:
    assert status == expected, (status, body[:300])
    error = json.loads(body)
    assert error["code"] == expected and error["type"].endswith("Exception") and error["message"], error
    assert says in error["message"], error["message"]


def assert_serving(server: ConveyorProcess) -> None:
    reply = requests.post(f"{server.inference}/predictions/echo", data=b"still here",
                          headers={"Content-Type": "text/plain"}, timeout=20)
    assert reply.status_code == 200 and reply.text == "still here"
    assert requests.get(f"{server.management}/models/echo", timeout=20).status_code == 200
    assert requests.get(f"{server.metrics}/metrics", timeout=20).status_code == 200


JSON = {"Content-Type": "application/json"}
NOT_A_FRAME = b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + b"\x00" * 40  # a TLS ClientHello's start

# (api, raw request, status, part of the message)
CASES = {
    # Malformed JSON where JSON is parsed (the register body), and wrong types inside it.
    "register-json-truncated": ("management", request("POST", "/models", JSON, b'{"url": "echo.mar"'), 400, "not valid JSON"),
    "register-json-array": ("management", request("POST", "/models", JSON, b'["echo.mar"]'), 400, "JSON object"),
    "register-json-deep": ("management", request("POST", "/models", JSON, b"[" * 100_000), 400, "not valid JSON"),
    "register-json-invalid-utf8": ("management", request("POST", "/models", JSON, b'{"url": "\xff\xfe"}'), 400, "not valid JSON"),
    "register-json-url-not-string": ("management", request("POST", "/models", JSON, b'{"url": 5}'), 400, "url is required"),
    "register-json-bool-workers": ("management", request("POST", "/models", JSON, b'{"url": "echo.mar", "initial_workers": true}'), 400, "initial_workers"),
    "register-json-float-workers": ("management", request("POST", "/models", JSON, b'{"url": "echo.mar", "initial_workers": 1.5}'), 400, "initial_workers"),
    "register-json-huge-number": ("management", request("POST", "/models", JSON, b'{"url": "echo.mar", "batch_size": 1e999}'), 400, "batch_size"),
    "register-json-name-not-string": ("management", request("POST", "/models", JSON, b'{"url": "echo.mar", "model_name": ["x"]}'), 400, "model_name"),
    "register-wrong-content-type": ("management", request("POST", "/models", {"Content-Type": "text/plain"}, b'{"url": "echo.mar"}'), 400, "url is required"),
    # Path tricks in model URLs and names.
    "register-url-dotdot": ("management", request("POST", "/models?url=..%2Fecho.mar"), 404, "Relative path is not allowed"),
    "register-url-encoded-dots": ("management", request("POST", "/models?url=%2e%2e/%2e%2e/etc/passwd"), 404, "Relative path is not allowed"),
    "register-url-nul": ("management", request("POST", "/models?url=echo.mar%00.txt"), 400, "control characters"),
    "register-url-outside-store": ("management", request("POST", "/models?url=/etc/passwd"), 400, "outside the model store"),
    "register-url-file-outside-store": ("management", request("POST", "/models?url=file:///etc/passwd"), 400, "outside the model store"),
    "register-name-dotdot": ("management", request("POST", "/models?url=echo.mar&model_name=..%2Fevil"), 400, "model_name"),
    "describe-dotdot": ("management", request("GET", "/models/..%2F..%2Fetc%2Fpasswd"), 404, "Model not found"),
    "describe-encoded-dots": ("management", request("GET", "/models/%2e%2e/%2e%2e"), 404, "not found"),
    "describe-nul": ("management", request("GET", "/models/echo%00"), 404, "Model not found"),
    "describe-version-dotdot": ("management", request("GET", "/models/echo/..%2F1.0"), 404, "does not exist"),
    "describe-invalid-utf8-escaped": ("management", request("GET", "/models/%ff%fe"), 404, "Model not found"),
    "describe-invalid-utf8-raw": ("management", request("GET", b"/models/\xff\xfe"), 400, "Invalid char"),
    "unregister-nul": ("management", request("DELETE", "/models/echo%00"), 404, "Model not found"),
    # Negative or absurd query parameters.
    "list-limit-negative": ("management", request("GET", "/models?limit=-1"), 400, "limit"),
    "list-limit-absurd": ("management", request("GET", "/models?limit=1000000000000"), 400, "limit"),
    "list-token-negative": ("management", request("GET", "/models?next_page_token=-5"), 400, "next_page_token"),
    "list-limit-invalid-utf8": ("management", request("GET", "/models?limit=%ff"), 400, "limit"),
    "scale-min-negative": ("management", request("PUT", "/models/echo?min_worker=-1"), 400, "min_worker"),
    "scale-min-absurd": ("management", request("PUT", "/models/echo?min_worker=1000000000000"), 400, "min_worker"),
    "scale-max-text": ("management", request("PUT", "/models/echo?max_worker=abc"), 400, "max_worker"),
    "scale-synchronous-maybe": ("management", request("PUT", "/models/echo?synchronous=maybe"), 400, "synchronous"),
    "register-workers-negative": ("management", request("POST", "/models?url=echo.mar&initial_workers=-1"), 400, "initial_workers"),
    "register-delay-absurd": ("management", request("POST", "/models?url=echo.mar&max_batch_delay=1000000000000"), 400, "max_batch_delay"),
    # Inference: unknown names with path tricks, wrong and broken bodies.
    "predict-dotdot": ("inference", request("POST", "/predictions/..%2F..%2Fetc%2Fpasswd", body=b"x"), 404, "Model not found"),
    "predict-encoded-dots": ("inference", request("POST", "/predictions/%2e%2e", body=b"x"), 404, "not found"),
    "predict-nul": ("inference", request("POST", "/predictions/echo%00", body=b"x"), 404, "Model not found"),
    "predict-version-dotdot": ("inference", request("POST", "/predictions/echo/..%2F..%2F1.0", body=b"x"), 404, "does not exist"),
    "predict-invalid-utf8-raw": ("inference", request("POST", b"/predictions/\xc3\x28", body=b"x"), 400, "Invalid char"),
    "multipart-no-boundary": ("inference", request("POST", "/predictions/echo", {"Content-Type": "multipart/form-data"}, b"abc"), 400, "multipart"),
    "multipart-truncated": ("inference", request("POST", "/predictions/echo", {"Content-Type": "multipart/form-data; boundary=XX"},
                                                 b"--XX\r\nContent-Disposition: form-data; name=a\r\n\r\nabc"), 400, "multipart"),
    "form-invalid-utf8": ("inference", request("POST", "/predictions/echo", {"Content-Type": "application/x-www-form-urlencoded"},
                                               b"a=%ff\xfe"), 400, "form"),
    "header-huge": ("inference", request("POST", "/predictions/echo", {"X-Big": "a" * 20_000}, b"x"), 400, "8190"),
    "headers-too-many": ("inference", request("POST", "/predictions/echo", {f"X-H{i}": "v" for i in range(200)}, b"x"), 400, "headers"),
    "content-length-twice": ("inference", request("POST", "/predictions/echo", {"Content-Length": "1"}, b"xy",
                                                  extra=b"\r\nContent-Length: 2"), 400, "Content-Length"),
    "content-length-and-chunked": ("inference", request("POST", "/predictions/echo", {"Content-Length": "5"}, b"0\r\n\r\n",
                                                        extra=b"\r\nTransfer-Encoding: chunked"), 400, "Transfer-Encoding"),
    "content-length-negative": ("inference", request("POST", "/predictions/echo", {"Content-Length": "-1"}, b"x"), 400, "Content-Length"),
    "method-unknown": ("inference", b"FOO / HTTP/1.1\r\nHost: x\r\n\r\n", 400, "method"),
    "not-http": ("inference", NOT_A_FRAME, 400, "HTTPS"),
    # Metrics.
    "metrics-post": ("metrics", request("POST", "/metrics", body=b"x"), 405, "not allowed"),
    "metrics-dotdot": ("metrics", request("GET", "/metrics/..%2F..%2Fetc"), 404, "not found"),
    "metrics-invalid-utf8-raw": ("metrics", request("GET", b"/metrics\xff"), 400, "Invalid char"),
    "metrics-header-huge": ("metrics", request("GET", "/metrics", {"X-Big": "b" * 20_000}), 400, "8190"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_request_gets_a_json_4xx(server: ConveyorProcess, case: str) -> None:
    api, raw, status, says = CASES[case]
    responses = exchange(server.ports[api], raw)
    assert responses, "the server closed the connection without an answer"
    assert_json_error(*responses[-1], status, says)
    assert_serving(server)


def test_content_length_lies(server: ConveyorProcess) -> None:
    # Announces 100 bytes, sends 5, then waits: 408 once request_body_timeout (1 s here) passed.
    port = server.ports["inference"]
    # (The server then lingers a few seconds for the rest of the body before it closes: not awaited.)
    [(status, body)] = exchange(port, request("POST", "/predictions/echo", {"Content-Length": "100"}, b"hello"), until=1)
    assert_json_error(status, body, 408, "request_body_timeout=1")
    # Announces 100 bytes, sends 5, then closes its side: nobody to answer; the server stays up.
    exchange(port, request("POST", "/predictions/echo", {"Content-Length": "100"}, b"hello"), half_close=True)
    # Announces 1 byte, sends more: the rest is read as the next request — junk gets 400, a
    # smuggled request is just a request (here one no route takes: 405), never part of the body.
    keep = {"Content-Length": "1", "Connection": "keep-alive"}
    responses = exchange(port, request("POST", "/predictions/echo", keep, b"xGARBAGE\r\n\r\n"))
    assert_json_error(*responses[-1], 400, "method")
    smuggled = b"xGET / HTTP/1.1\r\nHost: y\r\nConnection: close\r\n\r\n"
    first, second = exchange(port, request("POST", "/predictions/echo", keep, smuggled))
    assert first == (200, b"x")
    assert_json_error(*second, 405, "not allowed")
    assert_serving(server)


def test_connections_are_bounded(server: ConveyorProcess) -> None:
    port = server.ports["metrics"]
    held: list[socket.socket] = []
    try:
        for _ in range(MAX_CONNECTIONS):  # keep-alive connections, each known to the server (answered once)
            sock = socket.create_connection(("127.0.0.1", port), timeout=20)
            held.append(sock)
            sock.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
            head = b""
            while b"\r\n\r\n" not in head:
                head += sock.recv(1)
            assert head.startswith(b"HTTP/1.1 200")
        [(status, body)] = exchange(port, request("GET", "/metrics"))
        assert_json_error(status, body, 503, f"max_connections={MAX_CONNECTIONS}")
    finally:
        for sock in held:
            sock.close()
    # Each listener counts its own connections, and closed ones free their slot.
    assert requests.get(f"{server.inference}/ping", timeout=20).status_code == 200
    assert wait_until(lambda: exchange(port, request("GET", "/metrics"))[-1][0] == 200, timeout=10)
    assert_serving(server)
