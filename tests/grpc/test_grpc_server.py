"""The gRPC APIs of a real server, driven by clients generated from TorchServe's own protos."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from collections.abc import Iterator

import grpc
import pytest
from google.protobuf import empty_pb2

from tests.integration.server import EXAMPLES, ConveyorProcess, build_mar, wait_until

pytestmark = pytest.mark.slow
STATEFUL = EXAMPLES / "stateful" / "sequence_batching"


@pytest.fixture(scope="module")
def grpc_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ConveyorProcess]:
    store = tmp_path_factory.mktemp("grpc_store")
    build_mar(store, "echo", EXAMPLES / "echo" / "echo_handler.py", EXAMPLES / "echo" / "model-config.yaml")
    build_mar(store, "streaming", EXAMPLES / "streaming" / "streaming_handler.py",
              EXAMPLES / "streaming" / "model-config.yaml")
    build_mar(store, "stateful", STATEFUL / "running_sum_handler.py", STATEFUL / "model-config.yaml")
    with ConveyorProcess(tmp_path_factory.mktemp("grpc_server"), model_store=store,
                         models=["echo=echo.mar", "streaming=streaming.mar", "stateful=stateful.mar"],
                         properties={"default_workers_per_model": "1"}) as proc:
        yield proc


@pytest.fixture()
def inference(grpc_server: ConveyorProcess, ts_stubs: SimpleNamespace) -> Iterator[SimpleNamespace]:
    with grpc.insecure_channel(f"127.0.0.1:{grpc_server.ports['grpc_inference']}") as channel:
        yield SimpleNamespace(stub=ts_stubs.inference_pb2_grpc.InferenceAPIsServiceStub(channel), pb=ts_stubs.inference_pb2)


@pytest.fixture()
def management(grpc_server: ConveyorProcess, ts_stubs: SimpleNamespace) -> Iterator[SimpleNamespace]:
    with grpc.insecure_channel(f"127.0.0.1:{grpc_server.ports['grpc_management']}") as channel:
        yield SimpleNamespace(stub=ts_stubs.management_pb2_grpc.ManagementAPIsServiceStub(channel), pb=ts_stubs.management_pb2)


def test_ping(inference: SimpleNamespace) -> None:
    reply = inference.stub.Ping(empty_pb2.Empty(), timeout=10)
    assert json.loads(reply.health) == {"status": "Healthy"}


def test_unary_echo(inference: SimpleNamespace) -> None:
    request = inference.pb.PredictionsRequest(model_name="echo", input={"data": b"hello grpc"})
    assert inference.stub.Predictions(request, timeout=10).prediction == b"hello grpc"


def test_unknown_model_is_not_found(inference: SimpleNamespace) -> None:
    with pytest.raises(grpc.RpcError) as info:
        inference.stub.Predictions(inference.pb.PredictionsRequest(model_name="nope", input={"data": b"x"}), timeout=10)
    assert info.value.code() == grpc.StatusCode.NOT_FOUND and "nope" in info.value.details()


def test_handler_error_is_invalid_argument(inference: SimpleNamespace) -> None:
    request = inference.pb.PredictionsRequest(model_name="streaming", input={"data": b'{"n": 0}'})
    with pytest.raises(grpc.RpcError) as info:
        inference.stub.Predictions(request, timeout=10)
    assert info.value.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.INTERNAL)


def test_server_streaming_with_continuous_batching(inference: SimpleNamespace) -> None:
    request = inference.pb.PredictionsRequest(model_name="streaming", input={"data": b'{"n": 5}'})
    chunks = [json.loads(r.prediction) for r in inference.stub.StreamPredictions(request, timeout=30)]
    assert chunks == [{"i": i, "of": 5} for i in range(5)]


def test_cancelled_stream_sends_cancel_to_backend(inference: SimpleNamespace, grpc_server: ConveyorProcess) -> None:
    request_id = f"grpc-cancel-{time.monotonic_ns()}"
    request = inference.pb.PredictionsRequest(model_name="streaming", input={"data": b'{"n": 100000, "step_ms": 20}'})
    call = inference.stub.StreamPredictions(request, timeout=60, metadata=[("x-request-id", request_id)])
    first = next(call)
    assert json.loads(first.prediction)["i"] == 0
    call.cancel()
    assert wait_until(lambda: f"cancelled={request_id}" in grpc_server.log_tail(400)
                      or f"CANCEL ids={request_id}" in grpc_server.log_tail(400), timeout=20), grpc_server.log_tail()
    # The worker is not wedged: the next request is served.
    again = inference.pb.PredictionsRequest(model_name="streaming", input={"data": b'{"n": 2}'})
    assert len(list(inference.stub.StreamPredictions(again, timeout=30))) == 2


def _sequence_requests(pb, sequence_id: str, values: list[int], gap: float = 0.0) -> Iterator:
    for value in values:
        yield pb.PredictionsRequest(model_name="stateful", sequenceId=sequence_id, input={"data": str(value).encode()})
        if gap:
            time.sleep(gap)


def test_two_concurrent_bidirectional_sequences(inference: SimpleNamespace) -> None:
    results: dict[str, list] = {}

    def run(sequence_id: str) -> None:
        replies = inference.stub.StreamPredictions2(_sequence_requests(inference.pb, sequence_id, [1, 2, 3]), timeout=30)
        results[sequence_id] = [(json.loads(r.prediction), r.sequenceId) for r in replies]

    threads = [threading.Thread(target=run, args=(f"grpc-seq-{i}-{time.monotonic_ns()}",)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(results) == 2
    for sequence_id, replies in results.items():
        assert [r[0] for r in replies] == [1, 3, 6]
        assert {r[1] for r in replies} == {sequence_id}


def test_in_stream_error_then_success(inference: SimpleNamespace) -> None:
    sequence_id = f"grpc-err-{time.monotonic_ns()}"

    def requests() -> Iterator:
        yield inference.pb.PredictionsRequest(model_name="stateful", sequenceId=sequence_id, input={"data": b"5"})
        yield inference.pb.PredictionsRequest(model_name="stateful", sequenceId=sequence_id, input={"data": b"not a number"})
        yield inference.pb.PredictionsRequest(model_name="no-such-model", sequenceId=sequence_id, input={"data": b"1"})
        yield inference.pb.PredictionsRequest(model_name="stateful", sequenceId=sequence_id, input={"data": b"2"})

    replies = list(inference.stub.StreamPredictions2(requests(), timeout=30))
    ok = [json.loads(r.prediction) for r in replies if not r.HasField("status")]
    errors = [r.status for r in replies if r.HasField("status")]
    assert ok == [5, 7]
    assert sorted(e.code for e in errors) == sorted([grpc.StatusCode.INVALID_ARGUMENT.value[0], grpc.StatusCode.NOT_FOUND.value[0]])
    assert all(r.sequenceId == sequence_id for r in replies if not r.HasField("status") or r.status.code != 5)


def test_management_register_describe_scale_unregister(management: SimpleNamespace, grpc_server: ConveyorProcess) -> None:
    pb = management.pb
    listed = json.loads(management.stub.ListModels(pb.ListModelsRequest(), timeout=10).msg)
    assert {m["modelName"] for m in listed["models"]} >= {"echo", "streaming", "stateful"}
    reply = management.stub.RegisterModel(pb.RegisterModelRequest(
        url="echo.mar", model_name="echo2", initial_workers=1, synchronous=True), timeout=60)
    assert "echo2" in json.loads(reply.msg)["status"]
    described = json.loads(management.stub.DescribeModel(pb.DescribeModelRequest(model_name="echo2"), timeout=10).msg)
    assert described[0]["modelName"] == "echo2" and len(described[0]["workers"]) == 1
    management.stub.ScaleWorker(pb.ScaleWorkerRequest(model_name="echo2", min_worker=2, synchronous=True), timeout=60)
    described = json.loads(management.stub.DescribeModel(pb.DescribeModelRequest(model_name="echo2"), timeout=10).msg)
    assert len(described[0]["workers"]) == 2
    management.stub.UnregisterModel(pb.UnregisterModelRequest(model_name="echo2"), timeout=60)
    with pytest.raises(grpc.RpcError) as info:
        management.stub.DescribeModel(pb.DescribeModelRequest(model_name="echo2"), timeout=10)
    assert info.value.code() == grpc.StatusCode.NOT_FOUND


def test_grpc_next_to_rest(grpc_server: ConveyorProcess) -> None:
    """gRPC is served in the same process as REST: the REST ping still answers."""
    import requests

    assert requests.get(grpc_server.inference + "/ping", timeout=10).status_code == 200


def test_token_auth_on_both_grpc_apis(tmp_path: Path, ts_stubs: SimpleNamespace) -> None:
    store = tmp_path / "store"
    store.mkdir()
    build_mar(store, "echo", EXAMPLES / "echo" / "echo_handler.py", EXAMPLES / "echo" / "model-config.yaml")
    with ConveyorProcess(tmp_path / "srv", model_store=store, models=["echo=echo.mar"], token_auth=True) as proc:
        keys = json.loads((tmp_path / "srv" / "key_file.json").read_text())
        inference_key, management_key = keys["inference"]["key"], keys["management"]["key"]
        with grpc.insecure_channel(f"127.0.0.1:{proc.ports['grpc_inference']}") as channel:
            stub = ts_stubs.inference_pb2_grpc.InferenceAPIsServiceStub(channel)
            request = ts_stubs.inference_pb2.PredictionsRequest(model_name="echo", input={"data": b"k"})
            for metadata in ((), (("authorization", "Bearer wrong"),), (("authorization", f"Bearer {management_key}"),)):
                with pytest.raises(grpc.RpcError) as info:
                    stub.Predictions(request, timeout=10, metadata=metadata)
                assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
            ok = stub.Predictions(request, timeout=10, metadata=(("authorization", f"Bearer {inference_key}"),))
            assert ok.prediction == b"k"
        with grpc.insecure_channel(f"127.0.0.1:{proc.ports['grpc_management']}") as channel:
            stub = ts_stubs.management_pb2_grpc.ManagementAPIsServiceStub(channel)
            with pytest.raises(grpc.RpcError) as info:
                stub.ListModels(ts_stubs.management_pb2.ListModelsRequest(), timeout=10,
                                metadata=(("authorization", f"Bearer {inference_key}"),))
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
            listed = stub.ListModels(ts_stubs.management_pb2.ListModelsRequest(), timeout=10,
                                     metadata=(("authorization", f"Bearer {management_key}"),))
            assert json.loads(listed.msg)["models"][0]["modelName"] == "echo"
