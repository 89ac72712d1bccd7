"""The HTTP layer without workers: payload parsing, sequence headers, sinks, error mapping, streaming."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from multidict import CIMultiDict, CIMultiDictProxy

from backend.protocol import RequestFlags, WireResult
from frontend.api.common import error_response, make_app
from frontend.api.payload import check_content_length, read_parameters, sequence_fields
from frontend.api.streaming import AiohttpWriter, choose_mode, respond
from frontend.config import load_server_config
from frontend.errors import ConveyorError, QueueFull, SequenceExpired
from frontend.metrics import ServerMetrics
from frontend.api.common import NoAuth
from frontend.sinks import ResponseSink

pytestmark = pytest.mark.timeout(20)


def run_with_client(app: web.Application, body: Callable[[TestClient], Awaitable[None]]) -> None:
    async def main() -> None:
        async with TestClient(TestServer(app)) as client:
            await body(client)

    asyncio.run(main())


def params_app(limit: int = 1000) -> web.Application:
    app = make_app("inference", ServerMetrics(), NoAuth(), client_max_size=limit)

    async def echo_params(request: web.Request) -> web.Response:
        check_content_length(request, limit)
        params = await read_parameters(request, limit)
        return web.json_response([[p.name, p.content_type, p.value.decode()] for p in params])

    app.router.add_post("/p", echo_params)
    return app


def test_parameters_raw_json_query_and_forms() -> None:
    async def body(client: TestClient) -> None:
        raw = await client.post("/p?top=1", data=b"abc", headers={"Content-Type": "application/octet-stream"})
        assert await raw.json() == [["top", "", "1"], ["body", "application/octet-stream", "abc"]]
        assert raw.headers["x-request-id"]
        doc = await client.post("/p", json={"a": 1})
        assert await doc.json() == [["body", "application/json", '{"a": 1}']]
        form = await client.post("/p", data={"x": "1", "y": "2"})
        assert await form.json() == [["x", "", "1"], ["y", "", "2"]]
        multipart = aiohttp.FormData()
        multipart.add_field("field", "v")
        multipart.add_field("file", b"bytes", filename="f.bin", content_type="application/octet-stream")
        parts = await client.post("/p", data=multipart)
        # A part keeps the content type its client declared ("" when none, as requests sends fields).
        assert await parts.json() == [["field", "text/plain; charset=utf-8", "v"],
                                      ["file", "application/octet-stream", "bytes"]]

    run_with_client(params_app(), body)


def test_size_limits_give_json_413() -> None:
    async def body(client: TestClient) -> None:
        declared = await client.post("/p", data=b"x" * 2000)
        assert declared.status == 413 and (await declared.json())["type"] == "RequestEntityTooLargeException"

        async def chunks():  # no Content-Length: the limit is enforced while reading
            for _ in range(10):
                yield b"y" * 500

        streamed = await client.post("/p", data=chunks(), headers={"Content-Type": "text/plain"})
        assert streamed.status == 413 and (await streamed.json())["code"] == 413
        big_part = aiohttp.FormData()
        big_part.add_field("file", b"z" * 5000, filename="f")
        multipart = await client.post("/p", data=big_part)
        assert multipart.status == 413

    run_with_client(params_app(limit=1000), body)


def test_unknown_route_and_method_are_json() -> None:
    async def body(client: TestClient) -> None:
        missing = await client.get("/nowhere")
        assert missing.status == 404 and (await missing.json())["type"] == "ResourceNotFoundException"
        wrong = await client.get("/p")
        assert wrong.status == 405 and (await wrong.json())["type"] == "MethodNotAllowedException"

    run_with_client(params_app(), body)


def test_error_response_carries_retry_after_and_json() -> None:
    response = error_response(QueueFull("model 'm' job queue is full (2 jobs)"))
    assert response.status == 503 and response.headers["Retry-After"] == "1"
    assert json.loads(response.text) == {"code": 503, "type": "ServiceUnavailableException",
                                         "message": "model 'm' job queue is full (2 jobs)"}


def test_sequence_fields_from_configured_headers() -> None:
    cfg = load_server_config(None, overrides={"ts_header_key_sequence_id": "X-Session"})
    seq, flags, generated = sequence_fields(CIMultiDictProxy(CIMultiDict()), cfg)
    assert generated and seq.startswith("ts-seq-") and flags == RequestFlags.SEQUENCE_START
    headers = CIMultiDictProxy(CIMultiDict({"x-SESSION": "abc", "TS_Request_Sequence_End": "1"}))
    seq, flags, generated = sequence_fields(headers, cfg)
    assert (seq, flags, generated) == ("abc", RequestFlags.SEQUENCE_END, False)


def test_sink_keeps_order_types_and_drops_after_close() -> None:
    async def main() -> None:
        sink = ResponseSink()
        sink.deliver(WireResult("r", 200, False, body=b"1"))
        sink.fail_error(SequenceExpired("sequence s of model 'm' expired"))
        first, second = await sink.next(), await sink.next()
        assert first.body == b"1" and second.error.error_type == "SequenceExpiredException"  # type: ignore[union-attr]
        sink.close()
        sink.deliver(WireResult("r", 200, True))
        assert not sink._items

    asyncio.run(main())


def stream_app(results: list[WireResult | tuple[int, str]], extra: dict[str, str] | None = None) -> web.Application:
    """An app whose POST /s answers from a sink preloaded with ``results`` (failures as (status, message))."""
    extra = {"x-extra": "1"} if extra is None else extra
    app = make_app("inference", ServerMetrics(), NoAuth())

    async def handler(request: web.Request) -> web.StreamResponse:
        sink = ResponseSink()
        for item in results:
            if isinstance(item, WireResult):
                sink.deliver(item)
            else:
                sink.fail(*item)
        writer = AiohttpWriter(request)
        await respond(sink, extra, choose_mode(request.version, request.headers), writer)
        return writer.response

    app.router.add_post("/s", handler)
    return app


def test_streamed_results_chunked_sse_and_error_chunk() -> None:
    parts = [WireResult("r", 200, False, content_type="application/json", headers=(("x-h", "v"),), body=b'{"i": 0}'),
             WireResult("r", 200, False, body=b'{"i": 1}'), (500, "worker 9000 died")]

    async def body(client: TestClient) -> None:
        chunked = await client.post("/s")
        assert chunked.status == 200 and chunked.headers["x-h"] == "v" and chunked.headers["x-extra"] == "1"
        text = await chunked.text()
        assert text.startswith('{"i": 0}{"i": 1}') and '"worker 9000 died"' in text
        sse = await client.post("/s", headers={"Accept": "text/event-stream"})
        events = (await sse.text()).split("\n\n")
        assert events[0] == 'data: {"i": 0}' and events[1] == 'data: {"i": 1}'
        assert events[2].startswith("event: error\ndata: ")

    run_with_client(stream_app(parts), body)


def test_handler_error_without_body_becomes_json() -> None:
    async def body(client: TestClient) -> None:
        response = await client.post("/s")
        assert response.status == 507
        assert await response.json() == {"code": 507, "type": "PredictionException", "message": "out of memory"}

    run_with_client(stream_app([WireResult("r", 507, True, message="out of memory")]), body)


def test_conveyor_error_json_shape() -> None:
    assert ConveyorError("boom").to_json() == {"code": 500, "type": "InternalServerException", "message": "boom"}
