"""The typed errors a request can meet in the frontend, each with its HTTP and gRPC status.

Raise these anywhere below the API layer; the HTTP and gRPC layers map them in one place
(``to_http`` / ``to_grpc_code``) — never by sniffing exception text. Messages name the model, the
sequence id and the rule broken.
"""

from __future__ import annotations


class ConveyorError(Exception):
    """Base: ``status`` is the HTTP status, ``grpc_code`` the name of a ``grpc.StatusCode``."""

    status = 500
    grpc_code = "INTERNAL"
    error_type = "InternalServerException"
    retry_after: int | None = None  # seconds, for 503s a client may retry

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def to_json(self) -> dict:
        return {"code": self.status, "type": self.error_type, "message": self.message}


class BadRequest(ConveyorError):
    status, grpc_code, error_type = 400, "INVALID_ARGUMENT", "BadRequestException"


class Unauthorized(ConveyorError):
    status, grpc_code, error_type = 401, "UNAUTHENTICATED", "InvalidKeyException"


class ModelNotFound(ConveyorError):
    status, grpc_code, error_type = 404, "NOT_FOUND", "ModelNotFoundException"


class MethodNotAllowed(ConveyorError):
    status, grpc_code, error_type = 405, "PERMISSION_DENIED", "MethodNotAllowedException"


class RequestTimeout(ConveyorError):
    status, grpc_code, error_type = 408, "DEADLINE_EXCEEDED", "RequestTimeoutException"


class Conflict(ConveyorError):
    status, grpc_code, error_type = 409, "ALREADY_EXISTS", "ConflictStatusException"


class RequestTooLarge(ConveyorError):
    status, grpc_code, error_type = 413, "INVALID_ARGUMENT", "RequestEntityTooLargeException"


class ServiceUnavailable(ConveyorError):
    status, grpc_code, error_type = 503, "UNAVAILABLE", "ServiceUnavailableException"
    retry_after = 1


class QueueFull(ServiceUnavailable):
    grpc_code = "RESOURCE_EXHAUSTED"


class NoWorkers(ServiceUnavailable):
    pass


class SequenceError(ConveyorError):
    """A request that breaks a sequence rule. Subclasses say which rule."""

    status, grpc_code, error_type = 400, "FAILED_PRECONDITION", "SequenceException"


class SequenceClosed(SequenceError):
    status, error_type = 410, "SequenceClosedException"


class SequenceExpired(SequenceError):
    status, error_type = 410, "SequenceExpiredException"


class SequenceWorkerLost(SequenceError):
    status, error_type = 410, "SequenceWorkerLostException"


class SequenceAlreadyOpen(SequenceError):
    """A request with the start flag named a sequence that is open."""

    status, grpc_code, error_type = 409, "ALREADY_EXISTS", "SequenceAlreadyOpenException"


class SequenceUnknown(SequenceError):
    """Strict start: an id the server does not know arrived without the start header."""

    status, error_type = 404, "SequenceUnknownException"


class SequenceLimit(ServiceUnavailable):
    """maxNumSequence open sessions, or maxSequenceJobQueueSize queued requests of one sequence."""

    grpc_code = "RESOURCE_EXHAUSTED"


class WorkerError(ConveyorError):
    """A worker died, hung, or broke the protocol while running this request."""

    status, grpc_code, error_type = 500, "INTERNAL", "WorkerException"


class InvalidConfig(ConveyorError):
    """A configuration value that is wrong; the message names the key, the value and the file."""

    status, grpc_code, error_type = 400, "INVALID_ARGUMENT", "InvalidConfigException"


# Added by the frontend room (issue 4). -----------------------------------------------------------


class ResourceNotFound(ConveyorError):
    """A path no API serves (TorchServe's wording and type)."""

    status, grpc_code, error_type = 404, "NOT_FOUND", "ResourceNotFoundException"


class ModelVersionNotFound(ModelNotFound):
    error_type = "ModelVersionNotFoundException"


class Forbidden(ConveyorError):
    """E.g. unregistering a model's default version while other versions remain (TorchServe: 403)."""

    status, grpc_code, error_type = 403, "PERMISSION_DENIED", "InvalidModelVersionException"


class ModelLoadError(ConveyorError):
    """Registration failed: the archive could not be opened or its workers could not load it."""

    status, grpc_code, error_type = 500, "INTERNAL", "ModelLoadException"


class PredictionError(ConveyorError):
    """The handler answered a request with an error status but no body of its own."""

    error_type = "PredictionException"

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
