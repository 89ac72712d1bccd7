"""A deterministic streaming test handler (continuous decode without a model).

Request body: JSON ``{"n": N, "step_ms": MS}`` (``step_ms`` optional) or a plain integer N. The
response is N chunks, each JSON ``{"i": k, "of": N}`` for k = 0 … N-1.

* With ``continuousBatching: true`` (model-config.yaml): one chunk per request per frame; the last
  one is marked done with ``context.set_done``. Requests join and leave between frames.
* Otherwise (plain batching): the first N-1 chunks go out as intermediate replies
  (``send_intermediate_predict_response``) and the last is the frame's final result.

Each frame sleeps the largest ``step_ms`` of its requests (a fixed per-step cost for benchmarks) and
logs ``STEP frame=<k> new=<ids> continuing=<ids> cancelled=<ids>`` to stderr, so tests can prove
that requests joined a running batch. ``cancel(request_ids)`` frees a request's state at once and
logs ``CANCEL ids=<ids>``. ``num_live_requests`` (the streams it holds state for) is what the
worker reports to a state probe (``GET /models/{m}?state=true``): 0 once no stream runs.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

from backend.context import Context
from backend.handler_utils import send_intermediate_predict_response

logger = logging.getLogger("streaming_handler")


def _ids(ids: list[str]) -> str:
    return ",".join(ids) if ids else "-"


class StreamingHandler:
    def __init__(self) -> None:
        self.context: Context | None = None
        self.steps: dict[str, int] = {}  # request id -> chunks already emitted
        self.num_frames = 0
        self.initialized = False

    @property
    def num_live_requests(self) -> int:
        return len(self.steps)

    def initialize(self, context: Context) -> None:
        self.context = context
        self.continuous = bool(context.model_yaml_config.get("continuousBatching", False))
        self.initialized = True

    @staticmethod
    def parse(row: Any) -> tuple[int, float]:
        """(N, step seconds) from a data entry; ValueError for anything else."""
        body = row.get("body", row.get("data")) if isinstance(row, dict) else row
        if isinstance(body, (bytes, bytearray)):
            body = body.decode("utf-8")
        if isinstance(body, str):
            body = json.loads(body)
        step_ms = 0.0
        if isinstance(body, dict):
            step_ms = float(body.get("step_ms", 0) or 0)
            body = body.get("n")
        if isinstance(body, bool) or not isinstance(body, int) or body < 1:
            raise ValueError(f'body must be a positive integer or {{"n": N}}, got {body!r}')
        return body, step_ms / 1000.0

    def cancel(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self.steps.pop(rid, None)
        logger.info("CANCEL ids=%s", _ids(request_ids))

    def handle(self, data: list, context: Context) -> list:
        self.num_frames += 1
        logger.info("STEP frame=%d new=%s continuing=%s cancelled=%s", self.num_frames,
                    _ids(context.new_request_ids), _ids(context.continuing_request_ids),
                    _ids(context.cancelled_request_ids))
        parsed: list[tuple[int, float] | None] = []
        for idx, row in enumerate(data):
            try:
                parsed.append(self.parse(row))
            except (ValueError, TypeError) as exc:
                context.set_response_status(400, "Bad Request", idx)
                parsed.append(None)
                self.steps.pop(context.get_request_id(idx) or "", None)
                data[idx] = {"error": str(exc)}
        step = max((p[1] for p in parsed if p is not None), default=0.0)
        if step:
            time.sleep(step)
        if self.continuous:
            return [self._next_chunk(idx, p, context) if p else data[idx] for idx, p in enumerate(parsed)]
        return self._stream_whole(data, parsed, context, step)

    def _next_chunk(self, idx: int, parsed: tuple[int, float], context: Context) -> str:
        rid = context.get_request_id(idx) or ""
        n = parsed[0]
        k = self.steps.get(rid, 0)
        done = k >= n - 1
        context.set_done(idx, done)
        context.set_response_content_type(idx, "application/json")
        if done:
            self.steps.pop(rid, None)
        else:
            self.steps[rid] = k + 1
        return json.dumps({"i": k, "of": n})

    def _stream_whole(self, data: list, parsed: list, context: Context, step: float) -> list:
        """Plain batching: all chunks in one frame, the last one as the final result. Each step
        costs ``step_ms`` as in continuous mode (the first one was paid by ``handle``)."""
        for idx, p in enumerate(parsed):
            if p:
                context.set_response_content_type(idx, "application/json")
        longest = max((p[0] for p in parsed if p), default=1)
        for k in range(longest - 1):
            req_map = {idx: context.request_ids[idx] for idx, p in enumerate(parsed) if p and k < p[0] - 1}
            if req_map:
                chunks = [json.dumps({"i": k, "of": p[0]}) if p else "" for p in parsed]
                send_intermediate_predict_response(chunks, req_map, "Intermediate response", 200, context)
            if step:
                time.sleep(step)  # the cost of step k + 1
        return [json.dumps({"i": p[0] - 1, "of": p[0]}) if p else data[idx] for idx, p in enumerate(parsed)]
