"""KServe v1 / Open Inference v2 routes without workers: route resolution next to the OpenAI routes,
health and readiness (a drain turns readiness false), error shapes, and the tensor helpers."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from backend.protocol import WireResult
from frontend.api.kserve import KServeApi, decode_result, parse_tensor, to_tensor
from frontend.config import load_server_config
from frontend.errors import BadRequest
from frontend.metrics import ServerMetrics
from frontend.models import ModelRegistry
from frontend.server import ConveyorServer

pytestmark = pytest.mark.timeout(20)


def run_with_server(body: Callable[[ConveyorServer, TestClient], Awaitable[None]]) -> None:
    config = load_server_config(None, overrides={"disable_token_authorization": "true"})

    async def main() -> None:
        server = ConveyorServer(config)
        app = server.create_apps()["inference"]
        try:
            async with TestClient(TestServer(app)) as client:
                await body(server, client)
        finally:
            await server.registry.close(1.0)

    asyncio.run(main())


def test_health_and_readiness_follow_the_drain_flag() -> None:
    async def body(server: ConveyorServer, client: TestClient) -> None:
        for path in ("/health", "/v2/health/live"):
            response = await client.get(path)
            assert response.status == 200 and (await response.json())["live"] is True
        ready = await client.get("/v2/health/ready")
        assert ready.status == 200 and await ready.json() == {"ready": True}  # no model wants a worker
        meta = await client.get("/v2")
        assert (await meta.json())["name"] == "conveyor"
        server.in_flight.closing = True  # what stop() does first: every route answers 503 from then on
        ready = await client.get("/v2/health/ready")
        assert ready.status == 503

    run_with_server(body)


def test_readiness_reads_the_drain_flag_itself() -> None:
    """Without the server's middleware in front, the routes still read the flag they were given."""
    draining = False
    config = load_server_config(None, overrides={"disable_token_authorization": "true"})

    async def main() -> None:
        registry = ModelRegistry(config, ServerMetrics())
        app = web.Application()
        KServeApi(registry, config, registry.metrics, lambda: draining).add_routes(app)
        try:
            async with TestClient(TestServer(app)) as client:
                nonlocal draining
                assert (await client.get("/v2/health/ready")).status == 200
                draining = True
                ready = await client.get("/v2/health/ready")
                assert ready.status == 503 and await ready.json() == {"ready": False}
                live = await client.get("/health")  # liveness stays true: a draining pod is not restarted
                assert live.status == 200 and await live.json() == {"live": True, "status": "Draining"}
        finally:
            await registry.close(1.0)

    asyncio.run(main())


def test_kserve_paths_beside_the_openai_routes() -> None:
    async def body(server: ConveyorServer, client: TestClient) -> None:
        # OpenAI's list stays theirs; /v1/models/{m} and :predict are KServe's.
        listing = await client.get("/v1/models")
        assert (await listing.json())["object"] == "list"
        missing = await client.get("/v1/models/nope")
        assert missing.status == 404 and (await missing.json())["error"]["code"] == "model_not_found"
        for path in ("/v1/models/nope:predict", "/v1/models/nope:explain", "/v2/models/nope/infer",
                     "/v2/models/nope/versions/2/infer"):
            response = await client.post(path, json={"instances": [1]})
            assert response.status == 404, path
            assert "does not exist" in (await response.json())["error"]
        for path in ("/v2/models/nope", "/v2/models/nope/ready"):
            response = await client.get(path)
            assert response.status == 404 and "nope" in (await response.json())["error"]
        # The OpenAI routes still answer theirs.
        completions = await client.post("/v1/completions", json={"model": "nope", "prompt": "x"})
        assert completions.status == 404 and "error" in await completions.json()

    run_with_server(body)


def test_parse_tensor_nests_data_to_shape_and_checks_it() -> None:
    flat = {"name": "x", "shape": [2, 3], "datatype": "fp32", "data": [1, 2, 3, 4, 5, 6]}
    assert parse_tensor(0, flat) == {"name": "x", "shape": [2, 3], "datatype": "FP32",
                                     "data": [[1, 2, 3], [4, 5, 6]]}
    nested = {**flat, "data": [[1, 2, 3], [4, 5, 6]]}
    assert parse_tensor(0, nested)["data"] == [[1, 2, 3], [4, 5, 6]]
    text = {"name": "t", "shape": [1], "datatype": "BYTES", "data": ["hello"]}
    assert parse_tensor(0, text)["data"] == "hello"  # TorchServe's envelope: the first element
    for bad in ({**flat, "shape": [4]}, {**flat, "name": ""}, {**flat, "data": 3}, {**flat, "shape": [-1, 2]}, 7):
        with pytest.raises(BadRequest):
            parse_tensor(0, bad)


def test_to_tensor_infers_datatype_and_flattens() -> None:
    assert to_tensor("y", [[1, 2], [3, 4]]) == {"name": "y", "shape": [4], "datatype": "INT64", "data": [1, 2, 3, 4]}
    assert to_tensor("y", 6) == {"name": "y", "shape": [1], "datatype": "INT64", "data": [6]}
    assert to_tensor("y", [0.5, 1])["datatype"] == "FP64"
    assert to_tensor("y", [True, False])["datatype"] == "BOOL"
    assert to_tensor("y", "cat") == {"name": "y", "shape": [1], "datatype": "BYTES", "data": ["cat"]}
    own = {"name": "probs", "shape": [1, 2], "datatype": "FP32", "data": [0.25, 0.75]}
    assert to_tensor("y", own) == own  # a handler's own tensor passes through


def test_decode_result_by_content_type() -> None:
    assert decode_result(WireResult("r", content_type="application/json", body=b'{"a": 1}')) == {"a": 1}
    assert decode_result(WireResult("r", content_type="text/plain", body=b"hi")) == "hi"
    assert decode_result(WireResult("r", content_type="application/octet-stream", body=b"\xff\x00")) == {"b64": "/wA="}
