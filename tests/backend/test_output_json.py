"""``encode_output``'s fast JSON writer must produce exactly ``json.dumps(value, indent=2)``."""

from __future__ import annotations

import json
import random
from collections import OrderedDict
from enum import IntEnum

import pytest

from backend.payloads import JSON_CONTENT_TYPE, UnsupportedOutput, encode_output

pytestmark = pytest.mark.timeout(30)


def _random_value(rng: random.Random, depth: int = 0) -> object:
    roll = rng.random()
    if depth > 4 or roll < 0.4:
        text = "".join(chr(rng.randint(0, 0x2FFFF)) if rng.random() < 0.3 else chr(rng.randint(0, 127))
                       for _ in range(rng.randint(0, 8)))
        return rng.choice([None, True, False, rng.randint(-10**20, 10**20), rng.random() * 10 ** rng.randint(-30, 30),
                           float("nan"), float("inf"), -float("inf"), -0.0, text])
    if roll < 0.7:
        return {"".join(chr(rng.randint(0, 300)) for _ in range(rng.randint(0, 5))): _random_value(rng, depth + 1)
                for _ in range(rng.randint(0, 4))}
    items = [_random_value(rng, depth + 1) for _ in range(rng.randint(0, 4))]
    return items if rng.random() < 0.7 else tuple(items)


def test_same_bytes_as_json_dumps_indent_2() -> None:
    rng = random.Random(7)
    for _ in range(5000):
        value = _random_value(rng)
        if isinstance(value, str):
            continue  # text outputs are sent as text, not JSON
        assert encode_output(value) == (json.dumps(value, indent=2).encode(), JSON_CONTENT_TYPE), value


class Level(IntEnum):
    LOW = 1


@pytest.mark.parametrize("value", [
    {1: "int key", None: "none key"},  # non-str keys: json.dumps converts them
    OrderedDict(a=1),  # subclasses take json.dumps itself
    [Level.LOW],
    [[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[["deep"]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]],
])
def test_values_left_to_json_dumps(value: object) -> None:
    assert encode_output(value)[0] == json.dumps(value, indent=2).encode()


def test_circular_value_is_unsupported() -> None:
    value: list = []
    value.append(value)
    with pytest.raises(UnsupportedOutput, match="Circular reference"):
        encode_output(value)
