"""Decode ahead (`TextGenerationHandler.step_ahead`, the worker's hook between continuous frames).

The step's decode forward runs before the next frame arrives; that frame's cancels and prefills come
after it. What must not change: every chunk of every request (sampling with per-request generators,
stop strings and stop tokens, length, finish reasons), what a cancel frees and when, and how a
failing forward is reported. Greedy equality with unbatched `generate` under decode ahead is in
test_equality.py.
"""

from __future__ import annotations

import logging

import pytest

from tests.llm.driver import FrameDriver, Record, make_handler
from tests.llm.reference import generate_reference

pytestmark = pytest.mark.timeout(60)

PROMPTS = ["The cat", "Hello there, how are you today?", "Water boils",
           "The river runs through the old town, past the market, the library and the church."]  # fmt: skip


def mixed_requests() -> dict[str, dict]:
    """Sampled (seeded, warpers), greedy, stop strings, stop tokens; prompts that prefill in chunks."""
    bodies = {}
    for i in range(8):
        body = {"prompt": PROMPTS[i % len(PROMPTS)], "max_new_tokens": 12 + 7 * i}
        if i % 4 != 3:
            body.update(temperature=0.7 + 0.2 * (i % 3), top_p=0.9, top_k=0 if i % 2 else 50, seed=100 + i)
        if i in (1, 4):
            body["stop"] = ["th", "ing"]
        if i == 2:
            body["stop_token_ids"] = [268, 275, 289]
        bodies[f"m{i}"] = body
    return bodies


def run(model_dir, model, tokenizer, ahead: bool, cancel_at: dict[int, str]) -> tuple[dict[str, Record], int]:
    handler, context = make_handler(model_dir, {"prefill_chunk_size": 8}, 3, model, tokenizer)
    driver = FrameDriver(handler, context, batch_size=3, step_ahead=ahead)
    for request_id, body in mixed_requests().items():
        driver.submit(request_id, body)
    while not driver.idle:
        if driver.num_steps in cancel_at:
            request_id = cancel_at[driver.num_steps]
            assert request_id in driver.active
            driver.cancel(request_id)  # the next frame carries its CANCEL
        driver.step()
        assert driver.num_steps < 400
    assert handler.num_active_requests == 0 and handler.kv_cache_tokens == 0 and handler.kv_cache_capacity == 0
    return driver.records, driver.num_decoded_ahead


def test_every_chunk_is_the_same_with_and_without_decode_ahead(tiny_model_dir, tiny_model, tiny_tokenizer):
    cancel_at = {4: "m1", 9: "m3"}  # m1 while sampling, m3 (greedy) later
    plain, _ = run(tiny_model_dir, tiny_model, tiny_tokenizer, False, cancel_at)
    ahead, num_ahead = run(tiny_model_dir, tiny_model, tiny_tokenizer, True, cancel_at)
    assert num_ahead > 20
    reasons = {rid: record.final.get("finish_reason") for rid, record in plain.items() if record.done}
    assert set(reasons.values()) == {"stop", "length"}, reasons  # the workload reaches both endings
    assert not plain["m1"].done and not plain["m3"].done  # cancelled: their stream just stops
    for request_id, record in plain.items():
        assert ahead[request_id].chunks == record.chunks, request_id
        assert ahead[request_id].done == record.done


