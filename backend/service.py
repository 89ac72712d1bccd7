"""One INFER frame in, one final INFER_REPLY out: the worker's per-frame logic, free of sockets.

Per request state (``WireRequest.state``):

* NEW — the input (``data`` entry and header view) is built once and remembered in ``active``.
* CONTINUE — id only on the wire; ``data[idx]`` is rebuilt from the remembered input (a shallow copy),
  so a TorchServe continuous-batching handler that re-reads ``data[idx]`` sees what it expects.
  A CONTINUE for an id that is not active gets a 500 result (done) and is not given to the handler.
* CANCEL — the id is forgotten and passed, with the frame's other cancels, to the handler's cancel
  hook once, before ``handle``. It is absent from ``data`` and ``context.request_ids``.

State probe: a CONTINUE for the reserved id ``STATE_PROBE_ID`` (``#state``; an id no client can
have, see frontend/api/common.py) never reaches the handler. It is answered, last in the final
reply and after the rest of the frame ran, with 200 and a JSON body of the worker's per-request
state: ``{"num_active": len(active)}`` plus the handler's own ``num_live_requests`` /
``num_live_sequences`` when it has them (an int attribute or property, or a zero-argument method).
The frontend sends one only when asked (``GET /models/{m}?state=true``), so leaked state is
observable from outside at no cost to ordinary frames.

Decode ahead (optional hook): a class handler's ``step_ahead()`` method, or a module-level
``step_ahead(context)`` function. With continuous batching on (the model's effective
``continuousBatching``), the worker calls ``step_ahead()`` here after it sent a frame's final reply
and found no next frame waiting, so the handler can start the next step in time the worker would
otherwise spend idle. If the hook raises, the error is kept and the next frame that reaches the
handler fails as if ``handle`` had raised it (every request of that frame, same status, cancel hook
called); the hook is not called again until then.

Results: one per request in ``data``, matched by id. ``done`` is, in order of precedence:
``context.set_done(idx, ...)`` if called; else ``context.stopping_criteria[idx](output)`` if that
exists and returns True/False (None: no opinion); else True. A done or failed request leaves
``active``. When the worker itself ends a request the handler may still hold state for (a failed
frame, an oversize or unserialisable output), it calls the cancel hook for it too.
"""

from __future__ import annotations

import inspect
import json
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass
from functools import partial
from typing import Any
from collections.abc import Callable, Mapping, Sequence

from backend.context import Context, RequestEntry
from backend.errors import PredictionException, status_for_exception
from backend.handler_loader import LoadedHandler
from backend.payloads import UnsupportedOutput, build_headers, build_input, decoding_enabled, encode_output
from backend.protocol import InferReply, InferRequest, RequestFlags, RequestState, WireResult

logger = logging.getLogger("conveyor.service")

# The reserved request id of a state probe (module docstring); frontend/workers/worker.py sends it.
STATE_PROBE_ID = "#state"
# Optional handler attributes reported, under the same names, in a state probe's answer.
HANDLER_STATE_COUNTS = ("num_live_requests", "num_live_sequences")


@dataclass(slots=True)
class ActiveRequest:
    """A request the handler has seen and that is not done yet (its remembered input)."""

    request_id: str
    sequence_id: str
    flags: RequestFlags
    headers: dict[str, Any]
    data: dict[str, Any]
    num_steps: int = 0  # frames this request has been through


