"""Running sum per sequence: a native Conveyor stateful handler for sequence batching.

Request body: an integer n — JSON (``3``), text or bytes (``"3"``), or ``{"input": 3}`` (the shape of
TorchServe's stateful tests). Response: the sum of the sequence's bodies so far, as JSON (``6``).

* The sequence id comes from ``context.get_sequence_id(idx)``; the state is one int per sequence id.
* A request with the start header (``context.header_key_sequence_start``) begins from 0. So does an
  id this worker has no state for: the frontend opens client-chosen ids without the start flag.
* The client ends a sequence with the end header on a request (the frontend's SEQUENCE_END flag
  shows as that header): the request is answered, then the state is freed.
* ``0`` ends the sequence from the handler's side: its answer carries the response header
  ``ts_request_sequence_end: <id>``, which makes the frontend close the sequence, and the state is
  freed at once.
* A body that is not an integer fails that request alone (400); the sequence's sum is unchanged.

The backend is not told when the server expires a sequence (idle or absolute timeout), so the state
is also bounded: an LRU of ``maxNumSequence`` entries, the most sequences the model can have open.
An expired sequence is idle longer than any open one, so it is the one evicted. ``num_live_sequences``
(sums held) is what the worker reports to a state probe (``GET /models/{m}?state=true``).

Without continuous batching the frontend sends one request per sequence per frame and the next one
only after the previous answer, so the requests of a frame belong to distinct sequences; the
handler still processes them in ``data`` order, which is arrival order within a sequence.
"""

from __future__ import annotations

import json
import logging
from collections import OrderedDict
from typing import Any

from backend.context import Context

logger = logging.getLogger("running_sum")

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


class RunningSumHandler:
    def __init__(self) -> None:
        self.sums: OrderedDict[str, int] = OrderedDict()  # sequence id -> sum; least recently used first
        self.capacity = DEFAULT_CAPACITY

    @property
    def num_live_sequences(self) -> int:
        return len(self.sums)

    def initialize(self, context: Context) -> None:
        self.capacity = int(context.model_yaml_config.get("maxNumSequence") or DEFAULT_CAPACITY)

    def handle(self, data: list, context: Context) -> list:
        return [self._one(idx, row, context) for idx, row in enumerate(data)]

    def _one(self, idx: int, row: Any, ctx: Context) -> Any:
        sequence_id = ctx.get_sequence_id(idx)
        if sequence_id is None:
            return _fail(ctx, idx, "no sequence id: this model needs sequenceBatching: true")
        try:
            n = parse_number(row)
        except ValueError as exc:
            return _fail(ctx, idx, f"sequence {sequence_id}: {exc}")
        if ctx.get_request_header(idx, ctx.header_key_sequence_start) is not None:
            self.sums.pop(sequence_id, None)  # a start always begins from 0
        total = self.sums.pop(sequence_id, 0) + n
        client_end = ctx.get_request_header(idx, ctx.header_key_sequence_end) is not None
        if n == 0:
            ctx.set_response_header(idx, ctx.header_key_sequence_end, sequence_id)
        if n == 0 or client_end:
            logger.info("END sequence=%s by=%s sum=%d open=%d", sequence_id, "handler" if n == 0 else "client",
                        total, len(self.sums))
        else:
            self.sums[sequence_id] = total  # re-inserted last: most recently used
            if len(self.sums) > self.capacity:
                evicted, _ = self.sums.popitem(last=False)
                logger.warning("more than %d sequences hold state: forgetting the least recently used, %s",
                               self.capacity, evicted)
        return total


def _fail(ctx: Context, idx: int, message: str) -> dict:
    ctx.set_response_status(400, message, idx)
    return {"error": message}

