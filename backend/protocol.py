"""The socket codec: the one wire format shared by the frontend and the backend workers.

Every message is one frame::

    +--------+---------+------+-------+----------------+------------------+
    | magic  | version | type | flags | payload length | payload          |
    | 4s     | u8      | u8   | u16   | u32            | <length> bytes   |
    +--------+---------+------+-------+----------------+------------------+
      b"CNVY"   1                0

All integers are big-endian. Inside a payload, a ``str`` is ``u32 length + UTF-8 bytes`` and a
``bytes`` is ``u32 length + raw bytes``. The payload of each message type is documented on its
encoder below and in ``docs/protocol.md`` (a test checks that table against ``PAYLOAD_LAYOUT``).

Everything that is wrong with a frame (bad magic, unknown version or type, a length over the
limit, truncation, trailing bytes, invalid UTF-8, an unknown enum value) raises ``ProtocolError``
and nothing else. A clean end of stream raises ``ConnectionClosed``. This module never exits the
process, reads the environment, logs or calls handler code.
"""

from __future__ import annotations

import asyncio
import select
import socket
import struct
from dataclasses import dataclass, field
from enum import IntEnum, IntFlag
from typing import Union
from collections.abc import Sequence

MAGIC = b"CNVY"
VERSION = 1
HEADER = struct.Struct("!4sBBHI")
HEADER_SIZE = HEADER.size  # 12
DEFAULT_MAX_PAYLOAD = 64 * 1024 * 1024

_U16 = struct.Struct("!H")
_U32 = struct.Struct("!I")
_U64 = struct.Struct("!Q")
# Fixed-size parts of the hot messages, packed in one call each.
_REQ_FIXED = struct.Struct("!BB")  # state, flags
_RES_FIXED = struct.Struct("!HB")  # status, result flags
_FRAME_FIXED = struct.Struct("!II")  # frame_id, count
_REPLY_FIXED = struct.Struct("!IBI")  # frame_id, final, count
_LOAD_FIXED = struct.Struct("!IiI")  # batch_size, gpu_id, max_response_size


class ProtocolError(Exception):
    """A frame that does not follow this module's layout. The connection cannot be trusted after it."""


class ConnectionClosed(Exception):
    """The peer closed the stream at a frame boundary (or mid-frame: ``partial`` is then True)."""

    def __init__(self, partial: bool = False) -> None:
        super().__init__("connection closed mid-frame" if partial else "connection closed")
        self.partial = partial


class MessageType(IntEnum):
    LOAD = 1
    LOAD_REPLY = 2
    INFER = 3
    INFER_REPLY = 4
    PING = 5
    PONG = 6
    SHUTDOWN = 7


class RequestState(IntEnum):
    """What an INFER entry asks of the handler for one request id."""

    NEW = 0  # first time the backend sees this id: headers and parameters follow
    CONTINUE = 1  # already in the backend (continuous batching): id only, run one more step
    CANCEL = 2  # the client is gone or asked to stop: free this id's state, produce no result


class RequestFlags(IntFlag):
    NONE = 0
    SEQUENCE_START = 1  # first request of a sequence
    SEQUENCE_END = 2  # the client ends the sequence with this request


class ResultFlags(IntFlag):
    NONE = 0
    DONE = 1  # no more results will come for this request id


@dataclass(frozen=True, slots=True)
class InputParameter:
    """One named input of a request: the raw body is named ``body``, form fields keep their names."""

    name: str
    content_type: str
    value: bytes


@dataclass(frozen=True, slots=True)
class WireRequest:
    """One request in an INFER frame. Headers and parameters travel only when ``state`` is NEW."""

    request_id: str
    state: RequestState = RequestState.NEW
    sequence_id: str = ""  # "" when the model does not use sequences
    flags: RequestFlags = RequestFlags.NONE
    headers: Sequence[tuple[str, str]] = ()
    parameters: Sequence[InputParameter] = ()


@dataclass(frozen=True, slots=True)
class WireResult:
    """One request's result in an INFER_REPLY. Matched to its job by ``request_id``, never by position."""

    request_id: str
    status: int = 200
    done: bool = True
    message: str = ""  # reason phrase, or the error message when status >= 400
    content_type: str = ""
    headers: Sequence[tuple[str, str]] = ()
    body: bytes = b""


