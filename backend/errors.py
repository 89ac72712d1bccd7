"""Handler-side errors and the one table that maps an exception to a per-request status.

TorchServe's mapping, kept so that handlers port unchanged, but decided by exception *type*, never by
sniffing the message text:

==========================================  ======  ==============================================
raised by the handler                       status  message
==========================================  ======  ==============================================
``PredictionException(msg, code)``          code    ``msg``
``MemoryError`` / ``torch.OutOfMemoryError``  507   ``Out of resources: <Type>: <msg>``
anything else                               503     ``Prediction failed: <Type>: <msg>``
==========================================  ======  ==============================================
"""

from __future__ import annotations

import sys


class PredictionException(Exception):
    """Raise from a handler to fail every request of the frame with ``error_code`` and ``message``.

    Same name, fields and ``str()`` as TorchServe's ``ts.utils.util.PredictionException``.
    """

    def __init__(self, message: str, error_code: int = 500) -> None:
        self.message = message
        self.error_code = error_code
        super().__init__(message)

    def __str__(self) -> str:
        return f"{self.message} : {self.error_code}"


def _prediction_exception_types() -> tuple[type, ...]:
    # A real TorchServe install has its own class; accept it too when a handler imported it.
    types: list[type] = [PredictionException]
    real = sys.modules.get("ts.utils.util")
    real_cls = getattr(real, "PredictionException", None) if real is not None else None
    if isinstance(real_cls, type) and real_cls is not PredictionException:
        types.append(real_cls)
    return tuple(types)


def is_out_of_memory(exc: BaseException) -> bool:
    if isinstance(exc, MemoryError):
        return True
    torch = sys.modules.get("torch")  # only a loaded torch can have raised its OOM error
    oom = getattr(torch, "OutOfMemoryError", None) if torch is not None else None
    return isinstance(oom, type) and isinstance(exc, oom)


def describe(exc: BaseException) -> str:
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def status_for_exception(exc: BaseException) -> tuple[int, str]:
    """The (status, message) every request of a failed frame gets."""
    if isinstance(exc, _prediction_exception_types()):
        code = getattr(exc, "error_code", 500)
        status = code if isinstance(code, int) and 100 <= code <= 599 else 500
        return status, str(getattr(exc, "message", exc))
    if is_out_of_memory(exc):
        return 507, f"Out of resources: {describe(exc)}"
    return 503, f"Prediction failed: {describe(exc)}"
