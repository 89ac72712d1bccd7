"""ChildProcess (frontend/workers/process.py): a Popen child with its pipes and its exit on the event
loop, under asyncio's default loop and under uvloop (the server's)."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from collections.abc import Callable, Coroutine
from typing import Any

import pytest
import uvloop

from frontend.workers.process import ChildProcess

pytestmark = pytest.mark.timeout(30)

LOOPS = {"asyncio": asyncio.new_event_loop, "uvloop": uvloop.new_event_loop}


def run(make_loop: Callable[[], asyncio.AbstractEventLoop], main: Callable[[], Coroutine[Any, Any, None]]) -> None:
    with asyncio.Runner(loop_factory=make_loop) as runner:
        runner.run(main())


@pytest.mark.parametrize("loop", LOOPS)
def test_output_lines_and_exit_code(loop: str) -> None:
    async def main() -> None:
        child = await ChildProcess.start(
            [sys.executable, "-c", "import sys; print('out'); print('err', file=sys.stderr); sys.exit(3)"],
            {**os.environ, "MARK": "x"}, None)
        assert await child.stdout.readline() == b"out\n"
        assert await child.stderr.readline() == b"err\n"
        assert await child.wait() == 3 and child.returncode == 3
        assert await child.stdout.read() == b""  # EOF after exit

    run(LOOPS[loop], main)


@pytest.mark.parametrize("loop", LOOPS)
def test_killed_child_reports_the_signal_and_waiters_share_it(loop: str) -> None:
    async def main() -> None:
        child = await ChildProcess.start([sys.executable, "-c", "import time; time.sleep(60)"], None, None)
        assert os.getpgid(child.pid) == child.pid  # its own session (killpg takes its children too)
        waiters = [asyncio.ensure_future(child.wait()) for _ in range(2)]
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(child.wait(), 0.2)  # a timed-out wait does not spoil the others
        os.killpg(child.pid, signal.SIGKILL)
        assert await asyncio.gather(*waiters) == [-signal.SIGKILL] * 2

    run(LOOPS[loop], main)


@pytest.mark.parametrize("loop", LOOPS)
def test_child_gone_before_the_watch_starts(loop: str) -> None:
    async def main() -> None:
        child = await ChildProcess.start([sys.executable, "-c", "pass"], None, None)
        await asyncio.sleep(0.5)  # exited (and possibly reaped by wait) by now
        assert await asyncio.wait_for(child.wait(), 5) == 0

    run(LOOPS[loop], main)
