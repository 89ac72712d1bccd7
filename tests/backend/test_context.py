"""Context: TorchServe's API plus the continuous-decode additions; per-frame state refilled in place."""

from __future__ import annotations

import pytest

from backend.context import Context, RequestEntry, RequestProcessor

pytestmark = pytest.mark.timeout(10)


def make_context() -> Context:
    ctx = Context("m", "/models/m", {"model": {"modelName": "m"}}, 4, None, model_yaml_config={"batchSize": 4})
    ctx.begin_frame([
        RequestEntry("r0", {"Content-Type": "application/json", "X-Trace": "t0", "body": {"content-type": "a/b"}},
                     "seq-1", is_new=True),
        RequestEntry("r1", {"ts_request_sequence_id": "seq-h"}, "", is_new=False),
    ], cancelled_request_ids=["r9"])
    return ctx


def test_fixed_properties() -> None:
    ctx = make_context()
    assert ctx.model_name == "m" and ctx.manifest["model"]["modelName"] == "m"
    props = ctx.system_properties
    assert props["model_dir"] == "/models/m" and props["gpu_id"] is None and props["batch_size"] == 4
    assert props["server_name"] == "Conveyor" and props["server_version"]
    assert ctx.model_yaml_config == {"batchSize": 4} and ctx.cache == {}


def test_request_side() -> None:
    ctx = make_context()
    assert ctx.request_ids == {0: "r0", 1: "r1"}
    assert ctx.get_request_id() == "r0" and ctx.get_request_id(1) == "r1" and ctx.get_request_id(5) is None
    assert ctx.get_request_header(0, "content-type") == "application/json"  # case-insensitive
    assert ctx.get_request_header(0, "X-TRACE") == "t0" and ctx.get_request_header(0, "missing") is None
    assert ctx.get_request_header(0, "body") == {"content-type": "a/b"}  # TorchServe's per-parameter entry
    assert ctx.get_all_request_header(0)["X-Trace"] == "t0"
    assert ctx.get_sequence_id(0) == "seq-1"  # from the frame
    assert ctx.get_sequence_id(1) == "seq-h"  # from the sequence header
    assert ctx.is_new_request(0) and not ctx.is_new_request(1)
    assert ctx.new_request_ids == ["r0"] and ctx.continuing_request_ids == ["r1"]
    assert ctx.cancelled_request_ids == ["r9"]


def test_response_side() -> None:
    ctx = make_context()
    assert ctx.get_response_status(0) == (200, None)
    ctx.set_response_status(404, "Not Here", idx=1)
    assert ctx.get_response_status(1) == (404, "Not Here") and ctx.get_response_status(0) == (200, None)
    ctx.set_all_response_status(202, "Accepted")
    assert ctx.get_response_status(0) == ctx.get_response_status(1) == (202, "Accepted")
    ctx.set_response_header(0, "X-A", "1")
    ctx.set_response_header(0, "x-a", "2")  # same header, other case: replaces
    assert ctx.get_response_headers(0) == {"x-a": "2"}
    ctx.set_response_content_type(0, "text/csv")
    assert ctx.get_response_content_type(0) == "text/csv" and ctx.get_response_content_type(1) is None


def test_done_marks_and_frame_reset() -> None:
    ctx = make_context()
    assert ctx.is_done(0) and ctx.explicit_done(0) is None
    ctx.set_done(0, False)
    assert not ctx.is_done(0) and ctx.explicit_done(0) is False
    ctx.stopping_criteria = [lambda out: True]
    ids, procs, new_ids = ctx.request_ids, ctx.request_processor, ctx.new_request_ids
    ctx.begin_frame([RequestEntry("r5", {}, "", is_new=True)])
    # Same objects, refilled: a reference a handler kept shows the current frame.
    assert ids is ctx.request_ids and ids == {0: "r5"} and procs is ctx.request_processor and new_ids == ["r5"]
    assert ctx.stopping_criteria is None and ctx.cancelled_request_ids == [] and ctx.is_done(0)
    assert ctx.get_sequence_id(0) is None


def test_torchserve_style_construction() -> None:
    """TorchServe unit tests build a Context positionally and set request_processor by hand."""
    ctx = Context("model_name", "model_dir", "manifest", 2, 0, "1.0")
    ctx.request_processor = [RequestProcessor({"a": "b"})]
    ctx.request_ids = {0: "request_0"}
    assert ctx.get_request_header(0, "A") == "b" and ctx.get_request_id(0) == "request_0"
    ctx.metrics.add_time("HandlerTime", 1.5, None, "ms")
    ctx.metrics.add_counter("c", 1)
