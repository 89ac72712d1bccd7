"""The echo handler of ``benchmarks/compare.py``: TorchServe-style, so the SAME archive runs unchanged
under TorchServe and under Conveyor (no import of either server's code).

A module-level ``handle(data, context)``: both servers call it once with ``data=None`` when the model
loads, then once per batch. Each request's ``body`` (``data`` from TorchServe's gRPC clients) comes
back as is; both servers decode a JSON body with ``json.loads`` before the handler and serialise a
non-string output with ``json.dumps(indent=2)`` after it, so the work per request is the same.
"""

from typing import Any


def handle(data: list[Any] | None, context: Any) -> list[Any] | None:
    if data is None:
        return None
    return [row.get("body", row.get("data")) if isinstance(row, dict) else row for row in data]