@dataclass(frozen=True, slots=True)
class LoadRequest:
    model_name: str
    model_dir: str  # the extracted archive (or the no-archive directory)
    handler: str  # as in the manifest: "module", "module:function", "file.py:Class", or a built-in name
    worker_id: str
    batch_size: int = 1
    gpu_id: int = -1  # -1: CPU
    max_response_size: int = 6553500
    manifest_json: str = "{}"  # MAR-INF/MANIFEST.json as text
    model_yaml_config_json: str = "{}"  # the archive's model-config.yaml, as JSON


@dataclass(frozen=True, slots=True)
class LoadReply:
    status: int
    message: str = ""


@dataclass(frozen=True, slots=True)
class InferRequest:
    frame_id: int
    requests: Sequence[WireRequest] = field(default_factory=tuple)


@dataclass(frozen=True, slots=True)
class InferReply:
    frame_id: int  # the INFER frame this answers
    final: bool = True  # False for intermediate replies (send_intermediate_predict_response)
    results: Sequence[WireResult] = field(default_factory=tuple)


@dataclass(frozen=True, slots=True)
class Ping:
    nonce: int = 0


@dataclass(frozen=True, slots=True)
class Pong:
    nonce: int = 0


@dataclass(frozen=True, slots=True)
class Shutdown:
    pass


Message = Union[LoadRequest, LoadReply, InferRequest, InferReply, Ping, Pong, Shutdown]

# Field layout of every payload, in order; docs/protocol.md shows the same table (tested).
# "*" marks a repeated group preceded by a u32 count; "[NEW]" marks fields present only for NEW.
PAYLOAD_LAYOUT: dict[MessageType, list[str]] = {
    MessageType.LOAD: [
        "model_name str", "model_dir str", "handler str", "worker_id str",
        "batch_size u32", "gpu_id i32", "max_response_size u32",
        "manifest_json str", "model_yaml_config_json str",
    ],
    MessageType.LOAD_REPLY: ["status u16", "message str"],
    MessageType.INFER: [
        "frame_id u32", "count u32",
        "*request_id str", "*state u8", "*flags u8", "*sequence_id str",
        "*[NEW] header_count u32", "*[NEW] *name str", "*[NEW] *value str",
        "*[NEW] parameter_count u32", "*[NEW] *name str", "*[NEW] *content_type str", "*[NEW] *value bytes",
    ],
    MessageType.INFER_REPLY: [
        "frame_id u32", "final u8", "count u32",
        "*request_id str", "*status u16", "*flags u8", "*message str", "*content_type str",
        "*header_count u32", "**name str", "**value str", "*body bytes",
    ],
    MessageType.PING: ["nonce u64"],
    MessageType.PONG: ["nonce u64"],
    MessageType.SHUTDOWN: [],
}


# ---------------------------------------------------------------------------------------- encoding
#
# Hot path: every frame is encoded once and decoded once on each side, so both directions are
# written as flat loops over bound ``struct`` methods and lookup tables (no per-field method calls,
# no enum constructors). ``benchmarks/codec_bench.py`` measures them; the layout is unchanged.

_pack_u16 = _U16.pack
_pack_u32 = _U32.pack
_pack_req_fixed = _REQ_FIXED.pack
_pack_res_fixed = _RES_FIXED.pack
_U32_ZERO = _pack_u32(0)  # also an empty str field: just its zero length
_NEW = RequestState.NEW


def _str(parts: list[bytes], value: str) -> None:
    if value:
        data = value.encode("utf-8")
        parts.append(_pack_u32(len(data)))
        parts.append(data)
    else:
        parts.append(_U32_ZERO)


def _pairs(parts: list[bytes], pairs: Sequence[tuple[str, str]]) -> None:
    append = parts.append
    append(_pack_u32(len(pairs)))
    for name, value in pairs:  # _str, inlined: headers are most of a NEW request's fields
        data = name.encode("utf-8")
        append(_pack_u32(len(data)))
        append(data)
        data = value.encode("utf-8")
        append(_pack_u32(len(data)))
        append(data)


