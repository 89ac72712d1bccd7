"""A client that disconnects mid-stream cancels its job: the handler sees a CANCEL and stops."""

from __future__ import annotations

import re
import socket

import pytest
import requests

from tests.integration.server import ConveyorProcess, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]


def test_disconnect_mid_stream_sends_cancel(server: ConveyorProcess) -> None:
    body = b'{"n": 200, "step_ms": 20}'
    with socket.create_connection(("127.0.0.1", server.ports["inference"]), timeout=10) as sock:
        sock.sendall(b"POST /predictions/streaming HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"x-request-id: disconnect-me\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        assert b'"i": 0' in sock.recv(65536) or b'"i": 0' in sock.recv(65536)
    # The streaming handler logs one STEP line per frame and a CANCEL line naming cancelled ids.
    cancelled = re.compile(r"(CANCEL ids|cancelled)=[^\n]*disconnect-me")
    assert wait_until(lambda: cancelled.search(server.log_tail(400)) is not None,
                      timeout=10), server.log_tail(40)
    steps = [line for line in server.log_tail(2000).splitlines() if "disconnect-me" in line and "STEP" in line]
    assert len(steps) < 150  # stopped long before its 200 steps
    assert requests.post(f"{server.inference}/predictions/streaming", json={"n": 2}, timeout=10).status_code == 200
