"""KServe v1 and Open Inference v2 against a real server: documented shapes, batching of instances,
a streaming handler's chunks, a sequence model, errors, and the vLLM gauges on /metrics."""

from __future__ import annotations

import os
import shutil
import sys
import uuid
from pathlib import Path
from typing import Any
from collections.abc import Iterator

import pytest
import requests
import yaml

from tests.integration.server import EXAMPLES, REPO, ConveyorProcess, build_mar

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

ID, START = "ts_request_sequence_id", "ts_request_sequence_start"


@pytest.fixture(scope="module")
def server(model_store: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ConveyorProcess]:
    """echo, streaming and the running-sum example (one worker each), in a store of this module."""
    store = tmp_path_factory.mktemp("kserve_store")
    for archive in ("echo.mar", "streaming.mar"):
        shutil.copy(model_store / archive, store / archive)
    config = yaml.safe_load((EXAMPLES / "stateful" / "sequence_batching" / "model-config.yaml").read_text())
    config.update(minWorkers=1, maxWorkers=1)
    (store / "sum.yaml").write_text(yaml.safe_dump(config))
    build_mar(store, "ksum", EXAMPLES / "stateful" / "sequence_batching" / "running_sum_handler.py", store / "sum.yaml")
    with ConveyorProcess(tmp_path_factory.mktemp("kserve_server"), model_store=store,
                         models=["echo=echo.mar", "streaming=streaming.mar", "ksum=ksum.mar"]) as proc:
        yield proc


def test_v1_ready_predict_and_explain(server: ConveyorProcess) -> None:
    ready = requests.get(f"{server.inference}/v1/models/echo", timeout=10)
    assert ready.status_code == 200
    body = ready.json()
    assert body["name"] == "echo" and body["ready"] is True
    assert body["id"] == "echo" and body["object"] == "model"  # the OpenAI card on the same path

    instances: list[Any] = [{"x": 1}, [1, 2], "text", 7]
    predict = requests.post(f"{server.inference}/v1/models/echo:predict", json={"instances": instances}, timeout=10)
    assert predict.status_code == 200, predict.text
    assert predict.json() == {"predictions": instances}  # in order, one job per instance
    explain = requests.post(f"{server.inference}/v1/models/echo:explain", json={"instances": [1]}, timeout=10)
    assert explain.json() == {"explanations": [1]}


def test_v1_errors(server: ConveyorProcess) -> None:
    bad = requests.post(f"{server.inference}/v1/models/echo:predict", json={"inputs": [1]}, timeout=10)
    assert bad.status_code == 400 and "instances" in bad.json()["error"]
    not_json = requests.post(f"{server.inference}/v1/models/echo:predict", data=b"{", timeout=10)
    assert not_json.status_code == 400 and "JSON" in not_json.json()["error"]
    missing = requests.post(f"{server.inference}/v1/models/nope:predict", json={"instances": [1]}, timeout=10)
    assert missing.status_code == 404 and missing.json() == {"error": "Model with name nope does not exist."}


def test_v2_health_metadata_and_infer(server: ConveyorProcess) -> None:
    assert requests.get(f"{server.inference}/v2/health/live", timeout=10).json()["live"] is True
    assert requests.get(f"{server.inference}/v2/health/ready", timeout=10).json() == {"ready": True}
    assert requests.get(f"{server.inference}/health", timeout=10).status_code == 200
    model_ready = requests.get(f"{server.inference}/v2/models/echo/ready", timeout=10)
    assert model_ready.status_code == 200 and model_ready.json() == {"name": "echo", "ready": True}
    assert requests.get(f"{server.inference}/v2/models/echo/versions/1.0/ready", timeout=10).status_code == 200
    meta = requests.get(f"{server.inference}/v2/models/echo", timeout=10).json()
    assert meta == {"name": "echo", "versions": ["1.0"], "platform": "conveyor", "inputs": [], "outputs": []}

    request: dict[str, Any] = {"id": "req-1", "inputs": [
        {"name": "a", "shape": [2, 2], "datatype": "INT64", "data": [1, 2, 3, 4]},
        {"name": "b", "shape": [1], "datatype": "BYTES", "data": ["hi"]},
    ]}
    infer = requests.post(f"{server.inference}/v2/models/echo/infer", json=request, timeout=10)
    assert infer.status_code == 200, infer.text
    body = infer.json()
    assert body["model_name"] == "echo" and body["model_version"] == "1.0" and body["id"] == "req-1"
    # echo returns what it got: the tensor object, data nested to its shape — passed through as a tensor.
    a, b = body["outputs"]
    assert a == {"name": "a", "shape": [2, 2], "datatype": "INT64", "data": [[1, 2], [3, 4]]}
    assert b == {"name": "b", "shape": [1], "datatype": "BYTES", "data": "hi"}
    bad = requests.post(f"{server.inference}/v2/models/echo/infer",
                        json={"inputs": [{"name": "a", "shape": [3], "datatype": "FP32", "data": [1]}]}, timeout=10)
    assert bad.status_code == 400 and "shape" in bad.json()["error"]


