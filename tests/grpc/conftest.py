"""gRPC test fixtures: a client generated at test time from TorchServe's own protos.

Only TorchServe's generated modules are imported in the test process (ours live in the server
process): both define the same message names in protobuf's process-wide descriptor pool.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from grpc_tools import protoc

from frontend.grpc_api.generate import include_dirs

TS_PROTOS = Path(__file__).parent / "torchserve_protos"


def run_protoc(proto_root: Path, protos: list[str], args: list[str]) -> None:
    cmd = ["protoc", f"-I{proto_root}"] + [f"-I{d}" for d in include_dirs()] + args + protos
    if protoc.main(cmd) != 0:
        raise RuntimeError(f"protoc failed: {cmd}")


@pytest.fixture(scope="session")
def ts_stubs(tmp_path_factory: pytest.TempPathFactory) -> SimpleNamespace:
    out = tmp_path_factory.mktemp("ts_stubs")
    run_protoc(TS_PROTOS, ["inference.proto", "management.proto"], [f"--python_out={out}", f"--grpc_python_out={out}"])
    sys.path.insert(0, str(out))
    try:
        return SimpleNamespace(**{name: importlib.import_module(name) for name in (
            "inference_pb2", "inference_pb2_grpc", "management_pb2", "management_pb2_grpc")})
    finally:
        sys.path.remove(str(out))
