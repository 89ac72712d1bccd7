"""The Context a handler receives: model facts fixed at load, plus the state of the current frame.

Names and signatures follow TorchServe's ``ts.context`` so handlers port unchanged (``ts.context``
in the compatibility namespace re-exports these classes). Additions for continuous decode:
``is_new_request``, ``new_request_ids``, ``continuing_request_ids``, ``cancelled_request_ids``,
``set_done`` and ``is_done``.

Lifetime rules (the worker calls ``begin_frame`` once per INFER frame):

* Fixed for the worker's life: ``model_name``, ``manifest``, ``system_properties``,
  ``model_yaml_config``, ``metrics``, ``cache`` (handler-owned; the worker never touches it).
* Per frame: ``request_ids``, ``request_processor``, ``new_request_ids``, ``continuing_request_ids``,
  ``cancelled_request_ids``, response status/headers/content type, the ``done`` marks, and
  ``stopping_criteria`` (reset to None). The dict and lists keep their identity for the worker's
  life and are refilled in place, so a reference a handler took earlier always shows the current
  frame, never a stale one. Copy them if you need a past frame's values.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any
from collections.abc import Callable, Mapping, Sequence

SERVER_NAME = "Conveyor"
SERVER_VERSION = "0.1.0"

logger = logging.getLogger("conveyor.metrics")


@dataclass(frozen=True, slots=True)
class RequestEntry:
    """What the worker knows about one request of the frame (NEW or CONTINUE), in ``data`` order."""

    request_id: str
    headers: Mapping[str, Any]  # request headers (+ TorchServe's per-parameter content types)
    sequence_id: str = ""
    is_new: bool = True


class RequestProcessor:
    """One request's headers in and response status/headers out, for one frame (TorchServe's name).

    Request header lookups are case-insensitive, as HTTP requires. The response content type is kept
    as the ``content-type`` response header, as TorchServe does; the worker moves it to the wire's
    content_type field.
    """

    __slots__ = ("_done", "_lower", "_new", "_reason_phrase", "_request_header", "_response_header", "_status_code")

    def __init__(self, request_header: Mapping[str, Any], is_new: bool = True) -> None:
        self._request_header = dict(request_header)
        self._lower = {str(k).lower(): v for k, v in self._request_header.items()}
        self._status_code = 200
        self._reason_phrase: str | None = None
        self._response_header: dict[str, str] = {}
        self._done: bool | None = None  # None: the handler did not say
        self._new = is_new

    def get_request_property(self, key: str) -> Any:
        return self._lower.get(key.lower())

    def get_request_properties(self) -> dict[str, Any]:
        return self._request_header

    def report_status(self, code: int, reason_phrase: str | None = None) -> None:
        self._status_code = code
        self._reason_phrase = reason_phrase

    def get_response_status_code(self) -> int:
        return self._status_code

    def get_response_status_phrase(self) -> str | None:
        return self._reason_phrase

    def add_response_property(self, key: str, value: str) -> None:
        # One entry per header name whatever its case, so a later set replaces an earlier one.
        for existing in [k for k in self._response_header if k.lower() == key.lower()]:
            del self._response_header[existing]
        self._response_header[key] = value

    def get_response_headers(self) -> dict[str, str]:
        return self._response_header

    def get_response_header(self, key: str) -> str | None:
        for k, v in self._response_header.items():
            if k.lower() == key.lower():
                return v
        return None


class Metrics:
    """A minimal TorchServe-like metrics recorder: each call logs one ``[METRICS]`` line at DEBUG.

    Kept small on purpose: handlers that call ``context.metrics.add_time(...)`` work; the frontend
    owns the real metrics (Prometheus).
    """

    def __init__(self, model_name: str = "") -> None:
        self.model_name = model_name
        self.request_ids: Mapping[int, str] | None = None

    def set_request_ids(self, request_ids: Mapping[int, str]) -> None:
        self.request_ids = request_ids

    def add_metric(self, name: str, value: float, unit: str = "", idx: Any = None, dimensions: Any = None,
                   metric_type: Any = None) -> None:
        if logger.isEnabledFor(logging.DEBUG):
            req = self.request_ids.get(idx) if (idx is not None and self.request_ids) else None
            dims = ",".join(str(d) for d in (dimensions or []))
            logger.debug("[METRICS]%s.%s:%s|#ModelName:%s%s%s", name, unit, value, self.model_name,
                         f",{dims}" if dims else "", f"|request_id:{req}" if req else "")

    def add_counter(self, name: str, value: float, idx: Any = None, dimensions: Any = None) -> None:
        self.add_metric(name, value, "count", idx, dimensions)

    def add_time(self, name: str, value: float, idx: Any = None, unit: str = "ms", dimensions: Any = None,
                 metric_type: Any = None) -> None:
        self.add_metric(name, value, unit, idx, dimensions)

    def add_size(self, name: str, value: float, idx: Any = None, unit: str = "MB", dimensions: Any = None,
                 metric_type: Any = None) -> None:
        self.add_metric(name, value, unit, idx, dimensions)

    def add_percent(self, name: str, value: float, idx: Any = None, dimensions: Any = None,
                    metric_type: Any = None) -> None:
        self.add_metric(name, value, "percent", idx, dimensions)

    def add_error(self, name: str, value: float, dimensions: Any = None) -> None:
        self.add_metric(name, value, "error", None, dimensions)


# send_intermediate_predict_response(ret, req_id_map, message, code) as installed by the worker.
IntermediateSender = Callable[[Sequence[Any], Mapping[int, str], str, int], None]


class Context:
    """Model facts + the current frame. Constructor arguments in TorchServe's order."""

    def __init__(
        self,
        model_name: str,
        model_dir: str,
        manifest: dict | None,
        batch_size: int,
        gpu: int | None,
        mms_version: str = SERVER_VERSION,
        limit_max_image_pixels: bool = True,
        metrics: Metrics | None = None,
        model_yaml_config: dict | None = None,
    ) -> None:
        self.model_name = model_name
        self.manifest = manifest if manifest is not None else {}
        self._system_properties = {
            "model_dir": model_dir,
            "gpu_id": gpu,
            "batch_size": batch_size,
            "server_name": SERVER_NAME,
            "server_version": mms_version,
            "limit_max_image_pixels": limit_max_image_pixels,
        }
        self.model_yaml_config: dict = model_yaml_config if model_yaml_config is not None else {}
        self.metrics = metrics if metrics is not None else Metrics(model_name)
        self.cache: dict = {}  # handler-owned, persists across frames
        # Per frame (see the module docstring): refilled in place by begin_frame.
        self.request_ids: dict[int, str] = {}
        self.request_processor: list[RequestProcessor] = []
        self.new_request_ids: list[str] = []
        self.continuing_request_ids: list[str] = []
        self.cancelled_request_ids: list[str] = []
        self.stopping_criteria: Any = None  # None, or list/dict idx -> callable(output) -> bool|None
        self._sequence_ids: list[str] = []
        self.intermediate_sender: IntermediateSender | None = None
        self.cl_socket = None  # TorchServe's attribute; Conveyor replies through intermediate_sender
        # TorchServe reads these names from the environment too; the frontend sets them for workers.
        self.header_key_sequence_id = os.getenv("TS_REQUEST_SEQUENCE_ID", "ts_request_sequence_id")
        self.header_key_sequence_start = os.getenv("TS_REQUEST_SEQUENCE_START", "ts_request_sequence_start")
        self.header_key_sequence_end = os.getenv("TS_REQUEST_SEQUENCE_END", "ts_request_sequence_end")

    @property
    def system_properties(self) -> dict:
        return self._system_properties

    # -- the worker's side ----------------------------------------------------------------------

    def begin_frame(self, entries: Sequence[RequestEntry], cancelled_request_ids: Sequence[str] = ()) -> None:
        """Describe a new frame. ``entries`` is in ``data`` order; cancelled ids are not in it."""
        self.request_ids.clear()
        self.request_ids.update((idx, e.request_id) for idx, e in enumerate(entries))
        self.request_processor[:] = [RequestProcessor(e.headers, e.is_new) for e in entries]
        self._sequence_ids[:] = [e.sequence_id for e in entries]
        self.new_request_ids[:] = [e.request_id for e in entries if e.is_new]
        self.continuing_request_ids[:] = [e.request_id for e in entries if not e.is_new]
        self.cancelled_request_ids[:] = list(cancelled_request_ids)
        self.stopping_criteria = None
        self.metrics.set_request_ids(self.request_ids)

    # -- requests -------------------------------------------------------------------------------

    def get_request_id(self, idx: int = 0) -> str | None:
        return self.request_ids.get(idx) if self.request_ids is not None else None

    def get_request_header(self, idx: int, key: str) -> Any:
        """A request header by name, case-insensitively; None when absent."""
        return self.request_processor[idx].get_request_property(key)

    def get_all_request_header(self, idx: int) -> dict[str, Any]:
        return self.request_processor[idx].get_request_properties()

    def get_sequence_id(self, idx: int) -> str | None:
        """The request's sequence id (from the frame, else the sequence header); None outside sequences."""
        seq = self._sequence_ids[idx] if idx < len(self._sequence_ids) else ""
        if not seq:
            seq = self.get_request_header(idx, self.header_key_sequence_id) or ""
        return seq or None

    def is_new_request(self, idx: int) -> bool:
        """True for a request the handler sees for the first time (NEW), False for a CONTINUE."""
        return self.request_processor[idx]._new

    # -- responses ------------------------------------------------------------------------------

    def set_response_status(self, code: int = 200, phrase: str = "", idx: int = 0) -> None:
        if self.request_processor is not None and self.request_processor[idx] is not None:
            self.request_processor[idx].report_status(code, reason_phrase=phrase)

    def set_all_response_status(self, code: int = 200, phrase: str = "") -> None:
        for idx in range(len(self.request_processor)):  # by index: TorchServe tests assign a dict here
            self.request_processor[idx].report_status(code, reason_phrase=phrase)

    def get_response_status(self, idx: int) -> tuple[int, str | None]:
        rp = self.request_processor[idx]
        return rp.get_response_status_code(), rp.get_response_status_phrase()

    def set_response_header(self, idx: int, key: str, value: str) -> None:
        self.request_processor[idx].add_response_property(key, value)

    def get_response_headers(self, idx: int) -> dict[str, str]:
        return self.request_processor[idx].get_response_headers()

    def set_response_content_type(self, idx: int, value: str) -> None:
        self.set_response_header(idx, "content-type", value)

    def get_response_content_type(self, idx: int) -> str | None:
        return self.request_processor[idx].get_response_header("content-type")

    # -- continuous decode ----------------------------------------------------------------------

    def set_done(self, idx: int, done: bool = True) -> None:
        """Mark request ``idx``'s result of this frame as its last (True) or not (False)."""
        self.request_processor[idx]._done = bool(done)

    def is_done(self, idx: int) -> bool:
        """What ``set_done`` said for this frame, else True (the default; stopping_criteria apply later)."""
        done = self.request_processor[idx]._done
        return True if done is None else done

    def explicit_done(self, idx: int) -> bool | None:
        """``set_done``'s value, or None if the handler did not call it (used by the worker)."""
        return self.request_processor[idx]._done
