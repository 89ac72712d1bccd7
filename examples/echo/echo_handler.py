"""Echo: a batch-aware native Conveyor handler (a module-level ``handle``; no model, no torch).

Each request's body comes back unchanged — bytes as bytes, text as text, JSON re-serialised — with
the request's content type, and every result carries ``x-batch-size: <requests in this frame>`` so
tests can see batching happen. A request without a body (form fields only) gets its fields as JSON.
"""

from __future__ import annotations

import json
from typing import Any

from backend.context import Context


def _echo(row: Any) -> Any:
    if not isinstance(row, dict):
        return row
    if "body" not in row and "data" in row:  # TorchServe's gRPC clients name the input "data"
        row = {"body": row["data"]}
    if "body" not in row:
        return json.dumps({k: v.decode("utf-8", "replace") if isinstance(v, (bytes, bytearray)) else v
                           for k, v in row.items()})
    body = row["body"]
    return body if isinstance(body, (bytes, bytearray, str)) else json.dumps(body)


def handle(data: list | None, context: Context) -> list | None:
    if data is None:  # the one-time initialisation call (TorchServe's convention for function handlers)
        return None
    outputs = []
    for idx, row in enumerate(data):
        context.set_response_header(idx, "x-batch-size", str(len(data)))
        param = context.get_request_header(idx, "body")  # {"content-type": ...} of the body parameter
        if isinstance(param, dict) and param.get("content-type") and isinstance(row, dict) and "body" in row:
            context.set_response_content_type(idx, param["content-type"])
        outputs.append(_echo(row))
    return outputs