def test_streaming_handler_chunks_are_collected(server: ConveyorProcess) -> None:
    response = requests.post(f"{server.inference}/v1/models/streaming:predict",
                             json={"instances": [{"n": 3}, {"n": 1}]}, timeout=30)
    assert response.status_code == 200, response.text
    first, second = response.json()["predictions"]
    assert [c["i"] for c in first] == [0, 1, 2]
    assert second == {"i": 0, "of": 1}


def test_sequence_model_over_v1_and_v2(server: ConveyorProcess) -> None:
    running_sum = "ksum"
    sid = f"kserve-{uuid.uuid4()}"
    url = f"{server.inference}/v1/models/{running_sum}:predict"
    first = requests.post(url, json={"instances": [1, 2, 3]}, headers={ID: sid, START: "true"}, timeout=10)
    assert first.status_code == 200, first.text
    assert first.json() == {"predictions": [1, 3, 6]}  # START on the first job only: the sum runs on
    assert first.headers[ID] == sid
    tensor: dict[str, Any] = {"name": "n", "shape": [1], "datatype": "INT64", "data": [4]}
    v2 = requests.post(f"{server.inference}/v2/models/{running_sum}/infer", json={"inputs": [tensor]},
                       headers={ID: sid}, timeout=10)
    # The handler reads {"input": ...}-less bodies only as integers: a tensor object is refused (400),
    # and the error keeps KServe's shape and the sequence id.
    assert v2.status_code == 400 and "error" in v2.json() and v2.headers[ID] == sid
    end = requests.post(url, json={"instances": [0]}, headers={ID: sid}, timeout=10)
    assert end.json() == {"predictions": [6]}  # 0 ends the sequence (handler side)
    closed = requests.post(url, json={"instances": [1]}, headers={ID: sid}, timeout=10)
    assert closed.status_code == 410 and closed.headers[ID] == sid


def test_vllm_gauges_on_metrics(server: ConveyorProcess) -> None:
    text = requests.get(f"{server.metrics}/metrics", timeout=10).text
    for name in ("vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc"):
        assert f"# TYPE {name} gauge" in text, name
    counted = requests.get(f"{server.metrics}/metrics", timeout=10).text
    assert 'conveyor_inference_requests_total{model="echo",status_class="2xx"}' in counted


def test_container_entrypoint_serves_the_kserve_layout(model_store: Path, tmp_path: Path) -> None:
    """deploy/docker/entrypoint.sh as the image runs it: config and archives from the mounted
    model directory (KServe's layout), every model in the store loaded, v2 ready."""
    mount = tmp_path / "mnt" / "models"
    (mount / "config").mkdir(parents=True)
    (mount / "model-store").mkdir()
    shutil.copy(model_store / "echo.mar", mount / "model-store" / "echo.mar")
    server = ConveyorProcess(tmp_path / "run", env={
        "CONVEYOR_MODEL_DIR": str(mount), "CONVEYOR_PID_FILE": str(tmp_path / "run" / "conveyor.pid"),
        "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"})
    # The fixture's ports, plus what a mounted config says; no --ts-config/--model-store flags.
    (mount / "config" / "config.properties").write_text(
        server.config_path.read_text() + "load_models=all\ndisable_token_authorization=true\n")
    server.argv = ["sh", str(REPO / "deploy" / "docker" / "entrypoint.sh")]
    with server:
        assert requests.get(f"{server.inference}/v2/health/ready", timeout=10).json() == {"ready": True}
        predict = requests.post(f"{server.inference}/v1/models/echo:predict", json={"instances": ["x"]}, timeout=10)
        assert predict.json() == {"predictions": ["x"]}
