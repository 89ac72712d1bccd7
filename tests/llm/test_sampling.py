"""Sampling: per-request seeded generators, reproducible whoever the batch mates are."""

from __future__ import annotations

import pytest
import torch

from handlers.llm_requests import GenerationParams
from handlers.llm_sampling import make_generator, sample_next_tokens
from tests.llm.driver import FrameDriver, make_handler

PROMPT = "Good software is tested"
SAMPLED = {"prompt": PROMPT, "max_new_tokens": 24, "temperature": 0.9, "top_p": 0.95, "top_k": 200, "seed": 1234}


def run(tiny_model_dir, tiny_model, tiny_tokenizer, bodies: dict[str, dict], batch_size=4):
    handler, context = make_handler(tiny_model_dir, {"prefill_chunk_size": 4}, batch_size, tiny_model, tiny_tokenizer)
    driver = FrameDriver(handler, context, batch_size=batch_size)
    for request_id, body in bodies.items():
        driver.submit(request_id, body)
    return driver.run()


def test_seeded_sampling_is_reproducible_regardless_of_batch_mates(tiny_model_dir, tiny_model, tiny_tokenizer):
    alone = run(tiny_model_dir, tiny_model, tiny_tokenizer, {"x": SAMPLED})["x"]
    mates = {
        "a": {"prompt": "The cat", "max_new_tokens": 5},
        "b": {**SAMPLED, "prompt": "Water boils", "seed": 99},
        "c": {"prompt": "Hello there, how are you today? " * 3, "max_new_tokens": 30, "temperature": 1.3},
        "x": SAMPLED,  # joins last, beside rows at other positions and lengths
    }
    batched = run(tiny_model_dir, tiny_model, tiny_tokenizer, mates)
    assert batched["x"].token_ids == alone.token_ids and len(alone.token_ids) == 24
    assert batched["x"].text == alone.text

    other_seed = run(tiny_model_dir, tiny_model, tiny_tokenizer, {"x": {**SAMPLED, "seed": 4321}})["x"]
    assert other_seed.token_ids != alone.token_ids
    greedy = run(tiny_model_dir, tiny_model, tiny_tokenizer, {"x": {"prompt": PROMPT, "max_new_tokens": 24}})["x"]
    assert greedy.token_ids != alone.token_ids


def test_top_k_one_is_greedy(tiny_model_dir, tiny_model, tiny_tokenizer):
    bodies = {
        "greedy": {"prompt": PROMPT, "max_new_tokens": 16},
        "k1": {"prompt": PROMPT, "max_new_tokens": 16, "temperature": 1.5, "top_k": 1},
    }
    records = run(tiny_model_dir, tiny_model, tiny_tokenizer, bodies)
    assert records["k1"].token_ids == records["greedy"].token_ids


def test_high_temperature_multibyte_text_streams_correctly(tiny_model_dir, tiny_model, tiny_tokenizer):
    """At temperature 5 the zeroed byte tokens are drawn too: characters split over tokens."""
    body = {"prompt": "日本語 café", "max_new_tokens": 80, "temperature": 5.0, "seed": 3, "ignore_eos": True}
    record = run(tiny_model_dir, tiny_model, tiny_tokenizer, {"x": body})["x"]
    ids = record.token_ids
    assert any("\ufffd" in tiny_tokenizer.decode([t]) for t in ids), "the sample should include stray bytes"
    assert record.text == tiny_tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
    # A chunk never ends inside a character unless the output itself is invalid there.
    for chunk in record.chunks[:-1]:
        assert not chunk["text"].endswith("\ufffd")


# ---- the sampler alone ---------------------------------------------------------------------------


def test_sampler_greedy_rows_and_private_generators():
    torch.manual_seed(0)
    logits = torch.randn(3, 50)
    greedy = GenerationParams(max_new_tokens=1)
    hot = GenerationParams(max_new_tokens=1, temperature=1.0)
    first = sample_next_tokens(logits, [greedy, hot, greedy], [None, make_generator(5), None])
    again = sample_next_tokens(logits, [greedy, hot, greedy], [None, make_generator(5), None])
    assert first == again
    assert first[0] == logits[0].argmax().item() and first[2] == logits[2].argmax().item()


def test_sampler_top_p_keeps_the_nucleus():
    logits = torch.tensor([[5.0, 4.0, 0.0, -1.0]])
    params = GenerationParams(max_new_tokens=1, temperature=1.0, top_p=0.5)
    drawn = {sample_next_tokens(logits, [params], [make_generator(s)])[0] for s in range(40)}
    assert drawn == {0}  # token 0 alone has 73 % of the mass
    params = GenerationParams(max_new_tokens=1, temperature=1.0, top_p=0.9)
    drawn = {sample_next_tokens(logits, [params], [make_generator(s)])[0] for s in range(200)}
    assert drawn == {0, 1}


def test_sampler_rejects_mismatched_rows():
    with pytest.raises(ValueError):
        sample_next_tokens(torch.zeros(2, 4), [GenerationParams(max_new_tokens=1)], [None])
