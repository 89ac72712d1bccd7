"""The per-frame logic without a process: inputs, output serialisation, error mapping, done rules,
the active table (NEW / CONTINUE / CANCEL) and intermediate replies."""

from __future__ import annotations

import io
import json
from typing import Any
from collections.abc import Callable

import pytest
import torch

from backend.context import Context
from backend.errors import PredictionException, status_for_exception
from backend.handler_loader import LoadedHandler
from backend.handler_utils import send_intermediate_predict_response
from backend.payloads import build_headers, build_input
from backend.protocol import InferReply, InferRequest, InputParameter, RequestFlags, WireResult
from backend.service import Service
from tests.backend.conftest import cancel, cont, new

pytestmark = pytest.mark.timeout(10)


class Recorder:
    """A handler built from a function, recording every call and cancel."""

    def __init__(self, fn: Callable[[list, Context], Any]) -> None:
        self.fn = fn
        self.calls: list[tuple[list, list[str]]] = []
        self.cancels: list[list[str]] = []

    def handle(self, data: list, ctx: Context) -> Any:
        self.calls.append(([dict(d) for d in data], list(ctx.request_ids.values())))
        return self.fn(data, ctx)

    def cancel(self, ids: list[str], ctx: Context) -> None:
        self.cancels.append(list(ids))


def make_service(fn: Callable[[list, Context], Any], max_response_size: int = 1000, batch_size: int = 4,
                 max_active: int | None = None) -> tuple[Service, Recorder, list[InferReply]]:
    rec = Recorder(fn)
    sent: list[InferReply] = []
    ctx = Context("m", "/tmp", {"model": {}}, batch_size, None)
    svc = Service(LoadedHandler("test", rec.handle, rec.cancel), ctx, max_response_size, sent.append, max_active)
    return svc, rec, sent


def by_id(reply: InferReply) -> dict[str, WireResult]:
    return {r.request_id: r for r in reply.results}


def bodies(data: list, ctx: Context) -> list:
    return [row["body"] for row in data]


# ------------------------------------------------------------------------------------- inputs


def test_input_decoding(monkeypatch: pytest.MonkeyPatch) -> None:
    params = [InputParameter("a", "application/json; charset=utf-8", b'{"k": [1]}'),
              InputParameter("b", "application/json", b"{not json"),
              InputParameter("c", "text/plain", "héllo".encode()),
              InputParameter("d", "text/plain", b"\xff\xfe"),
              InputParameter("e", "image/png", b"\x89PNG"),
              InputParameter("f", "application/vnd.api+json", b"3")]
    assert build_input(params) == {"a": {"k": [1]}, "b": b"{not json", "c": "héllo", "d": b"\xff\xfe",
                                   "e": b"\x89PNG", "f": 3}
    monkeypatch.setenv("TS_DECODE_INPUT_REQUEST", "false")
    assert build_input(params[:1]) == {"a": b'{"k": [1]}'}


def test_header_view_fills_sequence_headers() -> None:
    params = [InputParameter("body", "text/plain", b"x")]
    view = build_headers([("X-A", "1"), ("x-a", "2")], params, "seq-9", RequestFlags.SEQUENCE_START)
    assert view["body"] == {"content-type": "text/plain"} and view["X-A"] == "1, 2"
    assert view["ts_request_sequence_id"] == "seq-9" and view["ts_request_sequence_start"] == "true"
    client = build_headers([("TS_Request_Sequence_Id", "mine")], params, "seq-9")
    assert "ts_request_sequence_id" not in client  # the client's own header is kept as sent


# ------------------------------------------------------------------------------------- outputs


def test_output_serialisation_and_content_types() -> None:
    tensor = torch.arange(3)

    def fn(data: list, ctx: Context) -> list:
        ctx.set_response_content_type(4, "text/csv")
        ctx.set_response_header(4, "X-Extra", "yes")
        ctx.set_response_status(201, "Created", 4)
        return [b"\x00raw", "text é", {"a": [1, 2]}, tensor, "a,b"]

    svc, _, _ = make_service(fn, max_response_size=100_000)
    res = svc.predict(InferRequest(1, [new(f"r{i}", "1") for i in range(5)])).results
    assert (res[0].body, res[0].content_type) == (b"\x00raw", "application/octet-stream")
    assert (res[1].body, res[1].content_type) == ("text é".encode(), "text/plain; charset=utf-8")
    assert json.loads(res[2].body) == {"a": [1, 2]} and res[2].content_type == "application/json"
    assert res[2].body == json.dumps({"a": [1, 2]}, indent=2).encode()  # TorchServe's formatting
    assert torch.equal(torch.load(io.BytesIO(res[3].body)), tensor)
    assert (res[4].status, res[4].message, res[4].content_type) == (201, "Created", "text/csv")
    assert res[4].headers == (("X-Extra", "yes"),)  # content-type travels in its own field only
    assert all(r.done for r in res)


