"""The HTTP side of sequences (issue 7 builds the rest): ids from configured headers, server-made
ids echoed back, the end header closing a sequence, and closed ids refused with a clear error."""

from __future__ import annotations

from pathlib import Path

import pytest
import requests

from tests.integration.server import EXAMPLES, ConveyorProcess, build_mar

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]


def test_sequence_ids_over_http(tmp_path: Path) -> None:
    store = tmp_path / "store"
    store.mkdir()
    config = tmp_path / "seq-config.yaml"
    config.write_text("minWorkers: 1\nbatchSize: 4\nmaxBatchDelay: 1\nsequenceBatching: true\n"
                      "sequenceMaxIdleMSec: 10000\nmaxNumSequence: 4\n")
    build_mar(store, "seq_echo", EXAMPLES / "echo" / "echo_handler.py", config)
    with ConveyorProcess(tmp_path / "srv", model_store=store, models=["seq_echo.mar"],
                         properties={"ts_header_key_sequence_id": "X-Session-Id"}) as server:
        url = f"{server.inference}/predictions/seq_echo"
        first = requests.post(url, data=b"a", headers={"Content-Type": "text/plain"}, timeout=10)
        assert first.status_code == 200 and first.text == "a"
        made = first.headers["x-session-id"]
        assert made.startswith("ts-seq-")
        again = requests.post(url, data=b"b", headers={"Content-Type": "text/plain", "X-SESSION-ID": made}, timeout=10)
        assert again.status_code == 200 and again.headers["x-session-id"] == made

        mine = requests.post(url, data=b"c", headers={"Content-Type": "text/plain", "x-session-id": "client-1",
                                                       "ts_request_sequence_end": "1"}, timeout=10)
        assert mine.status_code == 200 and mine.headers["x-session-id"] == "client-1"
        closed = requests.post(url, data=b"d", headers={"Content-Type": "text/plain", "x-session-id": "client-1"},
                               timeout=10)
        assert closed.status_code == 410 and closed.json()["type"] == "SequenceClosedException"
        assert "client-1" in closed.json()["message"]
        sequences = server.describe("seq_echo").get("sequences")
        assert sequences is not None
