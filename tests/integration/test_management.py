"""Management API against a real server: register, describe, scale, versions, unregister, errors."""

from __future__ import annotations

import functools
import http.server
import shutil
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests

from tests.integration.server import EXAMPLES, ConveyorProcess, build_mar, pid_alive, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]


def echo_ok(server: ConveyorProcess, model: str, version: str = "") -> bool:
    path = f"{model}/{version}" if version else model
    response = requests.post(f"{server.inference}/predictions/{path}", data=b"ping",
                             headers={"Content-Type": "text/plain"}, timeout=30)
    return response.status_code == 200 and response.content == b"ping"


def test_register_describe_scale_unregister(server: ConveyorProcess, model_store: Path) -> None:
    mgmt = server.management
    response = requests.post(f"{mgmt}/models", params={"url": "echo.mar", "model_name": "echo2",
                                                       "initial_workers": "1", "synchronous": "true"}, timeout=60)
    assert response.status_code == 200, response.text
    assert response.json()["status"] == 'Model "echo2" Version: 1.0 registered with 1 initial workers'
    assert echo_ok(server, "echo2")

    desc = server.describe("echo2")
    assert desc["modelName"] == "echo2" and desc["modelVersion"] == "1.0" and desc["modelUrl"] == "echo.mar"
    assert desc["batchSize"] == 8 and desc["maxBatchDelay"] == 5 and desc["loadedAtStartup"] is False
    assert desc["jobQueueStatus"] == {"remainingCapacity": 100, "pendingRequests": 0}
    assert [w["status"] for w in desc["workers"]] == ["READY"] and desc["workers"][0]["pid"] > 0

    scaled = requests.put(f"{mgmt}/models/echo2", params={"min_worker": "2", "synchronous": "true"}, timeout=60)
    assert scaled.status_code == 200 and scaled.json()["status"] == "Workers scaled to 2 for model: echo2"
    workers = server.describe("echo2")["workers"]
    assert len(workers) == 2 and all(w["status"] == "READY" for w in workers)
    pids = [w["pid"] for w in workers]
    assert len(set(pids)) == 2

    down = requests.put(f"{mgmt}/models/echo2/1.0", params={"min_worker": "1", "synchronous": "true"}, timeout=60)
    assert down.status_code == 200, down.text
    remaining = server.describe("echo2")["workers"]
    assert len(remaining) == 1 and remaining[0]["pid"] == pids[0]  # the newest worker was drained
    assert wait_until(lambda: not pid_alive(pids[1]), timeout=15)
    assert echo_ok(server, "echo2")

    gone = requests.delete(f"{mgmt}/models/echo2", timeout=60)
    assert gone.status_code == 200 and gone.json() == {"status": 'Model "echo2" unregistered'}
    assert requests.get(f"{mgmt}/models/echo2", timeout=10).status_code == 404
    assert wait_until(lambda: not pid_alive(pids[0]), timeout=15)


def test_async_scale_returns_202(server: ConveyorProcess) -> None:
    mgmt = server.management
    requests.post(f"{mgmt}/models", params={"url": "echo.mar", "model_name": "echo_async", "initial_workers": "1"},
                  timeout=60).raise_for_status()
    try:
        response = requests.put(f"{mgmt}/models/echo_async", params={"min_worker": "2"}, timeout=10)
        assert response.status_code == 202 and response.json() == {"status": "Processing worker updates..."}
        assert wait_until(lambda: [w["status"] for w in server.describe("echo_async")["workers"]] == ["READY"] * 2,
                          timeout=30)
    finally:
        requests.delete(f"{mgmt}/models/echo_async", timeout=60)


def test_list_models_paginates(server: ConveyorProcess) -> None:
    everything = requests.get(f"{server.management}/models", timeout=10).json()
    names = [m["modelName"] for m in everything["models"]]
    assert names == sorted(names) and {"echo", "streaming"} <= set(names) and "nextPageToken" not in everything
    first = requests.get(f"{server.management}/models", params={"limit": "1"}, timeout=10).json()
    assert first["models"] == everything["models"][:1] and first["nextPageToken"] == "1"
    second = requests.get(f"{server.management}/models", params={"limit": "1", "next_page_token": "1"}, timeout=10).json()
    assert second["models"] == everything["models"][1:2]