def _encode_infer(msg: InferRequest, parts: list[bytes]) -> None:
    append = parts.append
    append(_FRAME_FIXED.pack(msg.frame_id, len(msg.requests)))
    for req in msg.requests:
        _str(parts, req.request_id)
        append(_pack_req_fixed(req.state, req.flags))
        _str(parts, req.sequence_id)
        if req.state == _NEW:
            _pairs(parts, req.headers)
            append(_pack_u32(len(req.parameters)))
            for param in req.parameters:
                _str(parts, param.name)
                _str(parts, param.content_type)
                append(_pack_u32(len(param.value)))
                append(param.value if type(param.value) is bytes else bytes(param.value))


def _encode_reply(msg: InferReply, parts: list[bytes]) -> None:
    append = parts.append
    append(_REPLY_FIXED.pack(msg.frame_id, 1 if msg.final else 0, len(msg.results)))
    for res in msg.results:
        _str(parts, res.request_id)
        append(_pack_res_fixed(res.status, 1 if res.done else 0))
        _str(parts, res.message)
        _str(parts, res.content_type)
        _pairs(parts, res.headers)
        append(_pack_u32(len(res.body)))
        append(res.body if type(res.body) is bytes else bytes(res.body))


def _encode_payload(msg: Message) -> tuple[MessageType, list[bytes]]:
    """The message type and the payload's parts."""
    parts: list[bytes] = []
    if isinstance(msg, InferRequest):
        _encode_infer(msg, parts)
        return MessageType.INFER, parts
    if isinstance(msg, InferReply):
        _encode_reply(msg, parts)
        return MessageType.INFER_REPLY, parts
    if isinstance(msg, LoadRequest):
        for text in (msg.model_name, msg.model_dir, msg.handler, msg.worker_id):
            _str(parts, text)
        parts.append(_LOAD_FIXED.pack(msg.batch_size, msg.gpu_id, msg.max_response_size))
        _str(parts, msg.manifest_json)
        _str(parts, msg.model_yaml_config_json)
        return MessageType.LOAD, parts
    if isinstance(msg, LoadReply):
        parts.append(_pack_u16(msg.status))
        _str(parts, msg.message)
        return MessageType.LOAD_REPLY, parts
    if isinstance(msg, Ping):
        parts.append(_U64.pack(msg.nonce))
        return MessageType.PING, parts
    if isinstance(msg, Pong):
        parts.append(_U64.pack(msg.nonce))
        return MessageType.PONG, parts
    if isinstance(msg, Shutdown):
        return MessageType.SHUTDOWN, parts
    raise TypeError(f"not a protocol message: {type(msg).__name__}")


# Header bytes before the payload length, per message type: magic, version, type, flags.
_HEADER_PREFIX = {kind: HEADER.pack(MAGIC, VERSION, kind, 0, 0)[:8] for kind in MessageType}


def encode(msg: Message) -> bytes:
    """The whole frame (header + payload) for one message."""
    msg_type, parts = _encode_payload(msg)
    payload = b"".join(parts)  # then one copy more: cheaper than summing the parts' lengths first
    return _HEADER_PREFIX[msg_type] + _pack_u32(len(payload)) + payload


# ---------------------------------------------------------------------------------------- decoding
#
# Every decoder takes the payload (bytes or memoryview) and its end, reads with ``unpack_from`` at
# explicit offsets and checks each variable-length field against the end before slicing; a
# ``struct.error`` (a fixed field past the end) becomes a ProtocolError in ``decode_payload``.

_u16_from = _U16.unpack_from
_u32_from = _U32.unpack_from
_req_fixed_from = _REQ_FIXED.unpack_from
_res_fixed_from = _RES_FIXED.unpack_from
_STATES = {int(s): s for s in RequestState}
_REQUEST_FLAGS = {int(f): RequestFlags(f) for f in range(4)}  # every combination of the defined bits
_MESSAGE_TYPES = {int(t): t for t in MessageType}


def _truncated(pos: int, need: int, end: int) -> ProtocolError:
    return ProtocolError(f"truncated payload: field of {need} bytes at offset {pos}, have {end - pos}")


