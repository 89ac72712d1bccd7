"""Test handler: misbehaves on command. Body "hang" sleeps past any responseTimeout, "exit" kills the
worker process, "error" raises; anything else is echoed."""

from __future__ import annotations

import os
import time


def handle(data, context):
    if data is None:
        return None
    out = []
    for row in data:
        body = row.get("body") if isinstance(row, dict) else row
        text = body.decode() if isinstance(body, (bytes, bytearray)) else str(body)
        if text == "hang":
            time.sleep(60)
        elif text == "exit":
            os._exit(3)
        elif text == "error":
            raise RuntimeError("asked to fail")
        out.append(text)
    return out
