"""Request parsing and validation (llm_requests): what is accepted, what is refused and how."""

from __future__ import annotations

import json

import pytest

from handlers.llm_requests import DEFAULT_MAX_NEW_TOKENS, RequestError, RequestLimits, body_of, parse_request

LIMITS = RequestLimits(context_length=512, max_batch_tokens=4096, default_max_new_tokens=64, vocab_size=1000)


def parse(body, limits=LIMITS, tokenizer=None):
    return parse_request(body, tokenizer, limits)


@pytest.fixture
def tok(tiny_tokenizer):
    return tiny_tokenizer


def test_prompt_defaults(tok):
    parsed = parse({"prompt": "The cat"}, tokenizer=tok)
    assert parsed.prompt_ids == tuple(tok("The cat")["input_ids"])
    assert parsed.prompt_ids[0] == tok.bos_token_id
    p = parsed.params
    assert (p.max_new_tokens, p.temperature, p.top_p, p.top_k, p.seed, p.stop, p.ignore_eos) == (
        64, 0.0, 1.0, 0, None, (), False
    )
    assert p.greedy


@pytest.mark.parametrize("body", ["The cat", b"The cat", '{"prompt": "The cat"}', b'{"prompt": "The cat"}'])
def test_plain_text_and_json_text_bodies(tok, body):
    assert parse(body, tokenizer=tok).prompt_ids == tuple(tok("The cat")["input_ids"])


def test_body_of_torchserve_entries():
    assert body_of({"body": {"prompt": "x"}}) == {"prompt": "x"}
    assert body_of({"data": "x"}) == "x"
    assert body_of({"prompt": "x"}) == {"prompt": "x"}


def test_messages_use_the_chat_template(tok):
    messages = [{"role": "user", "content": "hi"}]
    parsed = parse({"messages": messages}, tokenizer=tok)
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text.endswith("assistant:")
    assert parsed.prompt_ids == tuple(tok(text, add_special_tokens=False)["input_ids"])
    assert parsed.prompt_ids.count(tok.bos_token_id) == 1  # not added twice


def test_all_parameters(tok):
    body = {"prompt": "x", "max_new_tokens": 5, "temperature": 0.7, "top_p": 0.9, "top_k": 40, "seed": 3,
            "stop": ["a", "b", "a"], "stop_token_ids": [7, 9], "ignore_eos": True}  # fmt: skip
    p = parse(body, tokenizer=tok).params
    assert (p.max_new_tokens, p.temperature, p.top_p, p.top_k, p.seed) == (5, 0.7, 0.9, 40, 3)
    assert p.stop == ("a", "b") and p.stop_token_ids == {7, 9} and p.ignore_eos and not p.greedy
    assert parse({"prompt": "x", "stop": "end"}, tokenizer=tok).params.stop == ("end",)
    assert parse({"prompt": "x", "max_tokens": 7}, tokenizer=tok).params.max_new_tokens == 7
    assert parse({"prompt": "x", "top_k": -1}, tokenizer=tok).params.top_k == 0


@pytest.mark.parametrize(
    ("body", "fragment"),
    [
        ({}, 'exactly one of "prompt"'),
        ({"prompt": "x", "messages": []}, 'exactly one of "prompt"'),
        ({"prompt": 5}, '"prompt" must be a string'),
        ({"messages": "hi"}, '"messages" must be a non-empty list'),
        ({"messages": [{"role": "user"}]}, '"messages"[0]["content"]'),
        ({"prompt": "x", "max_new_tokens": 0}, '"max_new_tokens" must be an integer >= 1'),
        ({"prompt": "x", "max_new_tokens": True}, '"max_new_tokens" must be an integer'),
        ({"prompt": "x", "max_new_tokens": 2.5}, '"max_new_tokens" must be an integer'),
        ({"prompt": "x", "temperature": -0.1}, '"temperature" must be in'),
        ({"prompt": "x", "temperature": "hot"}, '"temperature" must be a number'),
        ({"prompt": "x", "top_p": 0}, '"top_p" must be in (0.0, 1.0]'),
        ({"prompt": "x", "top_p": 1.5}, '"top_p" must be in'),
        ({"prompt": "x", "top_k": -2}, '"top_k" must be an integer'),
        ({"prompt": "x", "seed": -1}, '"seed" must be an integer'),
        ({"prompt": "x", "stop": ""}, '"stop" must be'),
        ({"prompt": "x", "stop": ["a", 3]}, '"stop" must be'),
        ({"prompt": "x", "stop": ["s"] * 17}, '"stop" allows at most 16'),
        ({"prompt": "x", "stop_token_ids": [1000]}, '"stop_token_ids" must be a list of token ids in [0, 1000)'),
        ({"prompt": "x", "ignore_eos": "yes"}, '"ignore_eos" must be true or false'),
        ({"prompt": "x", "max_new_tokens": 600}, "exceeds this model's context length of 512"),
        ("{not json", "does not parse"),
        ([1, 2], "must be a JSON object or plain text"),
        (b"\xff\xfe", "not valid UTF-8"),
    ],
)
def test_refusals_name_the_field(tok, body, fragment):
    with pytest.raises(RequestError) as info:
        parse(body, tokenizer=tok)
    assert info.value.status == 400
    assert fragment in info.value.message


def test_prompt_over_the_context_is_refused(tok):
    long_prompt = "the cat sat " * 400
    with pytest.raises(RequestError, match="context length is 512 tokens"):
        parse({"prompt": long_prompt}, tokenizer=tok)


def test_default_max_new_tokens_is_capped_by_the_room_left(tok):
    prompt = "the cat sat on the mat " * 30
    num_prompt = len(tok(prompt)["input_ids"])
    limits = RequestLimits(context_length=512, max_batch_tokens=4096, default_max_new_tokens=DEFAULT_MAX_NEW_TOKENS,
                           vocab_size=1000)  # fmt: skip
    assert parse({"prompt": prompt}, limits, tok).params.max_new_tokens == min(DEFAULT_MAX_NEW_TOKENS, 512 - num_prompt)


def test_kv_budget_refusal(tok):
    limits = RequestLimits(context_length=512, max_batch_tokens=40, default_max_new_tokens=64, vocab_size=1000)
    assert parse({"prompt": "The cat"}, limits, tok).params.max_new_tokens == 40 - 3  # default capped, not refused
    with pytest.raises(RequestError, match="KV-cache budget"):
        parse({"prompt": "The cat", "max_new_tokens": 38}, limits, tok)


def test_no_chat_template(tok):
    class NoTemplate:
        chat_template = None

    with pytest.raises(RequestError, match="no chat template"):
        parse({"messages": [{"role": "user", "content": "hi"}]}, tokenizer=NoTemplate())


def test_json_body_roundtrip(tok):
    assert parse(json.dumps({"prompt": "The cat", "seed": 1}), tokenizer=tok).params.seed == 1