def _text(buf: bytes | memoryview, pos: int, end: int) -> tuple[str, int]:
    """A ``str`` field at ``pos``: (value, offset after it)."""
    (n,) = _u32_from(buf, pos)
    pos += 4
    stop = pos + n
    if stop > end:
        raise _truncated(pos, n, end)
    try:
        return str(buf[pos:stop], "utf-8"), stop
    except UnicodeDecodeError:
        raise ProtocolError(f"invalid UTF-8 in a string field at offset {pos}") from None


def _raw(buf: bytes | memoryview, pos: int, end: int) -> tuple[bytes, int]:
    """A ``bytes`` field at ``pos``: (value, offset after it)."""
    (n,) = _u32_from(buf, pos)
    pos += 4
    stop = pos + n
    if stop > end:
        raise _truncated(pos, n, end)
    return bytes(buf[pos:stop]), stop


def _count(buf: bytes | memoryview, pos: int, end: int, min_item_size: int) -> int:
    # A count that cannot fit in what is left is rejected before any loop runs.
    (n,) = _u32_from(buf, pos)
    if n * min_item_size > end - pos - 4:
        raise ProtocolError(f"count {n} exceeds what the payload can hold")
    return n


def _pairs_at(buf: bytes | memoryview, pos: int, end: int) -> tuple[tuple[tuple[str, str], ...], int]:
    n = _count(buf, pos, end, 8)
    pos += 4
    if not n:
        return (), pos
    out = []
    try:
        for _ in range(n):  # _text, inlined: headers are most of a NEW request's fields
            (size,) = _u32_from(buf, pos)
            start = pos + 4
            pos = start + size
            if pos > end:
                raise _truncated(start, size, end)
            name = str(buf[start:pos], "utf-8")
            (size,) = _u32_from(buf, pos)
            start = pos + 4
            pos = start + size
            if pos > end:
                raise _truncated(start, size, end)
            out.append((name, str(buf[start:pos], "utf-8")))
    except UnicodeDecodeError:
        raise ProtocolError(f"invalid UTF-8 in a string field at offset {start}") from None
    return tuple(out), pos


def _decode_infer(buf: bytes | memoryview, end: int) -> tuple[InferRequest, int]:
    frame_id, n = _FRAME_FIXED.unpack_from(buf, 0)
    pos = 8
    if n * 10 > end - pos:
        raise ProtocolError(f"count {n} exceeds what the payload can hold")
    requests = []
    for _ in range(n):
        request_id, pos = _text(buf, pos, end)
        state_value, flags_value = _req_fixed_from(buf, pos)
        pos += 2
        state = _STATES.get(state_value)
        if state is None:
            raise ProtocolError(f"unknown RequestState value {state_value}")
        flags = _REQUEST_FLAGS.get(flags_value)
        if flags is None:
            raise ProtocolError(f"unknown request flags {flags_value:#x}")
        sequence_id, pos = _text(buf, pos, end)
        if state is _NEW:
            headers, pos = _pairs_at(buf, pos, end)
            num_params = _count(buf, pos, end, 12)
            pos += 4
            params = []
            for _ in range(num_params):
                name, pos = _text(buf, pos, end)
                content_type, pos = _text(buf, pos, end)
                value, pos = _raw(buf, pos, end)
                params.append(InputParameter(name, content_type, value))
            requests.append(WireRequest(request_id, state, sequence_id, flags, headers, tuple(params)))
        else:
            requests.append(WireRequest(request_id, state, sequence_id, flags))
    return InferRequest(frame_id, tuple(requests)), pos


def _decode_reply(buf: bytes | memoryview, end: int) -> tuple[InferReply, int]:
    frame_id, final, n = _REPLY_FIXED.unpack_from(buf, 0)
    if final > 1:
        raise ProtocolError(f"bad final flag {final}")
    pos = 9
    if n * 19 > end - pos:
        raise ProtocolError(f"count {n} exceeds what the payload can hold")
    results = []
    for _ in range(n):
        request_id, pos = _text(buf, pos, end)
        status, flags = _res_fixed_from(buf, pos)
        pos += 3
        if flags > 1:
            raise ProtocolError(f"unknown result flags {flags:#x}")
        message, pos = _text(buf, pos, end)
        content_type, pos = _text(buf, pos, end)
        headers, pos = _pairs_at(buf, pos, end)
        body, pos = _raw(buf, pos, end)
        results.append(WireResult(request_id, status, flags == 1, message, content_type, headers, body))
    return InferReply(frame_id, final == 1, tuple(results)), pos


