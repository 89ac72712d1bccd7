"""Regenerate the gRPC Python modules from the protos: ``python -m frontend.grpc_api.generate``.

The generated ``*_pb2.py`` / ``*_pb2_grpc.py`` files are committed next to the protos; a test
regenerates them into a temporary directory and fails if the committed ones are stale.
"""

from __future__ import annotations

import sys
from importlib import resources
from pathlib import Path

from grpc_tools import protoc

PROTOS = ("inference.proto", "management.proto")
REPO_ROOT = Path(__file__).resolve().parents[2]
PROTO_DIR = Path("frontend/grpc_api/protos")


def include_dirs() -> list[str]:
    """grpc_tools ships google/protobuf/*.proto; googleapis-common-protos ships google/rpc/*.proto."""
    import google.rpc  # the package that holds status.proto

    well_known = str(resources.files("grpc_tools") / "_proto")
    googleapis = str(Path(google.rpc.__path__[0]).parents[1])
    return [well_known, googleapis]


def generate(out_dir: Path) -> None:
    args = ["protoc", f"-I{REPO_ROOT}"] + [f"-I{d}" for d in include_dirs()]
    args += [f"--python_out={out_dir}", f"--grpc_python_out={out_dir}"]
    args += [str(PROTO_DIR / name) for name in PROTOS]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed: {' '.join(args)}")


if __name__ == "__main__":
    generate(REPO_ROOT)
    sys.exit(0)
