"""Incremental decoding across multi-byte / multi-token boundaries, and stop strings across chunks."""

from __future__ import annotations

import random

import pytest

from handlers.llm_detokenizer import IncrementalDetokenizer, StopStringFilter

TEXTS = [
    "日本語のテキスト",  # 3-byte characters, none in the tiny vocab: each spans 3 byte tokens
    "emoji 🎉🚀 and ñ, ü, é — “quotes”",
    "plain ascii text with spaces",
    "crème brûlée at the café",
]


@pytest.mark.parametrize("text", TEXTS)
def test_streamed_chunks_equal_the_one_shot_decode(tiny_tokenizer, text):
    prompt_ids = tiny_tokenizer("Hello")["input_ids"]
    ids = tiny_tokenizer(text, add_special_tokens=False)["input_ids"]
    detok = IncrementalDetokenizer(tiny_tokenizer, prompt_ids)
    chunks = [detok.push([token]) for token in ids]
    chunks.append(detok.flush())
    assert "".join(chunks) == text
    assert all("\ufffd" not in chunk for chunk in chunks)


def test_a_character_split_over_tokens_is_held_back(tiny_tokenizer):
    ids = tiny_tokenizer("日", add_special_tokens=False)["input_ids"]
    assert len(ids) == 3  # three byte tokens
    detok = IncrementalDetokenizer(tiny_tokenizer, [])
    assert [detok.push([t]) for t in ids] == ["", "", "日"]


def test_invalid_bytes_are_released_at_the_end(tiny_tokenizer):
    ids = tiny_tokenizer("日", add_special_tokens=False)["input_ids"][:2]  # an incomplete character
    detok = IncrementalDetokenizer(tiny_tokenizer, [])
    assert [detok.push([t]) for t in ids] == ["", ""]
    tail = detok.flush()
    assert tail == tiny_tokenizer.decode(ids) and "\ufffd" in tail


def test_special_tokens_are_skipped(tiny_tokenizer):
    detok = IncrementalDetokenizer(tiny_tokenizer, [])
    ids = tiny_tokenizer("a b", add_special_tokens=False)["input_ids"]
    out = detok.push(ids[:1]) + detok.push([tiny_tokenizer.eos_token_id]) + detok.push(ids[1:]) + detok.flush()
    assert out == "a b"


def test_random_token_streams_match_one_shot_decode(tiny_tokenizer):
    rng = random.Random(0)
    vocab = len(tiny_tokenizer)
    for _ in range(50):
        ids = [rng.randrange(vocab) for _ in range(rng.randrange(1, 30))]
        detok = IncrementalDetokenizer(tiny_tokenizer, [])
        out = "".join(detok.push([t]) for t in ids) + detok.flush()
        assert out == tiny_tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


# ---- stop strings --------------------------------------------------------------------------------


def feed(stops, pieces):
    f = StopStringFilter(stops)
    out = [f.push(p) for p in pieces]
    if not f.stopped:
        out.append(f.flush())
    return out, f.stopped


def test_stop_string_split_over_chunks_is_never_emitted():
    out, stopped = feed(["STOP"], ["abc S", "T", "O", "P more"])
    assert stopped and "".join(out) == "abc "
    assert out == ["abc ", "", "", ""]


def test_partial_match_is_released_when_it_does_not_complete():
    out, stopped = feed(["STOP"], ["abc ST", "x", " end"])
    assert not stopped and "".join(out) == "abc STx end"
    assert out[0] == "abc "  # "ST" held back until it cannot be a stop string


def test_earliest_stop_string_wins():
    out, stopped = feed(["world", "lo w"], ["hello world"])
    assert stopped and out == ["hel"]


def test_stop_string_overlapping_its_own_prefix():
    out, stopped = feed(["aab"], ["a", "a", "a", "b", "c"])
    assert stopped and "".join(out) == "a"


def test_no_stop_strings_passes_text_through():
    out, stopped = feed([], ["a", "b"])
    assert out == ["a", "b", ""] and not stopped


def test_fast_decoder_matches_tokenizer_decode(tiny_tokenizer):
    from handlers.llm_detokenizer import text_decoder

    fast = text_decoder(tiny_tokenizer)
    rng = random.Random(1)
    for _ in range(100):
        ids = [rng.randrange(len(tiny_tokenizer)) for _ in range(rng.randrange(0, 12))]
        expected = tiny_tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
        assert (fast(ids) if ids else "") == expected
