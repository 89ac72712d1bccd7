"""The app factory and lifecycle in-process (no models): listeners, extra services, clean stop."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from frontend.config import load_server_config
from frontend.server import ConveyorServer, StartupModel

pytestmark = pytest.mark.timeout(20)


class RecordingService:
    name = "recording service"

    def __init__(self, server: ConveyorServer, events: list[str]) -> None:
        self.server = server
        self.events = events

    async def start(self) -> None:
        self.events.append("start")

    async def stop(self, grace: float) -> None:
        self.events.append(f"stop {grace:g}")


def test_start_serve_and_stop_cleanly() -> None:
    config = load_server_config(None, overrides={
        "inference_address": "http://127.0.0.1:0", "management_address": "http://127.0.0.1:0",
        "metrics_address": "http://127.0.0.1:0", "disable_token_authorization": "true",
    })
    events: list[str] = []

    async def main() -> None:
        server = ConveyorServer(config, services=[lambda s: RecordingService(s, events)])
        await server.start()
        work_dir = server.registry.work_dir
        assert work_dir.is_dir() and events == ["start"]
        ports = server.bound_ports()
        assert set(ports) == {"inference", "management", "metrics"} and all(ports.values())
        async with aiohttp.ClientSession() as session:
            async with session.get(f"http://127.0.0.1:{ports['inference']}/ping") as response:
                assert response.status == 200 and response.headers["x-request-id"]
            async with session.get(f"http://127.0.0.1:{ports['management']}/models") as response:
                assert (await response.json()) == {"models": []}
            async with session.get(f"http://127.0.0.1:{ports['metrics']}/metrics") as response:
                assert "conveyor_http_requests_total" in await response.text()
        await server.stop()
        assert events == ["start", "stop 30"] and not work_dir.exists()

    asyncio.run(main())


def test_startup_model_entries() -> None:
    assert StartupModel.parse("echo=echo.mar") == StartupModel("echo.mar", "echo")
    assert StartupModel.parse("echo.mar") == StartupModel("echo.mar", None)
