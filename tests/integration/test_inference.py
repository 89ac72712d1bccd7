"""Inference API against a real server: ping, echo (raw, JSON, text, forms), batching, errors, streams."""

from __future__ import annotations

import asyncio
import json
import socket

import aiohttp
import pytest
import requests

from tests.integration.server import ConveyorProcess

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]


def test_ping_and_request_id(server: ConveyorProcess) -> None:
    response = requests.get(f"{server.inference}/ping", timeout=10)
    assert response.status_code == 200 and response.json() == {"status": "Healthy"}
    assert response.headers["x-request-id"]
    mine = requests.get(f"{server.inference}/ping", headers={"x-request-id": "trace-42"}, timeout=10)
    assert mine.headers["x-request-id"] == "trace-42"


def test_echo_raw_bytes_text_and_json(server: ConveyorProcess) -> None:
    url = f"{server.inference}/predictions/echo"
    raw = requests.post(url, data=b"\x00\x01binary", headers={"Content-Type": "application/octet-stream"}, timeout=10)
    assert raw.status_code == 200 and raw.content == b"\x00\x01binary"
    assert raw.headers["x-request-id"] and raw.headers["x-batch-size"] == "1"
    text = requests.put(url, data="héllo".encode(), headers={"Content-Type": "text/plain; charset=utf-8"}, timeout=10)
    assert text.status_code == 200 and text.content.decode() == "héllo"
    doc = {"a": [1, 2], "b": "x"}
    reply = requests.post(f"{url}/1.0", json=doc, timeout=10)
    assert reply.status_code == 200 and reply.json() == doc


def test_echo_forms(server: ConveyorProcess) -> None:
    url = f"{server.inference}/predictions/echo"
    form = requests.post(url, data={"name": "conveyor", "n": "3"}, timeout=10)
    assert form.status_code == 200 and form.json() == {"name": "conveyor", "n": "3"}
    multipart = requests.post(url, files={"file": ("a.txt", b"file-bytes", "text/plain")}, data={"field": "v"}, timeout=10)
    assert multipart.status_code == 200 and multipart.json() == {"field": "v", "file": "file-bytes"}


def test_explanations_route(server: ConveyorProcess) -> None:
    response = requests.post(f"{server.inference}/explanations/echo", json={"x": 1}, timeout=10)
    assert response.status_code == 200 and response.json() == {"x": 1}


def test_concurrent_requests_are_batched(server: ConveyorProcess) -> None:
    """echo has batchSize 8, maxBatchDelay 5 ms: 32 concurrent requests must share frames."""

    async def run() -> list[tuple[int, bytes, int]]:
        async with aiohttp.ClientSession() as session:
            async def one(i: int) -> tuple[int, bytes, int]:
                async with session.post(f"{server.inference}/predictions/echo", data=f"r{i}".encode(),
                                        headers={"Content-Type": "text/plain"}) as response:
                    return response.status, await response.read(), int(response.headers["x-batch-size"])
            return await asyncio.gather(*(one(i) for i in range(32)))

    results = asyncio.run(run())
    assert all(status == 200 for status, _, _ in results)
    assert sorted(body for _, body, _ in results) == sorted(f"r{i}".encode() for i in range(32))
    sizes = [size for _, _, size in results]
    assert max(sizes) > 1, sizes
    assert max(sizes) <= 8, sizes


def test_unknown_model_version_and_path_are_json_404(server: ConveyorProcess) -> None:
    for url, kind in ((f"{server.inference}/predictions/nope", "ModelNotFoundException"),
                      (f"{server.inference}/predictions/echo/9.9", "ModelVersionNotFoundException"),
                      (f"{server.inference}/no/such/path", "ResourceNotFoundException")):
        response = requests.post(url, data=b"x", timeout=10)
        assert response.status_code == 404, url
        body = response.json()
        assert body["code"] == 404 and body["type"] == kind and body["message"]
        assert response.headers["x-request-id"]


def test_wrong_method_is_json_405(server: ConveyorProcess) -> None:
    response = requests.delete(f"{server.inference}/predictions/echo", timeout=10)
    assert response.status_code == 405 and response.json()["type"] == "MethodNotAllowedException"


def test_oversized_body_is_refused_before_it_is_read(server: ConveyorProcess) -> None:
    """Only the headers are sent: a 413 that arrives proves the body was never awaited."""
    with socket.create_connection(("127.0.0.1", server.ports["inference"]), timeout=10) as sock:
        sock.sendall(b"POST /predictions/echo HTTP/1.1\r\nHost: x\r\nContent-Type: application/octet-stream\r\n"
                     b"Content-Length: 100000000\r\n\r\n")
        data = b""
        while b"\r\n\r\n" not in data or not data.rstrip().endswith(b"}"):
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 413"), head
    assert json.loads(body)["type"] == "RequestEntityTooLargeException"


def test_streaming_chunked_and_sse(server: ConveyorProcess) -> None:
    url = f"{server.inference}/predictions/streaming"
    with requests.post(url, json={"n": 3}, stream=True, timeout=30) as response:
        assert response.status_code == 200
        assert response.headers.get("Transfer-Encoding") == "chunked"
        chunks = [json.loads(c) for c in response.iter_content(chunk_size=None)]
    assert [c["i"] for c in chunks] == [0, 1, 2]

    with requests.post(url, json={"n": 2}, headers={"Accept": "text/event-stream"}, stream=True, timeout=30) as response:
        assert response.headers["Content-Type"].startswith("text/event-stream")
        events = [line for line in response.iter_lines(decode_unicode=True) if line.startswith("data: ")]
    assert [json.loads(e[len("data: "):])["i"] for e in events] == [0, 1]


def test_single_result_stream_is_a_normal_response(server: ConveyorProcess) -> None:
    response = requests.post(f"{server.inference}/predictions/streaming", json={"n": 1}, timeout=30)
    assert response.status_code == 200 and "chunked" not in response.headers.get("Transfer-Encoding", "")
    assert json.loads(response.content)["i"] == 0