def test_unserialisable_output_fails_only_that_request() -> None:
    svc, rec, _ = make_service(lambda data, ctx: [object(), "ok"])
    res = by_id(svc.predict(InferRequest(1, [new("a", "1"), new("b", "2")])))
    assert res["a"].status == 503 and "Unsupported model output" in res["a"].message
    assert res["b"].status == 200 and res["b"].body == b"ok"


def test_oversize_body_fails_only_that_request() -> None:
    svc, _, _ = make_service(lambda data, ctx: ["x" * 11, "y" * 10], max_response_size=10)
    res = by_id(svc.predict(InferRequest(1, [new("a", "1"), new("b", "2")])))
    assert res["a"].status == 500 and "11 bytes" in res["a"].message and "10 bytes" in res["a"].message
    assert res["b"].status == 200


# ------------------------------------------------------------------------------------- errors


@pytest.mark.parametrize("exc, status, text", [
    (PredictionException("bad input", 418), 418, "bad input"),
    (MemoryError("no RAM"), 507, "Out of resources: MemoryError: no RAM"),
    (torch.OutOfMemoryError("CUDA out of memory"), 507, "Out of resources"),
    (ValueError("nope"), 503, "Prediction failed: ValueError: nope"),
    (RuntimeError("CUDA error: device-side assert"), 503, "Prediction failed"),  # no text sniffing
])
def test_error_mapping(exc: Exception, status: int, text: str) -> None:
    def fn(data: list, ctx: Context) -> list:
        raise exc

    svc, rec, _ = make_service(fn)
    reply = svc.predict(InferRequest(1, [new("a", "1"), new("b", "2")]))
    assert [(r.status, r.done) for r in reply.results] == [(status, True), (status, True)]
    assert all(text in r.message for r in reply.results)
    assert svc.active == {} and rec.cancels == [["a", "b"]]  # failed requests end, the handler is told


@pytest.mark.parametrize("ret, text", [
    (None, "returned None for a batch of 2"),
    ("oops", "returned str, expected a list"),
    (["only one"], "2 requests, handler returned 1 outputs"),
])
def test_bad_handler_output(ret: Any, text: str) -> None:
    svc, _, _ = make_service(lambda data, ctx: ret)
    reply = svc.predict(InferRequest(1, [new("a", "1"), new("b", "2")]))
    assert all(r.status == 503 and text in r.message for r in reply.results)


def test_real_torchserve_prediction_exception_class_is_recognised(monkeypatch: pytest.MonkeyPatch) -> None:
    import types

    class TsPredictionException(Exception):
        def __init__(self, message: str, error_code: int = 500) -> None:
            super().__init__(message)
            self.message, self.error_code = message, error_code

    fake = types.ModuleType("ts.utils.util")
    fake.PredictionException = TsPredictionException  # type: ignore[attr-defined]
    monkeypatch.setitem(__import__("sys").modules, "ts.utils.util", fake)
    assert status_for_exception(TsPredictionException("teapot", 418)) == (418, "teapot")


# ------------------------------------------------------------------------------------- done rules


def test_done_rules() -> None:
    stopped: list[int] = []

    def fn(data: list, ctx: Context) -> list:
        ctx.set_done(0, False)  # explicit: wins over the criterion below, which is still called
        ctx.stopping_criteria = {0: lambda out: stopped.append(0) or True, 1: lambda out: False,
                                 2: lambda out: None}
        return ["a", "b", "c", "d"]

    svc, _, _ = make_service(fn)
    res = by_id(svc.predict(InferRequest(1, [new(r, "1") for r in "abcd"])))
    assert [res[r].done for r in "abcd"] == [False, False, True, True]
    assert stopped == [0]
    assert set(svc.active) == {"a", "b"} and svc.active["a"].num_steps == 1


def test_stopping_criteria_as_list_like_torchserve() -> None:
    svc, _, _ = make_service(lambda data, ctx: setattr(ctx, "stopping_criteria", [lambda o: o == "stop", lambda o: o == "stop"]) or ["go", "stop"])
    res = by_id(svc.predict(InferRequest(1, [new("a", "1"), new("b", "1")])))
    assert not res["a"].done and res["b"].done