def _decode_load(buf: bytes | memoryview, end: int) -> tuple[LoadRequest, int]:
    texts = []
    pos = 0
    for _ in range(4):
        text, pos = _text(buf, pos, end)
        texts.append(text)
    batch_size, gpu_id, max_response_size = _LOAD_FIXED.unpack_from(buf, pos)
    pos += _LOAD_FIXED.size
    manifest_json, pos = _text(buf, pos, end)
    yaml_json, pos = _text(buf, pos, end)
    return LoadRequest(*texts, batch_size, gpu_id, max_response_size, manifest_json, yaml_json), pos


def _decode_load_reply(buf: bytes | memoryview, end: int) -> tuple[LoadReply, int]:
    (status,) = _u16_from(buf, 0)
    message, pos = _text(buf, 2, end)
    return LoadReply(status, message), pos


_DECODERS = {
    MessageType.INFER: _decode_infer,
    MessageType.INFER_REPLY: _decode_reply,
    MessageType.LOAD: _decode_load,
    MessageType.LOAD_REPLY: _decode_load_reply,
    MessageType.PING: lambda buf, end: (Ping(_U64.unpack_from(buf, 0)[0]), 8),
    MessageType.PONG: lambda buf, end: (Pong(_U64.unpack_from(buf, 0)[0]), 8),
    MessageType.SHUTDOWN: lambda buf, end: (Shutdown(), 0),
}


def decode_header(header: bytes, max_payload: int = DEFAULT_MAX_PAYLOAD) -> tuple[MessageType, int]:
    """Check a 12-byte header; returns the message type and the payload length to read next."""
    if len(header) != HEADER_SIZE:
        raise ProtocolError(f"header is {len(header)} bytes, expected {HEADER_SIZE}")
    magic, version, msg_type, _flags, length = HEADER.unpack(header)
    if magic != MAGIC:
        raise ProtocolError(f"bad magic {magic!r}")
    if version != VERSION:
        raise ProtocolError(f"unsupported protocol version {version} (this side speaks {VERSION})")
    kind = _MESSAGE_TYPES.get(msg_type)
    if kind is None:
        raise ProtocolError(f"unknown MessageType value {msg_type}")
    if length > max_payload:
        raise ProtocolError(f"{kind.name} payload of {length} bytes exceeds the limit of {max_payload} bytes")
    return kind, length


def decode_payload(msg_type: MessageType, payload: bytes | memoryview) -> Message:
    decoder = _DECODERS.get(msg_type)
    if decoder is None:  # pragma: no cover - decode_header already rejected it
        raise ProtocolError(f"unknown message type {msg_type}")
    end = len(payload)
    try:
        msg, pos = decoder(payload, end)
    except struct.error:  # a fixed-size field past the end of the payload
        raise ProtocolError(f"truncated {msg_type.name} payload of {end} bytes") from None
    if pos != end:
        raise ProtocolError(f"{end - pos} trailing bytes after the payload")
    return msg  # type: ignore[no-any-return]


def decode(frame: bytes, max_payload: int = DEFAULT_MAX_PAYLOAD) -> Message:
    """Decode exactly one whole frame (header + payload)."""
    msg_type, length = decode_header(bytes(frame[:HEADER_SIZE]), max_payload)
    if len(frame) - HEADER_SIZE != length:
        raise ProtocolError(f"frame holds {len(frame) - HEADER_SIZE} payload bytes, header says {length}")
    return decode_payload(msg_type, memoryview(frame)[HEADER_SIZE:])


