"""Running sum with streams: a native Conveyor handler for sequence + continuous batching.

Request body: an integer n — JSON (``3``), text or bytes (``"3"``), or ``{"input": 3}``. The handler
keeps one sum per sequence id (``context.get_sequence_id(idx)``); every answer is JSON.

======  =============================================================================================
body    what happens
======  =============================================================================================
odd n   a stream of ten steps, one per frame: each step adds n to the sum and sends the chunk
        ``{"sum": S, "step": k, "of": 10}``; the 10th chunk is the last (``context.set_done``).
even n  answered at once: the sum grows by n, ``{"sum": S}``.
``-1``  cancels the running streams of its sequence that arrived before it. Each ends in this same
        step with one last chunk ``{"sum": S, "step": k, "of": 10, "cancelled": true}`` (the cancelled
        step adds nothing), and the ``-1`` is answered ``{"sum": S, "cancelled": <streams cancelled>}``.
``0``   ends the sequence: earlier streams are cancelled as by ``-1``; the answer ``{"sum": S, "ended":
        true}`` carries the response header ``ts_request_sequence_end: <id>`` (the frontend closes the
        sequence) and the sequence's state is freed at once.
======  =============================================================================================

The client's own end header on a request (the frontend's SEQUENCE_END flag) works like ``0`` once
that request is answered: earlier streams are cancelled, then the state is freed; on a streaming
request, the state is freed when its stream ends. A start header begins the sum from 0; an id this
worker holds no state for begins from 0 too (client-chosen ids open without the start flag).

What a frame looks like (docs/sequences.md): a running stream comes back step after step as a
CONTINUE entry (id only; the handler keeps the stream's state by request id); a later request of the
same sequence is admitted into the next step while the stream runs, *after* the stream's entry — the
entries of one sequence are in arrival order. So a ``-1`` meets the stream it cancels in the same
frame, and the stream's chunk of that frame is its "cancelled" chunk. The handler makes two passes:
first it finds, per sequence, the first request that cuts its streams (``-1``, ``0``, a non-streaming
request with the end header); then it answers every entry in ``data`` order.

A CANCEL entry (the client of a stream went away) reaches ``cancel(request_ids)`` before the frame's
``handle``: the stream's state is freed at once, the sum keeps the steps already sent, and the
sequence stays open. State is bounded as in ../sequence_batching: an LRU of ``maxNumSequence``
sequences, since the backend is not told when the server expires one.

``num_live_requests`` (running streams) and ``num_live_sequences`` (sums held) are what the worker
reports to a state probe (``GET /models/{m}?state=true``): both 0 once every sequence has ended.

``handler: {step_ms: N}`` in model-config.yaml makes every frame that steps a stream take N ms (a
model's decode step), so that a client has time to cancel. Every frame logs
``FRAME new=<ids> continuing=<ids> cancelled=<ids> sequences=<n> streams=<n>`` (the state held
after the frame), and every CANCEL ``CANCEL request=<id> ...``.
"""

from __future__ import annotations

import json
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from backend.context import Context

logger = logging.getLogger("running_sum_stream")

NUM_STEPS = 10
CANCEL = -1
END = 0
DEFAULT_CAPACITY = 64


def parse_number(row: Any) -> int:
    """The integer of one ``data`` entry; ValueError for anything else."""
    body = row.get("body", row.get("data")) if isinstance(row, dict) else row
    if isinstance(body, (bytes, bytearray)):
        body = body.decode("utf-8")  # UnicodeDecodeError is a ValueError
    if isinstance(body, str):
        try:
            body = json.loads(body)  # "3", "-1", " 3 "
        except ValueError:
            pass  # reported below, with the text
    if isinstance(body, dict):
        body = body.get("input")
    if isinstance(body, bool) or not isinstance(body, int):
        raise ValueError(f'the body must be an integer or {{"input": <integer>}}, got {body!r}')
    return body


def is_stream(n: int) -> bool:
    return n % 2 == 1 and n != CANCEL


@dataclass(slots=True)
class Stream:
    """One running odd-n request."""

    request_id: str
    sequence_id: str
    n: int
    steps: int = 0  # chunks sent so far
    ends_sequence: bool = False  # it carried the client's end header: free the sequence when it ends


