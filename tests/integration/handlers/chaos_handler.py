"""Test handler for supervision tests: misbehaves on command, echoes anything else.

Body commands (one request per frame: batchSize 1):
  ``sleep:<path>``     create <path> (so the test knows the request is in the handler), sleep 60 s
  ``oom``              exit with 137, as a process the OOM killer took is reported
  ``garbage:magic``    write bytes that are no frame onto the socket to the frontend, then answer
  ``garbage:oversize`` write a frame header announcing a 2 GiB payload, then answer
With ``handler: {exit_in_initialize: true}`` in model-config.yaml, loading prints a line to stderr
and exits with code 4.
"""

from __future__ import annotations

import os
import stat
import struct
import sys
import time

from backend.protocol import MAGIC, VERSION, MessageType


def _write_to_frontend(data: bytes) -> None:
    # The worker's one connected socket is the frontend's; a listening socket refuses the write.
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        try:
            if stat.S_ISSOCK(os.fstat(fd).st_mode):
                os.write(fd, data)
        except OSError:
            continue


def handle(data, context):
    if data is None:  # load time
        if (context.model_yaml_config.get("handler") or {}).get("exit_in_initialize"):
            print("chaos: cannot open weights.bin (simulated)", file=sys.stderr, flush=True)
            os._exit(4)
        return None
    out = []
    for row in data:
        body = row.get("body") if isinstance(row, dict) else row
        text = body.decode() if isinstance(body, (bytes, bytearray)) else str(body)
        if text.startswith("sleep:"):
            with open(text.removeprefix("sleep:"), "w"):
                pass
            time.sleep(60)
        elif text == "oom":
            os._exit(137)
        elif text == "garbage:magic":
            _write_to_frontend(b"\x00NOT A FRAME\xff" * 8)
        elif text == "garbage:oversize":
            _write_to_frontend(struct.pack("!4sBBHI", MAGIC, VERSION, MessageType.INFER_REPLY, 0, 0x7FFFFFFF))
        out.append(text)
    return out