def test_versions_and_set_default(server: ConveyorProcess, model_store: Path) -> None:
    mgmt = server.management
    # Inside the model store: the register API refuses paths outside it (allow_paths_outside_model_store).
    (model_store / "v2").mkdir(exist_ok=True)
    build_mar(model_store / "v2", "echo", EXAMPLES / "echo" / "echo_handler.py", EXAMPLES / "echo" / "model-config.yaml",
              version="2.0")
    response = requests.post(f"{mgmt}/models", params={"url": "v2/echo.mar", "initial_workers": "1"}, timeout=60)
    assert response.status_code == 200, response.text
    try:
        everything = requests.get(f"{mgmt}/models/echo/all", timeout=10).json()
        assert [d["modelVersion"] for d in everything] == ["1.0", "2.0"]
        assert requests.delete(f"{mgmt}/models/echo/1.0", timeout=10).status_code == 403  # the default
        made = requests.put(f"{mgmt}/models/echo/2.0/set-default", timeout=10)
        assert made.status_code == 200
        assert server.describe("echo")["modelVersion"] == "2.0"
        assert echo_ok(server, "echo") and echo_ok(server, "echo", "1.0")
        missing = requests.put(f"{mgmt}/models/echo/7.0/set-default", timeout=10)
        assert missing.status_code == 404 and missing.json()["type"] == "ModelVersionNotFoundException"
    finally:
        requests.put(f"{mgmt}/models/echo/1.0/set-default", timeout=10)
        requests.delete(f"{mgmt}/models/echo/2.0", timeout=60)
    assert [d["modelVersion"] for d in requests.get(f"{mgmt}/models/echo/all", timeout=10).json()] == ["1.0"]


def test_conflict_bad_request_and_no_worker_errors(server: ConveyorProcess) -> None:
    mgmt = server.management
    duplicate = requests.post(f"{mgmt}/models", params={"url": "echo.mar"}, timeout=60)
    assert duplicate.status_code == 409 and duplicate.json()["type"] == "ConflictStatusException"

    no_url = requests.post(f"{mgmt}/models", timeout=10)
    assert no_url.status_code == 400 and no_url.json()["message"] == "Parameter url is required."
    missing = requests.post(f"{mgmt}/models", params={"url": "nothing.mar"}, timeout=10)
    assert missing.status_code == 404
    bad_int = requests.put(f"{mgmt}/models/echo", params={"min_worker": "many"}, timeout=10)
    assert bad_int.status_code == 400 and "min_worker" in bad_int.json()["message"]
    inverted = requests.put(f"{mgmt}/models/echo", params={"min_worker": "2", "max_worker": "1"}, timeout=10)
    assert inverted.status_code == 400

    zero = requests.post(f"{mgmt}/models", params={"url": "echo.mar", "model_name": "idle", "initial_workers": "0"},
                         timeout=60)
    assert zero.status_code == 200 and "0 initial workers" in zero.json()["status"]
    try:
        busy = requests.post(f"{server.inference}/predictions/idle", data=b"x", timeout=10)
        assert busy.status_code == 503 and busy.headers["Retry-After"] == "1"
        assert busy.json()["code"] == 503 and busy.json()["type"] == "ServiceUnavailableException"
    finally:
        requests.delete(f"{mgmt}/models/idle", timeout=60)


