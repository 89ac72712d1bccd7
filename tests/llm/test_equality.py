"""THE correctness test: batched continuous decode == unbatched `generate(do_sample=False)`, token for token.

Requests join and leave the batch at different steps (at most `batch_size` in a frame, the next one
admitted as soon as one finishes, one cancelled mid-way), prompts of different lengths (several
prefilled in chunks), different `max_new_tokens` — through the real `backend.context.Context`.
With `ahead`, the worker's decode-ahead hook runs after every frame: each step's decode forward runs
before the next frame's cancels and prefills, and the cancel lands after a decode-ahead.
"""

from __future__ import annotations

import pytest

from tests.llm.driver import FrameDriver, make_handler
from tests.llm.reference import sound_references

MAX_NEW_TOKENS = [12, 30, 1, 40, 20, 3, 25, 16, 33, 9]
CANCELLED = "r3"  # cancelled after CANCEL_AT_STEP frames, while running


@pytest.fixture(scope="module")
def references(tiny_model, tiny_tokenizer):
    return sound_references(tiny_model, tiny_tokenizer, MAX_NEW_TOKENS)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("ahead", [False, True], ids=["", "decode-ahead"])
@pytest.mark.parametrize(
    ("batch_size", "handler_config", "cancel_at_step"),
    [
        # roomy KV budget; prompts longer than 16 tokens are prefilled in several chunks
        pytest.param(3, {"prefill_chunk_size": 16}, 6, id="chunk16"),
        # tight budget: requests wait inside the handler for KV room, the slab is reshaped
        pytest.param(4, {"prefill_chunk_size": 5, "max_batch_tokens": 200}, 10, id="tight-budget"),
    ],
)
def test_staggered_batch_equals_unbatched_generate(
    tiny_model_dir, tiny_model, tiny_tokenizer, references, batch_size, handler_config, cancel_at_step, ahead
):
    handler, context = make_handler(tiny_model_dir, handler_config, batch_size, tiny_model, tiny_tokenizer)
    driver = FrameDriver(handler, context, batch_size=batch_size, step_ahead=ahead)
    for i, ref in enumerate(references):
        driver.submit(f"r{i}", {"prompt": ref.prompt, "max_new_tokens": ref.max_new_tokens})

    max_in_flight = 0
    seen = {"waited": False, "prefill_beside_decode": False}
    while not driver.idle:
        driver.step()
        engine = handler.engine
        engine.batch_cache.check()
        max_in_flight = max(max_in_flight, handler.num_active_requests)
        seen["waited"] |= engine.num_waiting_requests > 0
        seen["prefill_beside_decode"] |= engine.num_prefilling_requests > 0 and engine.num_running_requests > 0
        assert handler.kv_cache_capacity <= handler.config.max_batch_tokens
        if driver.num_steps == cancel_at_step:
            assert CANCELLED in driver.active, "the cancelled request should still be running"
            last = driver.records[CANCELLED].final
            assert last["completion_tokens"] > 0, "it should be decoding, not prefilling"
            assert engine.decoded_ahead == ahead
            tokens_before, active_before = handler.kv_cache_tokens, handler.num_active_requests
            # The worker calls the cancel hook before the next handle(); its rows are freed at once.
            finals = handler.cancel([CANCELLED])
            assert finals[CANCELLED]["token_ids"] == []  # a token decoded ahead for it is not emitted
            assert handler.num_active_requests == active_before - 1
            # The last token is cached only once the next step's decode forward ran (ahead, here).
            held = last["prompt_tokens"] + last["completion_tokens"] - (0 if ahead else 1)
            assert handler.kv_cache_tokens == tokens_before - held
            handler.engine.batch_cache.check()
            driver.cancel(CANCELLED)  # the frame after: CANCEL again (idempotent) and no more entry
        assert driver.num_steps < 500

    assert max_in_flight <= batch_size
    if ahead:  # the hook ran the decode of nearly every step (not after the last, nor while all prefill)
        assert driver.num_decoded_ahead >= driver.num_steps - 5, (driver.num_decoded_ahead, driver.num_steps)
    assert seen["prefill_beside_decode"], "a chunked prefill should have run while others decoded"
    assert seen["waited"] == ("max_batch_tokens" in handler_config), seen
    assert handler.num_active_requests == 0 and handler.kv_cache_tokens == 0
    for i, ref in enumerate(references):
        record = driver.records[f"r{i}"]
        if record.request_id == CANCELLED:
            assert not record.done
            assert 0 < len(record.token_ids) < ref.max_new_tokens
            assert record.token_ids == ref.token_ids[: len(record.token_ids)]
            continue
        assert record.done and record.status == 200
        assert record.token_ids == ref.token_ids, f"{record.request_id}: {ref.prompt!r}"
        assert record.final["finish_reason"] == "length"
        assert record.final["completion_tokens"] == ref.max_new_tokens
        assert record.final["prompt_tokens"] == len(ref.prompt_ids)
        assert record.text == tiny_tokenizer.decode(ref.token_ids, skip_special_tokens=True)
        assert all(c["finish_reason"] is None for c in record.chunks[:-1])


def test_prompts_span_chunking_and_lengths(references):
    """The chosen prompts really exercise chunked prefill and different lengths."""
    lengths = sorted(len(ref.prompt_ids) for ref in references)
    assert lengths[0] <= 4 and lengths[-1] > 3 * 16
    assert len(set(lengths)) >= 6


def test_a_padding_bug_would_be_caught(tiny_model, tiny_tokenizer, references):
    """Sanity check of the test itself: feeding wrong positions to one decode changes answers."""
    import torch

    ref = max(references, key=lambda r: len(r.prompt_ids))
    ids = torch.tensor([ref.prompt_ids + ref.token_ids[:1]])
    with torch.inference_mode():
        right = tiny_model(input_ids=ids).logits[0, -1].argmax().item()
        shifted = torch.arange(ids.shape[1])[None, :] + 3  # as if three padding columns were counted
        wrong = tiny_model(input_ids=ids, position_ids=shifted).logits[0, -1].topk(2).indices.tolist()
    assert right == ref.token_ids[1]
    assert wrong[0] != right or wrong[1] != ref.token_ids[1]
