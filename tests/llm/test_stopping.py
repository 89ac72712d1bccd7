"""Stop strings, EOS, stop_token_ids and ignore_eos, through the handler."""

from __future__ import annotations

import dataclasses

import pytest

from tests.llm.driver import FrameDriver, make_handler
from tests.llm.reference import generate_reference

PROMPT = "The river runs through the old town, past the market, the library and the church."
OTHERS = ["The cat", "Hello there, how are you today?"]


@pytest.fixture
def handler(tiny_model_dir, tiny_model, tiny_tokenizer):
    return make_handler(tiny_model_dir, {"prefill_chunk_size": 8}, 3, tiny_model, tiny_tokenizer)


def run(handler_and_context, body, others=OTHERS):
    """`body` as request "x", batched with greedy neighbours; returns x's record."""
    handler, context = handler_and_context
    driver = FrameDriver(handler, context, batch_size=3)
    for i, prompt in enumerate(others):
        driver.submit(f"o{i}", {"prompt": prompt, "max_new_tokens": 20})
    driver.submit("x", body)
    records = driver.run()
    assert handler.num_active_requests == 0 and handler.kv_cache_tokens == 0
    return records["x"]


def decode(tokenizer, ids):
    return tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


def test_stop_string_across_tokens_is_cut_and_never_emitted(handler, tiny_model, tiny_tokenizer):
    ref = generate_reference(tiny_model, tiny_tokenizer, PROMPT, 30)
    full = decode(tiny_tokenizer, ref.token_ids)
    boundary = len(decode(tiny_tokenizer, ref.token_ids[:10]))
    stop = full[boundary - 2 : boundary + 2]  # spans the boundary between tokens 9 and 10
    cut = full.find(stop)
    completing = next(j for j in range(1, 31) if stop in decode(tiny_tokenizer, ref.token_ids[:j]))

    record = run(handler, {"prompt": PROMPT, "max_new_tokens": 30, "stop": ["never-there", stop]})
    assert record.final["finish_reason"] == "stop"
    assert record.text == full[:cut]
    assert record.token_ids == ref.token_ids[:completing]
    assert record.final["completion_tokens"] == completing
    # Text is never revised, so "emitted partially" would show as a chunk boundary inside `stop`.
    emitted = ""
    for chunk in record.chunks:
        emitted += chunk["text"]
        assert stop[:2] not in emitted[cut:]


def test_stop_string_prefix_that_never_completes_is_released(handler, tiny_model, tiny_tokenizer):
    ref = generate_reference(tiny_model, tiny_tokenizer, PROMPT, 20)
    full = decode(tiny_tokenizer, ref.token_ids)
    record = run(handler, {"prompt": PROMPT, "max_new_tokens": 20, "stop": full[-3:] + "\u2603"})
    assert record.final["finish_reason"] == "length"
    assert record.text == full and record.token_ids == ref.token_ids


def test_eos_stops_and_is_reported_but_not_printed(handler, tiny_model, tiny_tokenizer):
    ref = generate_reference(tiny_model, tiny_tokenizer, PROMPT, 30)
    eos = ref.token_ids[6]
    first = ref.token_ids.index(eos)
    # Make that token the model's EOS, as a checkpoint's generation_config would.
    h, _ = handler
    h.engine.config = dataclasses.replace(h.engine.config, eos_token_ids=frozenset({eos}))
    expected = generate_reference(tiny_model, tiny_tokenizer, PROMPT, 30, eos_token_id=eos, pad_token_id=eos)

    record = run(handler, {"prompt": PROMPT, "max_new_tokens": 30})
    assert record.token_ids == expected.token_ids == ref.token_ids[: first + 1]
    assert record.final["finish_reason"] == "stop"
    assert record.text == decode(tiny_tokenizer, ref.token_ids[:first])  # EOS's own text is not emitted

    record = run(handler, {"prompt": PROMPT, "max_new_tokens": 30, "ignore_eos": True})
    assert record.token_ids == ref.token_ids and record.final["finish_reason"] == "length"


def test_stop_token_ids(handler, tiny_model, tiny_tokenizer):
    ref = generate_reference(tiny_model, tiny_tokenizer, PROMPT, 30)
    stop_token = ref.token_ids[4]
    first = ref.token_ids.index(stop_token)
    record = run(handler, {"prompt": PROMPT, "max_new_tokens": 30, "stop_token_ids": [stop_token]})
    assert record.token_ids == ref.token_ids[: first + 1]
    assert record.final["finish_reason"] == "stop"
    assert record.text == decode(tiny_tokenizer, ref.token_ids[:first])


def test_max_new_tokens_one_finishes_at_prefill(handler, tiny_model, tiny_tokenizer):
    ref = generate_reference(tiny_model, tiny_tokenizer, PROMPT, 1)
    record = run(handler, {"prompt": PROMPT, "max_new_tokens": 1})
    assert len(record.chunks) >= 1 and record.token_ids == ref.token_ids
    assert record.final["finish_reason"] == "length"
