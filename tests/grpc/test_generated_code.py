"""The committed gRPC modules are what `python -m frontend.grpc_api.generate` produces from the protos."""

from pathlib import Path

from frontend.grpc_api import generate


def test_generated_modules_are_up_to_date(tmp_path: Path) -> None:
    generate.generate(tmp_path)
    out = tmp_path / "frontend" / "grpc_api" / "protos"
    for name in generate.PROTOS:
        stem = name.removesuffix(".proto")
        for suffix in ("_pb2.py", "_pb2_grpc.py"):
            fresh = (out / f"{stem}{suffix}").read_text()
            committed = (generate.REPO_ROOT / generate.PROTO_DIR / f"{stem}{suffix}").read_text()
            assert fresh == committed, f"{stem}{suffix} is stale: run python -m frontend.grpc_api.generate"


def test_service_names_match_torchserve() -> None:
    from frontend.grpc_api.protos import inference_pb2, management_pb2

    assert inference_pb2.DESCRIPTOR.services_by_name["InferenceAPIsService"].full_name == (
        "org.pytorch.serve.grpc.inference.InferenceAPIsService"
    )
    assert management_pb2.DESCRIPTOR.services_by_name["ManagementAPIsService"].full_name == (
        "org.pytorch.serve.grpc.management.ManagementAPIsService"
    )
    fields = inference_pb2.PredictionsRequest.DESCRIPTOR.fields_by_name
    assert {n: f.number for n, f in fields.items()} == {"model_name": 1, "model_version": 2, "input": 3, "sequenceId": 4}
