"""Round trips for every message type, chunked feeding, stream readers and the documented layout."""

from __future__ import annotations

import asyncio
import re
import socket
from pathlib import Path

import pytest

from backend import protocol as p

MESSAGES: list[p.Message] = [
    p.LoadRequest("echo", "/tmp/m", "echo_handler.py", "W-echo-1", 8, -1, 1024, '{"model": {}}', '{"batchSize": 8}'),
    p.LoadReply(200, "loaded"),
    p.LoadReply(507, "out of memory: é"),
    p.InferRequest(1, ()),
    p.InferRequest(
        42,
        (
            p.WireRequest(
                "req-1", p.RequestState.NEW, "seq-9", p.RequestFlags.SEQUENCE_START,
                (("content-type", "application/json"), ("x-a", "ü")),
                (p.InputParameter("body", "application/json", b'{"n": 3}'), p.InputParameter("f", "", b"\x00\xff")),
            ),
            p.WireRequest("req-2", p.RequestState.CONTINUE, "seq-9"),
            p.WireRequest("req-3", p.RequestState.CANCEL, "", p.RequestFlags.SEQUENCE_END),
        ),
    ),
    p.InferReply(42, False, (p.WireResult("req-1", 200, False, "", "text/plain", (("ts_stream_next", "true"),), b"chunk"),)),
    p.InferReply(42, True, (p.WireResult("req-1"), p.WireResult("req-2", 503, True, "Prediction failed", "", (), b""))),
    p.Ping(0),
    p.Pong(2**64 - 1),
    p.Shutdown(),
]


def _normalise(msg: p.Message) -> p.Message:
    """Decoded messages hold tuples; normalising the originals lets us compare with ==."""
    return p.decode(p.encode(msg))


@pytest.mark.parametrize("msg", MESSAGES, ids=lambda m: type(m).__name__)
def test_round_trip(msg: p.Message) -> None:
    frame = p.encode(msg)
    decoded = p.decode(frame)
    assert type(decoded) is type(msg)
    assert decoded == msg
    assert p.encode(decoded) == frame


def test_new_request_carries_payload_and_continue_does_not() -> None:
    new = p.encode(p.InferRequest(1, (p.WireRequest("r", p.RequestState.NEW, parameters=(p.InputParameter("body", "", b"x" * 100),)),)))
    cont = p.encode(p.InferRequest(1, (p.WireRequest("r", p.RequestState.CONTINUE),)))
    assert len(new) > 100 > len(cont)


def test_header_layout() -> None:
    frame = p.encode(p.Ping(7))
    assert frame[:4] == b"CNVY" and frame[4] == 1 and frame[5] == p.MessageType.PING
    assert int.from_bytes(frame[8:12], "big") == 8 and len(frame) == p.HEADER_SIZE + 8


def test_feeding_byte_chunks_yields_messages_in_order() -> None:
    stream = b"".join(p.encode(m) for m in MESSAGES)
    for chunk_size in (1, 3, 7, 64, len(stream)):
        decoder = p.FrameDecoder()
        out: list[p.Message] = []
        for i in range(0, len(stream), chunk_size):
            out += decoder.feed(stream[i : i + chunk_size])
        assert out == [_normalise(m) for m in MESSAGES]
        assert decoder.buffered == 0


def test_oversize_payload_is_a_protocol_error_before_reading_it() -> None:
    frame = p.encode(p.InferReply(1, True, (p.WireResult("r", body=b"x" * 1000),)))
    with pytest.raises(p.ProtocolError, match="exceeds the limit"):
        p.FrameDecoder(max_payload=100).feed(frame[: p.HEADER_SIZE])


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda f: b"XXXX" + f[4:], "bad magic"),
        (lambda f: f[:4] + b"\x09" + f[5:], "unsupported protocol version"),
        (lambda f: f[:5] + b"\x63" + f[6:], "unknown MessageType"),
        (lambda f: f[:-1], "payload bytes"),
        (lambda f: f + b"\x00", "payload bytes"),
    ],
)
def test_malformed_frames(mutate, match) -> None:
    with pytest.raises(p.ProtocolError, match=match):
        p.decode(mutate(p.encode(MESSAGES[4])))