def test_model_api_disabled_gives_405_and_full_queue_503(model_store: Path, tmp_path: Path) -> None:
    with ConveyorProcess(tmp_path, model_store=model_store, models=["echo=echo.mar", "streaming=streaming.mar"],
                         args=(), properties={"default_workers_per_model": "1", "job_queue_size": "2"}) as server:
        # streaming: continuous batching, batchSize 4: 4 slow streams run, 2 more wait, the next is refused.
        url = f"{server.inference}/predictions/streaming"
        slow = {"n": 20, "step_ms": 100}
        with ThreadPoolExecutor(6) as pool:
            streams = [pool.submit(requests.post, url, json=slow, stream=True, timeout=60) for _ in range(4)]
            assert wait_until(lambda: server.describe("streaming")["jobQueueStatus"]["pendingRequests"] == 0
                              and all(s.done() for s in streams), timeout=20)
            queued = [pool.submit(requests.post, url, json=slow, timeout=60) for _ in range(2)]
            assert wait_until(lambda: server.describe("streaming")["jobQueueStatus"]["pendingRequests"] == 2,
                              timeout=20)
            full = requests.post(url, json=slow, timeout=10)
            assert full.status_code == 503 and full.headers["Retry-After"] == "1"
            assert full.json()["code"] == 503 and "queue is full" in full.json()["message"]
            for stream in streams:
                stream.result().close()  # client disconnects: the jobs are cancelled
            assert all(q.result().status_code == 200 for q in queued)

        register = requests.post(f"{server.management}/models", params={"url": "echo.mar", "model_name": "e2"},
                                 timeout=10)
        assert register.status_code == 405 and register.json()["type"] == "MethodNotAllowedException"
        assert requests.delete(f"{server.management}/models/echo", timeout=10).status_code == 405
        # Scaling and describing stay available, as in TorchServe.
        assert requests.get(f"{server.management}/models/echo", timeout=10).status_code == 200
        pids = server.worker_pids("echo")
    assert pids and wait_until(lambda: not any(pid_alive(p) for p in pids), timeout=15)  # no orphans after stop


def test_scale_down_drains_running_work_and_answers_the_queue(server: ConveyorProcess) -> None:
    """Scale to 0 while 4 streams run and 1 waits: the streams finish whole, the waiting one gets 503."""
    mgmt = server.management
    requests.post(f"{mgmt}/models", params={"url": "streaming.mar", "model_name": "drain_me", "initial_workers": "1"},
                  timeout=60).raise_for_status()
    url = f"{server.inference}/predictions/drain_me"
    body = {"n": 10, "step_ms": 100}

    running: list[int] = []

    def stream() -> list[int]:
        with requests.post(url, json=body, stream=True, timeout=60) as response:
            seen = []
            for chunk in response.iter_content(chunk_size=None):
                if not seen:
                    running.append(1)  # this stream is in the batch
                seen.append(int(chunk.split(b'"i": ')[1].split(b",")[0]))
            return seen

    try:
        with ThreadPoolExecutor(5) as pool:
            streams = [pool.submit(stream) for _ in range(4)]
            assert wait_until(lambda: len(running) == 4, timeout=20)
            waiting = pool.submit(requests.post, url, json=body, timeout=60)
            assert wait_until(lambda: server.describe("drain_me")["jobQueueStatus"]["pendingRequests"] == 1, timeout=20)
            scaled = requests.put(f"{mgmt}/models/drain_me", params={"min_worker": "0", "synchronous": "true"},
                                  timeout=60)
            assert scaled.status_code == 200, scaled.text
            assert all(s.result() == list(range(10)) for s in streams)  # in-flight work finished whole
            refused = waiting.result()
            assert refused.status_code == 503 and "no worker" in refused.json()["message"]
        assert server.describe("drain_me")["workers"] == []
    finally:
        requests.delete(f"{mgmt}/models/drain_me", timeout=60)


def test_register_from_http_url_downloads_into_the_store(server: ConveyorProcess, model_store: Path,
                                                         tmp_path: Path) -> None:
    served = tmp_path / "served"
    served.mkdir()
    shutil.copy(model_store / "echo.mar", served / "remote_echo.mar")
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(served))
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{httpd.server_address[1]}/remote_echo.mar"
        response = requests.post(f"{server.management}/models",
                                 params={"url": url, "model_name": "remote_echo", "initial_workers": "1"}, timeout=60)
        assert response.status_code == 200, response.text
        assert (model_store / "remote_echo.mar").is_file()
        assert echo_ok(server, "remote_echo")
        assert requests.delete(f"{server.management}/models/remote_echo", timeout=60).status_code == 200
        assert not (model_store / "remote_echo.mar").exists()
        missing = requests.post(f"{server.management}/models", params={"url": url.replace("remote_", "nope_")},
                                timeout=60)
        assert missing.status_code == 500 and "HTTP 404" in missing.json()["message"]
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join(5)