@dataclass(slots=True)
class SequenceState:
    total: int = 0
    streams: dict[str, Stream] = field(default_factory=dict)  # its running streams, by request id


@dataclass(slots=True)
class Entry:
    """Pass one's view of ``data[idx]``."""

    idx: int
    request_id: str
    sequence_id: str | None
    is_new: bool
    n: int = 0  # NEW entries only
    error: str = ""
    start: bool = False
    client_end: bool = False

    @property
    def cuts(self) -> bool:
        """Does this request stop the earlier streams of its sequence?"""
        if not self.is_new or self.error:
            return False
        return self.n in (CANCEL, END) or (self.client_end and not is_stream(self.n))


class RunningSumStreamHandler:
    def __init__(self) -> None:
        # Invariant: a Stream is in ``streams`` iff it is in its sequence's ``SequenceState.streams``.
        self.sequences: OrderedDict[str, SequenceState] = OrderedDict()  # least recently used first
        self.streams: dict[str, Stream] = {}  # request id -> running stream
        self.capacity = DEFAULT_CAPACITY
        self.step_seconds = 0.0  # model-config.yaml `handler: {step_ms: N}`: a model's per-step cost
        self.num_stepped = 0  # streams stepped in the current frame

    @property
    def num_live_requests(self) -> int:
        return len(self.streams)

    @property
    def num_live_sequences(self) -> int:
        return len(self.sequences)

    def initialize(self, context: Context) -> None:
        cfg = context.model_yaml_config
        self.capacity = int(cfg.get("maxNumSequence") or DEFAULT_CAPACITY)
        self.step_seconds = float((cfg.get("handler") or {}).get("step_ms", 0)) / 1000.0

    # ------------------------------------------------------------------------------------ cancel

    def cancel(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            stream = self._drop_stream(rid)
            if stream is None:
                continue  # already finished (or never a stream): nothing to free
            logger.info("CANCEL request=%s sequence=%s step=%d", rid, stream.sequence_id, stream.steps)
            if stream.ends_sequence:
                self._free(stream.sequence_id, "client")

    # ------------------------------------------------------------------------------------ a frame

    def handle(self, data: list, context: Context) -> list:
        entries = [self._entry(idx, row, context) for idx, row in enumerate(data)]
        cut_at: dict[str, int] = {}  # sequence id -> index of its first cutting request in this frame
        for e in entries:
            if e.cuts and e.sequence_id is not None:
                cut_at.setdefault(e.sequence_id, e.idx)
        ended: set[str] = set()  # sequences freed earlier in this frame
        num_cancelled: dict[str, int] = {}  # sequence id -> streams cut in this frame, for the -1 answer
        self.num_stepped = 0
        out = [self._answer(e, context, cut_at, ended, num_cancelled) for e in entries]
        if self.num_stepped and self.step_seconds:
            time.sleep(self.step_seconds)  # one decode step of a real model, for all streams at once
        logger.info("FRAME new=%s continuing=%s cancelled=%s sequences=%d streams=%d",
                    _ids(context.new_request_ids), _ids(context.continuing_request_ids),
                    _ids(context.cancelled_request_ids), len(self.sequences), len(self.streams))
        return out

    def _entry(self, idx: int, row: Any, ctx: Context) -> Entry:
        e = Entry(idx, ctx.get_request_id(idx) or "", ctx.get_sequence_id(idx), ctx.is_new_request(idx))
        if e.sequence_id is None:
            e.error = "no sequence id: this model needs sequenceBatching: true"
        elif e.is_new:
            try:
                e.n = parse_number(row)
            except ValueError as exc:
                e.error = f"sequence {e.sequence_id}: {exc}"
            e.start = ctx.get_request_header(idx, ctx.header_key_sequence_start) is not None
            e.client_end = ctx.get_request_header(idx, ctx.header_key_sequence_end) is not None
        return e

    def _answer(self, e: Entry, ctx: Context, cut_at: dict[str, int], ended: set[str],
                num_cancelled: dict[str, int]) -> Any:
        sid = e.sequence_id
        if e.error or sid is None:
            return _fail(ctx, e.idx, 400, e.error)
        if sid in ended:
            return _fail(ctx, e.idx, 410, f"sequence {sid} ended earlier in this step")
        cut = e.idx < cut_at.get(sid, -1)  # a request of this sequence later in the frame stops this stream
        if not e.is_new:
            stream = self.streams.get(e.request_id)
            if stream is None:
                return _fail(ctx, e.idx, 410, f"request {e.request_id} of sequence {sid}: no running stream "
                                              "(its state was evicted or its sequence ended)")
            self.sequences.move_to_end(stream.sequence_id)  # a running sequence is recently used
            return self._cancel_chunk(e.idx, stream, ctx, num_cancelled) if cut else \
                self._step(e.idx, stream, ctx, ended)

        seq = self._sequence(sid, restart=e.start)
        if is_stream(e.n):
            stream = Stream(e.request_id, sid, e.n, ends_sequence=e.client_end)
            self.streams[e.request_id] = seq.streams[e.request_id] = stream
            return self._cancel_chunk(e.idx, stream, ctx, num_cancelled) if cut else \
                self._step(e.idx, stream, ctx, ended)
        ctx.set_done(e.idx, True)
        if e.n == CANCEL:
            answer: dict[str, Any] = {"sum": seq.total, "cancelled": num_cancelled.pop(sid, 0)}
        elif e.n == END:
            answer = {"sum": seq.total, "ended": True}
            ctx.set_response_header(e.idx, ctx.header_key_sequence_end, sid)
        else:
            seq.total += e.n
            answer = {"sum": seq.total}
        if e.n == END or e.client_end:
            self._free(sid, "handler" if e.n == END else "client")
            ended.add(sid)
        return answer

    def _step(self, idx: int, stream: Stream, ctx: Context, ended: set[str]) -> dict:
        seq = self.sequences[stream.sequence_id]
        stream.steps += 1
        seq.total += stream.n
        self.num_stepped += 1
        done = stream.steps == NUM_STEPS
        ctx.set_done(idx, done)
        chunk = {"sum": seq.total, "step": stream.steps, "of": NUM_STEPS}
        if done:
            self._drop_stream(stream.request_id)
            if stream.ends_sequence:
                self._free(stream.sequence_id, "client")
                ended.add(stream.sequence_id)
        return chunk

    def _cancel_chunk(self, idx: int, stream: Stream, ctx: Context, num_cancelled: dict[str, int]) -> dict:
        seq = self.sequences[stream.sequence_id]
        self._drop_stream(stream.request_id)
        num_cancelled[stream.sequence_id] = num_cancelled.get(stream.sequence_id, 0) + 1
        ctx.set_done(idx, True)
        return {"sum": seq.total, "step": stream.steps, "of": NUM_STEPS, "cancelled": True}

    # ------------------------------------------------------------------------------------ state

    def _sequence(self, sid: str, restart: bool) -> SequenceState:
        if restart:
            self._free(sid, "restart")
        seq = self.sequences.get(sid)
        if seq is None:
            seq = self.sequences[sid] = SequenceState()
            if len(self.sequences) > self.capacity:
                evicted = next(iter(self.sequences))
                logger.warning("more than %d sequences hold state: forgetting the least recently used, %s",
                               self.capacity, evicted)
                self._free(evicted, "evicted")
        self.sequences.move_to_end(sid)
        return seq

    def _drop_stream(self, rid: str) -> Stream | None:
        stream = self.streams.pop(rid, None)
        if stream is not None:
            self.sequences[stream.sequence_id].streams.pop(rid, None)
        return stream

    def _free(self, sid: str, by: str) -> None:
        seq = self.sequences.pop(sid, None)
        if seq is None:
            return
        for rid in seq.streams:
            del self.streams[rid]
        logger.info("END sequence=%s by=%s sum=%d", sid, by, seq.total)


def _fail(ctx: Context, idx: int, status: int, message: str) -> dict:
    ctx.set_response_status(status, message, idx)
    ctx.set_done(idx, True)
    return {"error": message}


def _ids(ids: list[str]) -> str:
    return ",".join(ids) if ids else "-"