def test_bad_enum_and_utf8_inside_payload() -> None:
    frame = bytearray(p.encode(p.InferRequest(1, (p.WireRequest("ab", p.RequestState.CONTINUE),))))
    state_at = p.HEADER_SIZE + 8 + 4 + 2
    frame[state_at] = 9
    with pytest.raises(p.ProtocolError, match="unknown RequestState"):
        p.decode(bytes(frame))
    frame[state_at] = 1
    frame[state_at - 1] = 0xFF  # break the UTF-8 of the request id
    with pytest.raises(p.ProtocolError, match="invalid UTF-8"):
        p.decode(bytes(frame))


def test_asyncio_reader_and_blocking_socket() -> None:
    left, right = socket.socketpair()
    try:
        for msg in MESSAGES:
            p.send_message(left, msg)

        async def read_all() -> list[p.Message]:
            reader, writer = await asyncio.open_connection(sock=right)
            try:
                got = [await p.read_message(reader) for _ in MESSAGES]
                p.write_message(writer, p.Pong(5))
                await writer.drain()
                left.shutdown(socket.SHUT_WR)
                with pytest.raises(p.ConnectionClosed) as info:
                    await p.read_message(reader)
                assert not info.value.partial
                return got
            finally:
                writer.close()

        assert asyncio.run(read_all()) == [_normalise(m) for m in MESSAGES]
        assert p.recv_message(left) == p.Pong(5)
        with pytest.raises(p.ConnectionClosed):
            p.recv_message(left)
    finally:
        left.close()
        right.close()


def test_blocking_reader_reports_mid_frame_close() -> None:
    left, right = socket.socketpair()
    try:
        left.sendall(p.encode(p.Ping(1))[:5])
        left.close()
        with pytest.raises(p.ConnectionClosed) as info:
            p.recv_message(right)
        assert info.value.partial
    finally:
        right.close()


def test_docs_layout_table_matches_the_code() -> None:
    """docs/protocol.md has one `| TYPE | field, field, ... |` row per message type."""
    doc = (Path(__file__).resolve().parents[2] / "docs" / "protocol.md").read_text()
    for msg_type, fields in p.PAYLOAD_LAYOUT.items():
        row = re.search(rf"^\| `{msg_type.name}` \((\d+)\) \| (.*?) \|$", doc, re.M)
        assert row, f"docs/protocol.md has no layout row for {msg_type.name}"
        assert int(row.group(1)) == msg_type.value
        documented = [f.strip(" `") for f in row.group(2).split(",")] if row.group(2).strip() else []
        assert documented == fields, msg_type.name


def test_socket_reader_buffers_across_frames_and_reports_closes() -> None:
    """The worker's buffered reader: whole frames out of arbitrary recv boundaries, a large frame
    over many reads, then a clean close at a boundary vs a close mid-frame."""
    big = p.InferReply(1, True, (p.WireResult("r", body=b"x" * (3 * p.SocketReader.CHUNK + 5)),))
    stream = b"".join(p.encode(m) for m in [*MESSAGES, big, *MESSAGES])
    for tail, partial in ((b"", False), (p.encode(p.Ping(3))[:5], True)):
        left, right = socket.socketpair()
        try:
            reader = p.SocketReader(right)
            left.sendall(stream + tail)
            left.close()
            got = [reader.recv_message() for _ in range(2 * len(MESSAGES) + 1)]
            assert got == [_normalise(m) for m in [*MESSAGES, big, *MESSAGES]]
            with pytest.raises(p.ConnectionClosed) as info:
                reader.recv_message()
            assert info.value.partial is partial
        finally:
            right.close()
