"""The committed gRPC modules are fresh, and our protos are wire-identical to TorchServe's."""

from __future__ import annotations

from pathlib import Path

from google.protobuf import descriptor_pb2

from frontend.grpc_api import generate
from tests.grpc.conftest import TS_PROTOS, run_protoc


def test_generated_modules_are_up_to_date(tmp_path: Path) -> None:
    generate.generate(tmp_path)
    out = tmp_path / "frontend" / "grpc_api" / "protos"
    for name in generate.PROTOS:
        stem = name.removesuffix(".proto")
        for suffix in ("_pb2.py", "_pb2_grpc.py"):
            fresh = (out / f"{stem}{suffix}").read_text()
            committed = (generate.REPO_ROOT / generate.PROTO_DIR / f"{stem}{suffix}").read_text()
            assert fresh == committed, f"{stem}{suffix} is stale: run python -m frontend.grpc_api.generate"


def _wire_shape(root: Path, protos: list[str], tmp_path: Path, tag: str) -> dict:
    """Everything that decides the wire: packages, messages' fields (number, type, label), services."""
    out = tmp_path / f"{tag}.pb"
    run_protoc(root, protos, [f"--descriptor_set_out={out}"])
    fds = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes())
    shape: dict = {}
    for file in fds.file:
        for msg in file.message_type:
            shape[f"{file.package}.{msg.name}"] = sorted(
                (f.name, f.number, f.type, f.label, f.type_name, f.proto3_optional) for f in msg.field)
            for nested in msg.nested_type:  # map entries
                shape[f"{file.package}.{msg.name}.{nested.name}"] = sorted((f.name, f.number, f.type) for f in nested.field)
        for service in file.service:
            shape[f"{file.package}.{service.name}"] = sorted(
                (m.name, m.input_type, m.output_type, m.client_streaming, m.server_streaming) for m in service.method)
    return shape


def test_protos_are_wire_compatible_with_torchserve(tmp_path: Path) -> None:
    ours = _wire_shape(generate.REPO_ROOT, [str(generate.PROTO_DIR / p) for p in generate.PROTOS], tmp_path, "ours")
    theirs = _wire_shape(TS_PROTOS, ["inference.proto", "management.proto"], tmp_path, "theirs")
    assert "org.pytorch.serve.grpc.inference.InferenceAPIsService" in ours
    assert ours == theirs