class FrameDecoder:
    """Incremental decoder: feed arbitrary byte chunks, get whole messages back in order."""

    def __init__(self, max_payload: int = DEFAULT_MAX_PAYLOAD) -> None:
        self.max_payload = max_payload
        self._buf = bytearray()
        self._pending: tuple[MessageType, int] | None = None

    def feed(self, data: bytes) -> list[Message]:
        self._buf += data
        out: list[Message] = []
        while True:
            if self._pending is None:
                if len(self._buf) < HEADER_SIZE:
                    return out
                self._pending = decode_header(bytes(self._buf[:HEADER_SIZE]), self.max_payload)
                del self._buf[:HEADER_SIZE]
            msg_type, length = self._pending
            if len(self._buf) < length:
                return out
            payload = bytes(self._buf[:length])
            del self._buf[:length]
            self._pending = None
            out.append(decode_payload(msg_type, payload))

    @property
    def buffered(self) -> int:
        """Bytes held that do not yet make a whole frame (0 at a frame boundary)."""
        return len(self._buf) + (HEADER_SIZE if self._pending else 0)


# ---------------------------------------------------------------------------------------- streams


async def read_frame(reader: asyncio.StreamReader, max_payload: int = DEFAULT_MAX_PAYLOAD) -> tuple[MessageType, bytes]:
    """Read one frame's type and raw payload from an asyncio stream, without decoding the payload
    (callers that time the decoding separately use this, then ``decode_payload``)."""
    try:
        header = await reader.readexactly(HEADER_SIZE)
    except asyncio.IncompleteReadError as exc:
        raise ConnectionClosed(partial=bool(exc.partial)) from None
    msg_type, length = decode_header(header, max_payload)
    try:
        payload = await reader.readexactly(length) if length else b""
    except asyncio.IncompleteReadError:
        raise ConnectionClosed(partial=True) from None
    return msg_type, payload


async def read_message(reader: asyncio.StreamReader, max_payload: int = DEFAULT_MAX_PAYLOAD) -> Message:
    """Read one message from an asyncio stream (the frontend side)."""
    return decode_payload(*await read_frame(reader, max_payload))


def write_message(writer: asyncio.StreamWriter, msg: Message) -> None:
    """Queue one message on an asyncio stream; the caller awaits ``writer.drain()`` as needed."""
    writer.write(encode(msg))


def _recv_exactly(sock: socket.socket, n: int, at_boundary: bool) -> bytes:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise ConnectionClosed(partial=not (at_boundary and got == 0))
        got += k
    return bytes(buf)


def recv_message(sock: socket.socket, max_payload: int = DEFAULT_MAX_PAYLOAD) -> Message:
    """Read one message from a blocking socket (the worker side)."""
    msg_type, length = decode_header(_recv_exactly(sock, HEADER_SIZE, True), max_payload)
    payload = _recv_exactly(sock, length, False) if length else b""
    return decode_payload(msg_type, payload)


class SocketReader:
    """Messages from a blocking socket through a buffer (the worker's side): one ``recv`` usually
    brings a whole frame, header and payload, where ``recv_message`` makes two calls. Bytes past
    the frame stay buffered for the next call. Same errors as ``recv_message``."""

    __slots__ = ("_buf", "sock")

    CHUNK = 1 << 16  # smallest read; a larger frame is read in reads of up to MAX_READ
    MAX_READ = 1 << 22

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._buf = bytearray()

    def _fill(self, need: int) -> None:
        data = self.sock.recv(min(max(need, self.CHUNK), self.MAX_READ))
        if not data:
            raise ConnectionClosed(partial=bool(self._buf))
        self._buf += data

    def input_ready(self) -> bool:
        """Whether bytes of a next message are buffered or readable now; never blocks. A partly
        arrived frame (or the peer's end of stream) counts: reading it will not wait long."""
        if self._buf:
            return True
        readable, _, _ = select.select([self.sock], [], [], 0)
        return bool(readable)

    def recv_message(self, max_payload: int = DEFAULT_MAX_PAYLOAD) -> Message:
        buf = self._buf
        while len(buf) < HEADER_SIZE:
            self._fill(HEADER_SIZE - len(buf))
        msg_type, length = decode_header(bytes(buf[:HEADER_SIZE]), max_payload)
        end = HEADER_SIZE + length
        while len(buf) < end:
            self._fill(end - len(buf))
        with memoryview(buf) as view:
            payload = view[HEADER_SIZE:end].tobytes()
        del buf[:end]
        return decode_payload(msg_type, payload)


def send_message(sock: socket.socket, msg: Message) -> None:
    """Write one message to a blocking socket."""
    sock.sendall(encode(msg))
