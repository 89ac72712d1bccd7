"""Test handler: answers every request with its input parameters as JSON (name → value as the
worker decoded it: JSON bodies as objects, text as str, bytes as latin-1 text), and the content
type the handler saw for each, so tests can compare what two HTTP paths deliver."""

from __future__ import annotations

import json
from typing import Any


def _plain(value: Any) -> Any:
    return value.decode("latin-1") if isinstance(value, (bytes, bytearray)) else value


def handle(data: list | None, context: Any) -> list | None:
    if data is None:
        return None
    out = []
    for idx, row in enumerate(data):
        types = {name: (context.get_request_header(idx, name) or {}).get("content-type") for name in row}
        out.append(json.dumps({"params": {k: _plain(v) for k, v in row.items()}, "types": types}, sort_keys=True))
    return out