class Service:
    def __init__(
        self,
        handler: LoadedHandler,
        context: Context,
        max_response_size: int,
        send: Callable[[InferReply], None] | None = None,
        max_active: int | None = None,
    ) -> None:
        self.handler = handler
        self.context = context
        self.max_response_size = max_response_size
        self._send = send  # for intermediate replies; the final reply is returned
        batch_size = int(context.system_properties.get("batch_size") or 1)
        # Safety net only: the frontend CONTINUEs or CANCELs every request it left unfinished. If it
        # does not, the least recently seen ids are dropped (and cancelled) past this many.
        self.max_active = max_active if max_active is not None else max(64, 4 * batch_size)
        self.active: OrderedDict[str, ActiveRequest] = OrderedDict()
        yaml_config = context.model_yaml_config or {}
        self._step_ahead = _step_ahead_hook(handler, context) if _runs_continuous(yaml_config) else None
        self._ahead_error: Exception | None = None  # raised by the hook; fails the next frame

    @property
    def can_step_ahead(self) -> bool:
        """Whether the worker should offer idle time between frames to ``step_ahead()``."""
        return self._step_ahead is not None

    def step_ahead(self) -> None:
        """Let the handler start its next step now (module docstring, "Decode ahead")."""
        if self._step_ahead is None or self._ahead_error is not None:
            return
        try:
            self._step_ahead()
        except Exception as exc:  # nothing to answer now: the next frame carries it, never the worker's death
            logger.error("handler %s: step_ahead failed; the next frame fails with it", self.handler.description,
                         exc_info=True)
            self._ahead_error = exc

    # -------------------------------------------------------------------------------- the frame

    def predict(self, frame: InferRequest) -> InferReply:
        results: list[WireResult] = []
        entries: list[tuple[ActiveRequest, bool]] = []
        cancelled: list[str] = []
        seen: set[str] = set()
        keys = (self.context.header_key_sequence_id, self.context.header_key_sequence_start,
                self.context.header_key_sequence_end)
        decode = decoding_enabled()  # TorchServe's environment switch, read once per frame
        probed = False
        for req in frame.requests:
            rid = req.request_id
            if rid == STATE_PROBE_ID:
                probed = True
                continue
            if rid in seen:
                logger.warning("frame %d: request %s appears twice; the repeat is ignored", frame.frame_id, rid)
                continue
            seen.add(rid)
            if req.state == RequestState.NEW:
                if rid in self.active:
                    logger.warning("frame %d: NEW for active request %s: it restarts", frame.frame_id, rid)
                    del self.active[rid]
                entry = ActiveRequest(rid, req.sequence_id, req.flags,
                                      build_headers(req.headers, req.parameters, req.sequence_id, req.flags, keys),
                                      build_input(req.parameters, decode))
                self.active[rid] = entry
                entries.append((entry, True))
            elif req.state == RequestState.CONTINUE:
                entry = self.active.get(rid)
                if entry is None:
                    results.append(WireResult(rid, 500, True, f"request {rid} is not active in this worker "
                                              "(CONTINUE for an unknown, finished or cancelled id)"))
                    continue
                self.active.move_to_end(rid)
                entries.append((entry, False))
            else:
                self.active.pop(rid, None)
                cancelled.append(rid)
        if cancelled:
            self._cancel(cancelled, "cancelled by the frontend")
        if len(self.active) > self.max_active:
            self._evict(seen)
        if entries:
            results.extend(self._run(frame.frame_id, entries, cancelled))
        if probed:
            results.append(self.state_result())
        return InferReply(frame.frame_id, True, tuple(results))

    def state_counts(self) -> dict[str, int]:
        """The worker's per-request state: its ``active`` table and the handler's own counts."""
        counts = {"num_active": len(self.active)}
        owner = self.handler.instance if self.handler.instance is not None else inspect.getmodule(self.handler.handle)
        for name in HANDLER_STATE_COUNTS:
            try:
                value = getattr(owner, name, None)
                if callable(value):
                    value = value()
                if isinstance(value, int) and not isinstance(value, bool):
                    counts[name] = value
            except Exception:  # a broken counter must not fail the frame it rides on
                logger.warning("handler %s: reading %s failed", self.handler.description, name, exc_info=True)
        return counts

    def state_result(self) -> WireResult:
        """The answer to a state probe (module docstring)."""
        body = json.dumps(self.state_counts()).encode()
        return WireResult(STATE_PROBE_ID, 200, True, "", "application/json", (), body)

    def _run(self, frame_id: int, entries: Sequence[tuple[ActiveRequest, bool]], cancelled: list[str]) -> list[WireResult]:
        ctx = self.context
        ctx.begin_frame([RequestEntry(e.request_id, e.headers, e.sequence_id, new) for e, new in entries], cancelled)
        data = [dict(e.data) for e, _ in entries]
        ids = [e.request_id for e, _ in entries]
        ahead_error, self._ahead_error = self._ahead_error, None
        if ahead_error is not None:  # as if this frame's handle() had raised it
            status, message = status_for_exception(ahead_error)
            logger.error("frame %d: handler %s failed in step_ahead before it (%d %s)", frame_id,
                         self.handler.description, status, message)
            return self._fail_all(ids, status, message)
        ctx.intermediate_sender = partial(self._send_intermediate, frame_id)
        start = time.perf_counter()
        try:
            ret = self.handler.handle(data, ctx)
        except Exception as exc:  # the handler's failure becomes every request's status, never the worker's death
            status, message = status_for_exception(exc)
            logger.error("frame %d: handler %s failed (%d %s)", frame_id, self.handler.description, status,
                         message, exc_info=True)
            return self._fail_all(ids, status, message)
        finally:
            ctx.intermediate_sender = None
        ctx.metrics.add_time("PredictionTime", round((time.perf_counter() - start) * 1000, 2))

        if ret is None:
            message = f"Invalid model predict output: handler returned None for a batch of {len(ids)}"
        elif not isinstance(ret, (list, tuple)):
            message = f"Invalid model predict output: handler returned {type(ret).__name__}, expected a list"
        elif len(ret) != len(ids):
            message = f"number of batch response mismatched: {len(ids)} requests, handler returned {len(ret)} outputs"
        else:
            message = ""
        if message:
            logger.error("frame %d: %s", frame_id, message)
            return self._fail_all(ids, 503, message)

        results: list[WireResult] = []
        ended: list[str] = []  # ended by the worker, not by the handler's own verdict
        for idx, rid in enumerate(ids):
            result, handler_said_done = self._result(idx, rid, ret[idx], final=True)
            results.append(result)
            if result.done:
                self.active.pop(rid, None)
                if not handler_said_done:
                    ended.append(rid)
            else:
                self.active[rid].num_steps += 1
        if ended:
            self._cancel(ended, "ended by the worker after an error")
        return results

    # -------------------------------------------------------------------------------- results

    def _result(self, idx: int, rid: str, value: Any, final: bool) -> tuple[WireResult, bool]:
        """One request's result; the bool says whether the handler considers it done."""
        ctx = self.context
        done = self._done(idx, value) if final else False
        if isinstance(done, WireResult):  # a stopping criterion raised
            return done, False
        try:
            body, default_type = encode_output(value)
        except UnsupportedOutput as exc:
            logger.error("request %s: %s", rid, exc)
            return WireResult(rid, 503, True, str(exc)), done
        if len(body) > self.max_response_size:
            message = (f"response of {len(body)} bytes for request {rid} exceeds max_response_size "
                       f"of {self.max_response_size} bytes")
            logger.error("%s", message)
            return WireResult(rid, 500, True, message), done
        status, phrase = ctx.get_response_status(idx)
        content_type = ""
        headers: list[tuple[str, str]] = []
        for name, header_value in ctx.get_response_headers(idx).items():
            if name.lower() == "content-type":
                content_type = str(header_value)
            else:
                headers.append((str(name), str(header_value)))
        if not content_type:  # the handler's declared type always wins; this is only the fallback
            content_type = default_type
        return WireResult(rid, status or 200, done, phrase or "", content_type, tuple(headers), body), done

    def _done(self, idx: int, value: Any) -> bool | WireResult:
        ctx = self.context
        verdict: bool | None = None
        criterion = _criterion(ctx.stopping_criteria, idx)
        if criterion is not None:
            # Always called, even when set_done decides: TorchServe handlers free state inside it.
            try:
                outcome = criterion(value)
            except Exception as exc:
                status, message = status_for_exception(exc)
                logger.error("request %s: stopping criterion failed", ctx.get_request_id(idx), exc_info=True)
                return WireResult(ctx.get_request_id(idx) or "", status, True, message)
            verdict = None if outcome is None else bool(outcome)
        explicit = ctx.explicit_done(idx)
        if explicit is not None:
            return explicit
        return True if verdict is None else verdict

    def _send_intermediate(self, frame_id: int, ret: Sequence[Any], req_id_map: Mapping[int, str], message: str,
                           code: int) -> None:
        """``send_intermediate_predict_response``: one INFER_REPLY(final=False), every result not done."""
        if self._send is None:
            raise RuntimeError("intermediate replies are not available outside a worker")
        results = []
        for idx, rid in req_id_map.items():
            result, _ = self._result(idx, rid, ret[idx], final=False)
            if result.done:  # oversize or unserialisable: fail the frame rather than end the stream silently
                raise PredictionException(result.message, result.status)
            results.append(result)
        self._send(InferReply(frame_id, False, tuple(results)))

    # -------------------------------------------------------------------------------- endings

    def _fail_all(self, ids: Sequence[str], status: int, message: str) -> list[WireResult]:
        for rid in ids:
            self.active.pop(rid, None)
        self._cancel(list(ids), "ended by the worker after an error")
        return [WireResult(rid, status, True, message) for rid in ids]

    def _cancel(self, ids: list[str], why: str) -> None:
        if self.handler.cancel is None:
            return
        try:
            self.handler.cancel(ids, self.context)
        except Exception:
            logger.error("cancel hook failed for %s (%s)", ids, why, exc_info=True)

    def _evict(self, keep: set[str]) -> None:
        excess = len(self.active) - self.max_active
        victims = [rid for rid in self.active if rid not in keep][:excess]
        for rid in victims:
            del self.active[rid]
        if victims:
            logger.warning("%d active requests exceed the limit of %d: forgetting the least recently seen %s "
                           "(the frontend should CONTINUE or CANCEL every unfinished request)",
                           len(self.active) + len(victims), self.max_active, victims)
            self._cancel(victims, "evicted")


def _runs_continuous(yaml_config: Mapping[str, Any]) -> bool:
    """The model's effective ``continuousBatching`` (the frontend writes it into model-config)."""
    value = yaml_config.get("continuousBatching", False)
    return value.strip().lower() == "true" if isinstance(value, str) else bool(value)


def _step_ahead_hook(handler: LoadedHandler, context: Context) -> Callable[[], Any] | None:
    """The handler's optional ``step_ahead`` (same shapes as the cancel hook: a method taking
    nothing, or a module function taking the context)."""
    if handler.instance is not None:
        method = getattr(handler.instance, "step_ahead", None)
        return method if callable(method) else None
    fn = getattr(inspect.getmodule(handler.handle), "step_ahead", None)
    return partial(fn, context) if callable(fn) and not inspect.isclass(fn) else None


def _criterion(criteria: Any, idx: int) -> Callable[[Any], Any] | None:
    if criteria is None:
        return None
    if isinstance(criteria, Mapping):
        found = criteria.get(idx)
    elif isinstance(criteria, Sequence) and idx < len(criteria):
        found = criteria[idx]
    else:
        found = None
    return found if callable(found) else None
