"""The optional ``step_ahead`` hook (decode ahead): a real worker process calls it after a continuous
frame's final reply when no next frame is waiting, never with a frame waiting, never in static mode;
a failing hook fails the next frame's requests, not the worker. Plus the hook's resolution in Service.

The test handler writes one byte to a FIFO in its model dir each time its hook runs, so the test
waits for the call itself instead of sleeping (the select timeout only guards against a hang).
"""

from __future__ import annotations

import json
import os
import select
from collections.abc import Iterator
from pathlib import Path

import pytest

from backend.context import Context
from backend.handler_loader import load_handler
from backend.protocol import InferRequest, Ping, Pong, encode
from backend.service import Service
from tests.backend.conftest import EXAMPLES, cancel, cont, new

pytestmark = [pytest.mark.slow, pytest.mark.timeout(60)]

HANDLER = '''
import os


class AheadProbe:
    """Streams forever; each result reports how often step_ahead ran and what was cancelled."""

    def initialize(self, context):
        self.calls = 0
        self.cancelled = []
        self.fail_first = bool(context.model_yaml_config.get("fail_first_step_ahead"))

    def step_ahead(self):
        self.calls += 1
        fd = os.open("ahead.fifo", os.O_WRONLY | os.O_NONBLOCK)
        os.write(fd, b"x")
        os.close(fd)
        if self.fail_first and self.calls == 1:
            raise RuntimeError("ahead broke")

    def cancel(self, request_ids):
        self.cancelled.extend(request_ids)

    def handle(self, data, context):
        for idx in range(len(data)):
            context.set_done(idx, False)
        return [{"ahead_calls": self.calls, "cancelled": list(self.cancelled)} for _ in data]
'''


@pytest.fixture
def model_dir(tmp_path: Path) -> Iterator[tuple[Path, int]]:
    """The handler's model dir with its FIFO; yields (dir, read end of the FIFO)."""
    directory = tmp_path / "ahead"
    directory.mkdir()
    (directory / "ahead_probe.py").write_text(HANDLER)
    os.mkfifo(directory / "ahead.fifo")
    # Opened before the worker starts, so the handler's non-blocking write always finds a reader; our
    # own write end stays open so the read end never sees end-of-file between two of the hook's writes.
    fifo = os.open(directory / "ahead.fifo", os.O_RDONLY | os.O_NONBLOCK)
    keep_open = os.open(directory / "ahead.fifo", os.O_WRONLY | os.O_NONBLOCK)
    yield directory, fifo
    os.close(keep_open)
    os.close(fifo)


def wait_for_hook(fifo: int) -> None:
    readable, _, _ = select.select([fifo], [], [], 30)
    assert readable, "step_ahead was not called"
    assert os.read(fifo, 1) == b"x"


def hook_calls_so_far(fifo: int) -> int:
    try:
        return len(os.read(fifo, 64))
    except BlockingIOError:
        return 0


def body(reply) -> dict:
    (result,) = reply.results
    assert result.status == 200, result.message
    return json.loads(result.body)


def test_hook_runs_only_when_no_frame_is_waiting(start_worker, model_dir) -> None:
    directory, fifo = model_dir
    w = start_worker("W-ahead-1")
    assert w.load(directory, "ahead_probe.py", yaml_config={"continuousBatching": True}).status == 200
    assert body(w.infer(1, [new("a", b"{}")])[-1])["ahead_calls"] == 0
    wait_for_hook(fifo)  # nothing was waiting after frame 1's reply
    # Frames 2 and 3 written at once: after frame 2's reply, frame 3 is already waiting.
    w.sock.sendall(encode(InferRequest(2, (cont("a"),))) + encode(InferRequest(3, (cont("a"),))))
    assert body(w.recv())["ahead_calls"] == 1
    assert body(w.recv())["ahead_calls"] == 1  # not called between frames 2 and 3
    wait_for_hook(fifo)  # but after frame 3's reply
    assert body(w.infer(4, [cancel("a"), new("b", b"{}")])[-1]) == {"ahead_calls": 2, "cancelled": ["a"]}
    assert hook_calls_so_far(fifo) <= 1  # at most the call after frame 4 (nothing else runs it)


def test_hook_is_not_called_in_static_mode(start_worker, model_dir) -> None:
    directory, fifo = model_dir
    w = start_worker("W-ahead-2")
    assert w.load(directory, "ahead_probe.py", yaml_config={"continuousBatching": False}).status == 200
    w.infer(1, [new("a", b"{}")])
    w.send(Ping(7))
    assert w.recv() == Pong(7)  # the worker is past the point where it would have called the hook
    assert body(w.infer(2, [cont("a")])[-1])["ahead_calls"] == 0
    assert hook_calls_so_far(fifo) == 0


def test_failing_hook_fails_the_next_frame_not_the_worker(start_worker, model_dir) -> None:
    directory, fifo = model_dir
    w = start_worker("W-ahead-3")
    config = {"continuousBatching": True, "fail_first_step_ahead": True}
    assert w.load(directory, "ahead_probe.py", yaml_config=config).status == 200
    w.infer(1, [new("a", b"{}")])
    wait_for_hook(fifo)  # this call raises
    (reply,) = w.infer(2, [cont("a"), new("b", b"{}")])
    assert [(r.request_id, r.status, r.done) for r in reply.results] == [("a", 503, True), ("b", 503, True)]
    assert all(r.message == "Prediction failed: RuntimeError: ahead broke" for r in reply.results)
    # The worker still serves; the failed requests went through the cancel hook, as after a failing handle().
    assert body(w.infer(3, [new("c", b"{}")])[-1])["cancelled"] == ["a", "b"]
    assert "step_ahead failed" in w.stderr() and "RuntimeError: ahead broke" in w.stderr()


# ------------------------------------------------------------------------ resolution (in-process)


def test_hook_resolution(model_dir, isolated_imports, tmp_path: Path) -> None:
    directory, _ = model_dir

    def service(handler_dir: Path, spec: str, continuous: bool | str) -> Service:
        context = Context("m", str(handler_dir), {}, 4, None, model_yaml_config={"continuousBatching": continuous})
        return Service(load_handler(spec, handler_dir, context), context, 1000)

    assert service(directory, "ahead_probe.py", True).can_step_ahead
    assert service(directory, "ahead_probe.py", "true").can_step_ahead  # a register parameter's string
    assert not service(directory, "ahead_probe.py", False).can_step_ahead
    assert not service(EXAMPLES / "streaming", "streaming_handler.py", True).can_step_ahead  # no hook
    # A module handler: step_ahead(context), like its cancel(request_ids, context).
    (tmp_path / "fn_ahead.py").write_text(
        "seen = []\n"
        "def handle(data, context):\n"
        "    return data and [len(seen)] * len(data)\n"
        "def step_ahead(context):\n"
        "    seen.append(context.model_name)\n")
    svc = service(tmp_path, "fn_ahead.py", True)
    assert svc.can_step_ahead
    svc.step_ahead()
    reply = svc.predict(InferRequest(1, (new("x", b"{}"),)))
    assert reply.results[0].body == b"1"
