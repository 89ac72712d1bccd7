"""The handler behind the real worker logic (backend.service.Service, in-process, no socket):
`text_generation` resolved by the handler loader, wire NEW / CONTINUE / CANCEL frames, JSON bodies."""

from __future__ import annotations

import json

import pytest
import yaml

from backend.context import Context
from backend.handler_loader import load_handler
from backend.protocol import InferRequest, InputParameter, RequestState, WireRequest
from backend.service import Service
from tests.llm.reference import generate_reference

PROMPTS = {"a": ("The cat", 6), "b": ("Hello there, how are you today?", 9), "c": ("Water boils", 25)}


def new(request_id: str, body: dict) -> WireRequest:
    return WireRequest(request_id, RequestState.NEW,
                       parameters=(InputParameter("body", "application/json", json.dumps(body).encode()),))  # fmt: skip


@pytest.mark.timeout(60)
def test_frames_through_the_worker_service(tiny_model_dir, tiny_model, tiny_tokenizer):
    yaml_config = yaml.safe_load((tiny_model_dir / "model-config.yaml").read_text())
    context = Context("tiny", str(tiny_model_dir), {}, 4, None, model_yaml_config=yaml_config)
    loaded = load_handler("text_generation", tiny_model_dir, context)
    assert loaded.description == "handlers.text_generation.TextGenerationHandler" and loaded.cancel is not None
    service = Service(loaded, context, max_response_size=1 << 20)
    handler = loaded.instance

    chunks: dict[str, list[dict]] = {rid: [] for rid in [*PROMPTS, "bad"]}
    pending = [new(rid, {"prompt": p, "max_new_tokens": n}) for rid, (p, n) in PROMPTS.items()]
    pending.append(new("bad", {"prompt": "x", "top_p": 7}))
    running: set[str] = set()
    frame_id = 0
    while pending or running:
        frame_id += 1
        requests = pending + [WireRequest(rid, RequestState.CONTINUE) for rid in sorted(running)]
        if frame_id == 4:  # the client of "c" went away
            requests = [r for r in requests if r.request_id != "c"] + [WireRequest("c", RequestState.CANCEL)]
            running.discard("c")
        running |= {r.request_id for r in pending}
        pending = []
        reply = service.predict(InferRequest(frame_id, tuple(requests)))
        for result in reply.results:
            if result.status == 200:
                assert result.content_type == "application/json"
                chunks[result.request_id].append(json.loads(result.body))
            else:
                chunks[result.request_id].append({"status": result.status, "message": result.message})
            if result.done:
                running.discard(result.request_id)
        if frame_id == 4:
            assert not handler.engine.has_request("c")
        assert frame_id < 50

    assert chunks["bad"] == [{"status": 400, "message": '"top_p" must be in (0.0, 1.0], got 7'}]
    for rid in ("a", "b"):
        prompt, n = PROMPTS[rid]
        tokens = [t for c in chunks[rid] for t in c["token_ids"]]
        assert tokens == generate_reference(tiny_model, tiny_tokenizer, prompt, n).token_ids
        assert chunks[rid][-1]["finish_reason"] == "length"
    assert len(chunks["c"]) == 3 and all(c["finish_reason"] is None for c in chunks["c"])
    assert handler.num_active_requests == 0 and handler.kv_cache_tokens == 0
