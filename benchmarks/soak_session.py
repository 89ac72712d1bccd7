"""The running-sum sessions of benchmarks/soak.py: one sequence each, its sums checked where the
client can know them (examples/stateful/sequence_continuous_batching's answers: an even number
``{"sum": S}``; an odd one streams ten chunks ``{"sum", "step", "of"}``, the last of a stream cut by a
``-1`` has ``"cancelled": true``; ``-1`` ``{"sum": S, "cancelled": k}``; ``0`` ``{"sum": S, "ended":
true}``). After a disconnect the sum is unknown until the next answer, which resynchronises it.
"""

from __future__ import annotations

import asyncio
import random
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from soak import Answer, Soak

SEQ_ID, SEQ_START, SEQ_END = "ts_request_sequence_id", "ts_request_sequence_start", "ts_request_sequence_end"
JSON = {"Content-Type": "application/json"}
STEP_MS = 5  # per decode step, both streaming models
NUM_STEPS = 10  # chunks of a running-sum stream (the handler's NUM_STEPS)


class RunningSumSession:
    """One sequence of the running-sum model, checked where the client can know the sum."""

    def __init__(self, soak: Soak, rng: random.Random, client_id: str) -> None:
        self.soak = soak
        self.rng = rng
        self.client_id = client_id
        self.sid = ""
        self.expected = 0
        self.certain = True  # False after a disconnect: the next answer resynchronises
        self.finished = False  # closed, lost or expired: nothing to end

    def headers(self, **extra: str) -> dict[str, str]:
        return {**JSON, **({SEQ_ID: self.sid} if self.sid else {}), **extra}

    def check(self, answer: Answer, ok: bool, what: str) -> None:
        if answer.outcome == "ok" and not ok:
            answer.outcome, answer.kind = "wrong", what

    def after(self, answer: Answer) -> bool:
        """Record an answer; True while the session may go on."""
        if answer.outcome == "error":
            # 410: closed, lost or expired; 500: its worker died, so the sequence is lost.
            self.finished = self.finished or answer.status in (404, 410, 500)
            self.certain = False
        self.soak.record("running_sum", answer)
        return answer.outcome in ("ok", "disconnected")

    def number(self, n: int, answer: Answer) -> None:
        body = answer.body if isinstance(answer.body, dict) else {}
        if self.certain:
            self.check(answer, body == {"sum": self.expected + n}, f"sum of {n}: {body} != {self.expected + n}")
        self.expected = body.get("sum", self.expected + n) if isinstance(body.get("sum"), int) else self.expected + n
        self.certain = True

    def stream(self, n: int, answer: Answer) -> None:
        chunks = answer.chunks if answer.streamed else [answer.body]
        if not chunks or not all(isinstance(c, dict) and isinstance(c.get("sum"), int) for c in chunks):
            self.check(answer, False, f"stream chunks {chunks[:3]}")
            return
        base = self.expected if self.certain else chunks[0]["sum"] - (0 if chunks[0].get("cancelled") else n)
        for j, chunk in enumerate(chunks, 1):
            if chunk.get("cancelled"):
                good = chunk == {"sum": base + n * (j - 1), "step": j - 1, "of": NUM_STEPS, "cancelled": True}
                good = good and j == len(chunks)
            else:
                good = chunk == {"sum": base + n * j, "step": j, "of": NUM_STEPS}
            if not good:
                self.check(answer, False, f"stream chunk {j} of sum {base} + {n}: {chunk}")
                return
        last = chunks[-1]
        if answer.outcome == "ok" and not last.get("cancelled") and last["step"] != NUM_STEPS:
            answer.outcome, answer.kind = "lost", "stream ended without its last chunk or an error chunk"
        self.expected = last["sum"]
        self.certain = answer.outcome == "ok"

    async def run(self) -> None:
        soak, rng = self.soak, self.rng
        if rng.random() < 0.5:  # a client-chosen id, opened with the start header
            self.sid = self.client_id
            first = await soak.call("running_sum", b"2", self.headers(**{SEQ_START: "true"}))
        else:  # a server-made id, learnt from the first answer
            first = await soak.call("running_sum", b"2", self.headers())
            self.sid = first.headers.get(SEQ_ID, "")
        if first.outcome == "ok":
            self.number(2, first)
        if not self.after(first) or not self.sid:
            return await self.end()
        for _ in range(rng.randint(1, 5)):
            if soak.stopping:
                break
            roll = rng.random()
            if roll < 0.4:
                n = 2 * rng.randint(1, 5)
                answer = await soak.call("running_sum", str(n).encode(), self.headers())
                if answer.outcome == "ok":
                    self.number(n, answer)
            elif roll < 0.75:
                n = 2 * rng.randint(0, 4) + 1
                cut = rng.randint(1, NUM_STEPS - 1) if rng.random() < soak.args.disconnect_rate else None
                answer = await soak.call("running_sum", str(n).encode(), self.headers(), disconnect_after=cut)
                if answer.outcome in ("ok", "disconnected"):
                    self.stream(n, answer)
                if answer.outcome == "disconnected":
                    self.certain = False
            else:
                if not await self.cut_stream():
                    return await self.end()
                continue
            if not self.after(answer):
                return await self.end()
        await self.end()

    async def cut_stream(self) -> bool:
        """A stream, and a ``-1`` on the same sequence once its first chunks arrived."""
        soak, n = self.soak, 2 * self.rng.randint(0, 4) + 1
        seen = asyncio.Event()
        stream = asyncio.create_task(soak.call("running_sum", str(n).encode(), self.headers(),
                                               chunk_event=(self.rng.randint(1, 3), seen)))
        await seen.wait()  # set by the first chunks, or when the stream ended (call's finally)
        cancel = await soak.call("running_sum", b"-1", self.headers())
        answer = await stream
        if answer.outcome == "ok":
            self.stream(n, answer)
        if cancel.outcome == "ok" and answer.outcome == "ok" and self.certain:
            body = cancel.body if isinstance(cancel.body, dict) else {}
            self.check(cancel, body.get("sum") == self.expected and body.get("cancelled") in (0, 1),
                       f"-1 answered {body}, the stream's last sum was {self.expected}")
        elif cancel.outcome == "ok" and isinstance(cancel.body, dict) and isinstance(cancel.body.get("sum"), int):
            self.expected, self.certain = cancel.body["sum"], True
        going = self.after(answer)
        return self.after(cancel) and going

    async def end(self) -> None:
        """End the sequence (``0``, or the end header on a last number), unless it already finished.
        Retried a few times: an open sequence left behind would be leaked state."""
        soak = self.soak
        for _ in range(3):
            if self.finished or not self.sid:
                return
            if self.rng.random() < 0.5:
                answer = await soak.call("running_sum", b"0", self.headers())
                if answer.outcome == "ok" and self.certain:
                    self.check(answer, answer.body == {"sum": self.expected, "ended": True}, f"end: {answer.body}")
            else:
                answer = await soak.call("running_sum", b"4", self.headers(**{SEQ_END: "true"}))
                if answer.outcome == "ok":
                    self.number(4, answer)
            self.after(answer)
            if answer.outcome in ("ok", "wrong"):
                return
