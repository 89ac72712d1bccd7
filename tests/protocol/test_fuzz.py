"""Fuzz the decoder: random and mutated frames must only ever raise ProtocolError, never hang."""

from __future__ import annotations

import random
import time

from backend import protocol as p
from tests.protocol.test_codec import MESSAGES

BUDGET_SECONDS = 5.0


def _mutations(rng: random.Random, frame: bytes) -> bytes:
    data = bytearray(frame)
    kind = rng.randrange(5)
    if kind == 0 and data:  # flip bytes
        for _ in range(rng.randint(1, 4)):
            data[rng.randrange(len(data))] = rng.randrange(256)
    elif kind == 1:  # truncate
        del data[rng.randrange(len(data) + 1) :]
    elif kind == 2:  # insert junk
        at = rng.randrange(len(data) + 1)
        data[at:at] = rng.randbytes(rng.randint(1, 16))
    elif kind == 3 and len(data) > p.HEADER_SIZE:  # rewrite a length-looking field in the payload
        at = rng.randrange(p.HEADER_SIZE, max(p.HEADER_SIZE + 1, len(data) - 3))
        data[at : at + 4] = rng.choice([b"\xff\xff\xff\xff", b"\x00\x00\x00\x00", b"\x7f\xff\xff\xff", rng.randbytes(4)])
    else:  # keep the header valid but fix its length to the (mutated) payload
        payload = bytearray(data[p.HEADER_SIZE :])
        if payload:
            payload[rng.randrange(len(payload))] = rng.randrange(256)
        data = bytearray(p.HEADER.pack(p.MAGIC, p.VERSION, frame[5], 0, len(payload))) + payload
    return bytes(data)


def test_decoder_raises_only_protocol_error() -> None:
    rng = random.Random(1234)
    frames = [p.encode(m) for m in MESSAGES]
    deadline = time.monotonic() + BUDGET_SECONDS
    checked = 0
    while checked < 20_000 and time.monotonic() < deadline:
        if checked % 4 == 0:
            data = rng.randbytes(rng.randint(0, 64))
            if rng.random() < 0.5:  # a valid header on random payload
                data = p.HEADER.pack(p.MAGIC, p.VERSION, rng.randint(1, 7), 0, len(data)) + data
        else:
            data = _mutations(rng, rng.choice(frames))
        try:
            p.decode(data, max_payload=1 << 20)
        except p.ProtocolError:
            pass
        decoder = p.FrameDecoder(max_payload=1 << 20)
        try:
            for i in range(0, len(data), 5):
                decoder.feed(data[i : i + 5])
        except p.ProtocolError:
            pass
        checked += 1
    assert checked >= 2_000, f"only {checked} frames fuzzed in {BUDGET_SECONDS}s"
