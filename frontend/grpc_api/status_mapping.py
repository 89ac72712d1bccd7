"""The one place where errors become gRPC statuses.

Typed frontend errors carry their own ``grpc_code``; handler results carry an HTTP-like status,
mapped by ``STATUS_TO_GRPC`` (bad input → INVALID_ARGUMENT, handler failure → INTERNAL, ...).
"""

from __future__ import annotations

import grpc
from google.rpc import status_pb2

from frontend.errors import ConveyorError, PredictionError

STATUS_TO_GRPC: dict[int, grpc.StatusCode] = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    401: grpc.StatusCode.UNAUTHENTICATED,
    403: grpc.StatusCode.PERMISSION_DENIED,
    404: grpc.StatusCode.NOT_FOUND,
    405: grpc.StatusCode.PERMISSION_DENIED,
    408: grpc.StatusCode.DEADLINE_EXCEEDED,
    409: grpc.StatusCode.ALREADY_EXISTS,
    410: grpc.StatusCode.FAILED_PRECONDITION,
    413: grpc.StatusCode.INVALID_ARGUMENT,
    429: grpc.StatusCode.RESOURCE_EXHAUSTED,
    503: grpc.StatusCode.UNAVAILABLE,
    504: grpc.StatusCode.DEADLINE_EXCEEDED,
    507: grpc.StatusCode.RESOURCE_EXHAUSTED,
}


def code_for_status(status: int) -> grpc.StatusCode:
    """gRPC code for an HTTP-like status of a handler result (unknown 4xx: INVALID_ARGUMENT)."""
    if status in STATUS_TO_GRPC:
        return STATUS_TO_GRPC[status]
    return grpc.StatusCode.INVALID_ARGUMENT if 400 <= status < 500 else grpc.StatusCode.INTERNAL


def code_for_error(error: ConveyorError) -> grpc.StatusCode:
    if isinstance(error, PredictionError):  # a handler's own status decides (400 → INVALID_ARGUMENT)
        return code_for_status(error.status)
    return getattr(grpc.StatusCode, error.grpc_code, None) or code_for_status(error.status)


def rpc_status(code: grpc.StatusCode, message: str) -> status_pb2.Status:
    """A google.rpc.Status for errors sent in-stream (StreamPredictions2)."""
    return status_pb2.Status(code=code.value[0], message=message)