def test_failing_criterion_fails_only_its_request() -> None:
    def fn(data: list, ctx: Context) -> list:
        ctx.stopping_criteria = [lambda out: 1 / 0, lambda out: False]
        return ["x", "y"]

    svc, rec, _ = make_service(fn)
    res = by_id(svc.predict(InferRequest(1, [new("a", "1"), new("b", "1")])))
    assert res["a"].status == 503 and "ZeroDivisionError" in res["a"].message and res["a"].done
    assert res["b"].status == 200 and not res["b"].done
    assert set(svc.active) == {"b"} and rec.cancels == [["a"]]


# ------------------------------------------------------------------------------------- active table


def test_new_continue_cancel() -> None:
    def fn(data: list, ctx: Context) -> list:
        for idx in range(len(data)):
            ctx.set_done(idx, False)
        return bodies(data, ctx)

    svc, rec, _ = make_service(fn)
    svc.predict(InferRequest(1, [new("a", '{"n": 1}'), new("b", "2")]))
    reply = svc.predict(InferRequest(2, [cont("a"), cancel("b"), new("c", "3")]))
    # CONTINUE rebuilt a's input; b is absent from data and request_ids; the hook ran once, before handle.
    assert rec.calls[1] == ([{"body": {"n": 1}}, {"body": 3}], ["a", "c"])
    assert rec.cancels == [["b"]]
    assert [r.request_id for r in reply.results] == ["a", "c"]
    assert set(svc.active) == {"a", "c"} and svc.active["a"].num_steps == 2


def test_handler_mutating_data_does_not_change_the_remembered_input() -> None:
    def fn(data: list, ctx: Context) -> list:
        ctx.set_done(0, False)
        data[0].pop("body")
        return ["x"]

    svc, rec, _ = make_service(fn)
    svc.predict(InferRequest(1, [new("a", "1")]))
    svc.predict(InferRequest(2, [cont("a")]))
    assert rec.calls[1][0] == [{"body": 1}]


def test_cancel_only_frame_and_unknown_continue() -> None:
    svc, rec, _ = make_service(bodies)
    reply = svc.predict(InferRequest(3, [cancel("x"), cancel("y")]))
    assert reply == InferReply(3, True, ()) and rec.calls == [] and rec.cancels == [["x", "y"]]
    reply = svc.predict(InferRequest(4, [cont("ghost"), new("a", "1")]))
    res = by_id(reply)
    assert res["ghost"].status == 500 and "not active" in res["ghost"].message
    assert rec.calls == [([{"body": 1}], ["a"])]


def test_done_requests_leave_the_active_table() -> None:
    svc, _, _ = make_service(bodies)
    svc.predict(InferRequest(1, [new("a", "1")]))
    assert svc.active == {}


def test_eviction_safety_net() -> None:
    def fn(data: list, ctx: Context) -> list:
        for idx in range(len(data)):
            ctx.set_done(idx, False)
        return bodies(data, ctx)

    svc, rec, _ = make_service(fn, max_active=2)
    svc.predict(InferRequest(1, [new("a", "1")]))
    svc.predict(InferRequest(2, [new("b", "1")]))
    svc.predict(InferRequest(3, [new("c", "1")]))  # a was never continued: the oldest goes
    assert list(svc.active) == ["b", "c"] and rec.cancels == [["a"]]


# ------------------------------------------------------------------------------------- intermediate


def test_intermediate_replies() -> None:
    def fn(data: list, ctx: Context) -> list:
        ctx.set_response_header(0, "x-part", "1")
        send_intermediate_predict_response(["part-a", "part-b"], ctx.request_ids, "Intermediate", 200, ctx)
        send_intermediate_predict_response([None, "only-b"], {1: ctx.request_ids[1]}, "Intermediate", 200, ctx)
        return ["end-a", "end-b"]

    svc, _, sent = make_service(fn)
    final = svc.predict(InferRequest(9, [new("a", "1"), new("b", "1")]))
    assert [(r.frame_id, r.final) for r in sent] == [(9, False), (9, False)]
    assert [(x.request_id, x.body, x.done) for x in sent[0].results] == [("a", b"part-a", False), ("b", b"part-b", False)]
    assert dict(sent[0].results[0].headers) == {"x-part": "1"}
    assert [(x.request_id, x.body) for x in sent[1].results] == [("b", b"only-b")]  # ret is indexed like data
    assert final.final and all(r.done for r in final.results)


def test_intermediate_outside_a_frame_is_an_error() -> None:
    ctx = Context("m", "/tmp", {}, 1, None)
    with pytest.raises(RuntimeError, match="outside a frame"):
        send_intermediate_predict_response(["x"], {0: "a"}, "m", 200, ctx)