def test_cancel_after_decode_ahead_discards_its_token_and_frees_at_once(
    tiny_model_dir, tiny_model, tiny_tokenizer, caplog
):
    handler, context = make_handler(tiny_model_dir, {"prefill_chunk_size": 8}, 4, tiny_model, tiny_tokenizer)
    engine = handler.engine
    driver = FrameDriver(handler, context, batch_size=4, step_ahead=True)
    for request_id, prompt in zip("abc", PROMPTS):
        driver.submit(request_id, {"prompt": prompt, "max_new_tokens": 20})
    for _ in range(3):
        driver.step()
    assert engine.decoded_ahead and engine.num_running_requests == 3
    last = driver.records["b"].final
    tokens, active = handler.kv_cache_tokens, handler.num_active_requests
    finals = handler.cancel(["b"])
    # Its pending token is never emitted, and all it held (the column written ahead too) is freed now.
    assert finals["b"] == {"text": "", "token_ids": [], "finish_reason": "cancelled",
                           "prompt_tokens": last["prompt_tokens"], "completion_tokens": last["completion_tokens"]}
    assert handler.num_active_requests == active - 1 and not engine.has_request("b")
    assert handler.kv_cache_tokens == tokens - (last["prompt_tokens"] + last["completion_tokens"])
    engine.batch_cache.check()
    driver.cancel("b")
    # "c" is live but left out of the next frame without a CANCEL: freed by the leak guard, pending token too.
    driver.active.pop("c")
    with caplog.at_level(logging.WARNING, logger="handlers.text_generation"):
        driver.step()
    assert "request c is live but absent from the frame" in caplog.text
    assert engine.request_ids() == ["a"]
    driver.run()
    assert driver.records["a"].token_ids == generate_reference(tiny_model, tiny_tokenizer, PROMPTS[0], 20).token_ids
    assert len(driver.records["b"].token_ids) == len(driver.records["c"].token_ids) == 3
    assert handler.num_active_requests == 0 and handler.kv_cache_tokens == 0


def test_cancelling_every_row_after_decode_ahead_leaves_a_clean_engine(tiny_model_dir, tiny_model, tiny_tokenizer):
    handler, context = make_handler(tiny_model_dir, {"prefill_chunk_size": 8}, 4, tiny_model, tiny_tokenizer)
    driver = FrameDriver(handler, context, batch_size=4, step_ahead=True)
    driver.submit("a", {"prompt": PROMPTS[1], "max_new_tokens": 30})
    driver.step()
    driver.step()
    assert handler.engine.decoded_ahead
    driver.cancel("a")
    driver.submit("n", {"prompt": PROMPTS[2], "max_new_tokens": 9})  # joins in the frame of the CANCEL
    records = driver.run()
    assert records["n"].token_ids == generate_reference(tiny_model, tiny_tokenizer, PROMPTS[2], 9).token_ids
    assert handler.kv_cache_capacity == 0


def test_failed_decode_ahead_fails_the_next_step_like_a_failed_forward(
    tiny_model_dir, tiny_model, tiny_tokenizer, monkeypatch
):
    handler, context = make_handler(tiny_model_dir, {"prefill_chunk_size": 8}, 4, tiny_model, tiny_tokenizer)
    driver = FrameDriver(handler, context, batch_size=4)
    driver.submit("a", {"prompt": PROMPTS[0], "max_new_tokens": 20})
    driver.submit("b", {"prompt": PROMPTS[1], "max_new_tokens": 20})
    driver.step()
    real_forward = tiny_model.forward

    def failing_forward(*args, **kwargs):
        raise RuntimeError("out of luck")

    monkeypatch.setattr(tiny_model, "forward", failing_forward)
    handler.step_ahead()  # does not raise: there is no frame to answer yet
    monkeypatch.setattr(tiny_model, "forward", real_forward)
    driver.submit("c", {"prompt": PROMPTS[2], "max_new_tokens": 5})  # arrives with the failing step
    driver.step()
    for request_id in "abc":
        record = driver.records[request_id]
        assert record.done and record.status == 500
        assert record.final == {"error": "generation failed in the model worker"}
    assert handler.num_active_requests == 0 and handler.kv_cache_tokens == 0
    driver.submit("d", {"prompt": PROMPTS[2], "max_new_tokens": 5})  # the worker goes on
    assert driver.run()["d"].token_ids == generate_reference(tiny_model, tiny_tokenizer, PROMPTS[2], 5).token_ids
