"""Worker supervision through the real server: a hung worker (responseTimeout), a worker that
exits mid-request, a handler error. Each fails only its request, with a message naming the cause,
and the model serves the next request."""

from __future__ import annotations

from pathlib import Path
from collections.abc import Iterator

import pytest
import requests

from tests.integration.server import ConveyorProcess, build_mar

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]
HANDLERS = Path(__file__).parent / "handlers"


@pytest.fixture(scope="module")
def faulty(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ConveyorProcess]:
    store = tmp_path_factory.mktemp("faulty_store")
    config = store / "faulty-config.yaml"
    config.write_text("minWorkers: 1\nbatchSize: 1\nmaxBatchDelay: 1\nresponseTimeout: 1\n")
    build_mar(store, "faulty", HANDLERS / "faulty_handler.py", config)
    with ConveyorProcess(tmp_path_factory.mktemp("faulty"), model_store=store, models=["faulty.mar"]) as server:
        yield server


def call(server: ConveyorProcess, body: str) -> requests.Response:
    return requests.post(f"{server.inference}/predictions/faulty", data=body.encode(),
                         headers={"Content-Type": "text/plain"}, timeout=30)


def test_handler_error_fails_only_that_request(faulty: ConveyorProcess) -> None:
    failed = call(faulty, "error")
    assert failed.status_code >= 500 and failed.json()["message"]
    assert call(faulty, "fine").text == "fine"


@pytest.mark.parametrize("body, cause", [("hang", "responseTimeout=1"), ("exit", "exit code 3")])
def test_dead_or_hung_worker_is_replaced(faulty: ConveyorProcess, body: str, cause: str) -> None:
    pid = faulty.worker_pids("faulty")[0]
    failed = call(faulty, body)
    assert failed.status_code == 500
    error = failed.json()
    assert error["type"] == "WorkerException" and cause in error["message"] and "worker" in error["message"]
    # The replacement loads after the back-off (first retry: at once) and serves the next request.
    recovered = call(faulty, "again")
    assert recovered.status_code == 200 and recovered.text == "again"
    desc = faulty.describe("faulty")
    assert desc["workers"][0]["pid"] != pid and desc["workers"][0]["restarts"] >= 1
