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
import socket
import struct
from dataclasses import dataclass, field
from enum import IntEnum, IntFlag
from typing import Sequence, Union

MAGIC = b"CNVY"
VERSION = 1
HEADER = struct.Struct("!4sBBHI")
HEADER_SIZE = HEADER.size  # 12
DEFAULT_MAX_PAYLOAD = 64 * 1024 * 1024

_U8 = struct.Struct("!B")
_U16 = struct.Struct("!H")
_U32 = struct.Struct("!I")
_I32 = struct.Struct("!i")
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


def _str(parts: list[bytes], value: str) -> None:
    data = value.encode("utf-8")
    parts.append(_U32.pack(len(data)))
    parts.append(data)


def _bytes(parts: list[bytes], value: bytes) -> None:
    parts.append(_U32.pack(len(value)))
    parts.append(bytes(value))


def _pairs(parts: list[bytes], pairs: Sequence[tuple[str, str]]) -> None:
    parts.append(_U32.pack(len(pairs)))
    for name, value in pairs:
        _str(parts, name)
        _str(parts, value)


def _encode_payload(msg: Message) -> tuple[MessageType, list[bytes]]:
    parts: list[bytes] = []
    if isinstance(msg, InferRequest):
        parts.append(_FRAME_FIXED.pack(msg.frame_id, len(msg.requests)))
        for req in msg.requests:
            _str(parts, req.request_id)
            parts.append(_REQ_FIXED.pack(int(req.state), int(req.flags)))
            _str(parts, req.sequence_id)
            if req.state == RequestState.NEW:
                _pairs(parts, req.headers)
                parts.append(_U32.pack(len(req.parameters)))
                for param in req.parameters:
                    _str(parts, param.name)
                    _str(parts, param.content_type)
                    _bytes(parts, param.value)
        return MessageType.INFER, parts
    if isinstance(msg, InferReply):
        parts.append(_REPLY_FIXED.pack(msg.frame_id, 1 if msg.final else 0, len(msg.results)))
        for res in msg.results:
            _str(parts, res.request_id)
            parts.append(_RES_FIXED.pack(res.status, ResultFlags.DONE if res.done else 0))
            _str(parts, res.message)
            _str(parts, res.content_type)
            _pairs(parts, res.headers)
            _bytes(parts, res.body)
        return MessageType.INFER_REPLY, parts
    if isinstance(msg, LoadRequest):
        for text in (msg.model_name, msg.model_dir, msg.handler, msg.worker_id):
            _str(parts, text)
        parts.append(_LOAD_FIXED.pack(msg.batch_size, msg.gpu_id, msg.max_response_size))
        _str(parts, msg.manifest_json)
        _str(parts, msg.model_yaml_config_json)
        return MessageType.LOAD, parts
    if isinstance(msg, LoadReply):
        parts.append(_U16.pack(msg.status))
        _str(parts, msg.message)
        return MessageType.LOAD_REPLY, parts
    if isinstance(msg, Ping):
        return MessageType.PING, [_U64.pack(msg.nonce)]
    if isinstance(msg, Pong):
        return MessageType.PONG, [_U64.pack(msg.nonce)]
    if isinstance(msg, Shutdown):
        return MessageType.SHUTDOWN, []
    raise TypeError(f"not a protocol message: {type(msg).__name__}")


def encode(msg: Message) -> bytes:
    """The whole frame (header + payload) for one message."""
    msg_type, parts = _encode_payload(msg)
    payload = b"".join(parts)
    return HEADER.pack(MAGIC, VERSION, msg_type, 0, len(payload)) + payload


# ---------------------------------------------------------------------------------------- decoding


class _Reader:
    """Bounds-checked cursor over one payload; every overrun becomes a ProtocolError."""

    __slots__ = ("buf", "pos", "end")

    def __init__(self, buf: bytes | memoryview) -> None:
        self.buf = memoryview(buf)
        self.pos = 0
        self.end = len(self.buf)

    def fixed(self, st: struct.Struct) -> tuple:
        pos = self.pos
        if pos + st.size > self.end:
            raise ProtocolError(f"truncated payload: need {st.size} bytes at offset {pos}, have {self.end - pos}")
        self.pos = pos + st.size
        return st.unpack_from(self.buf, pos)

    def u32(self) -> int:
        return self.fixed(_U32)[0]

    def raw(self) -> bytes:
        n = self.u32()
        pos = self.pos
        if n > self.end - pos:
            raise ProtocolError(f"truncated payload: field of {n} bytes at offset {pos}, have {self.end - pos}")
        self.pos = pos + n
        return bytes(self.buf[pos : pos + n])

    def text(self) -> str:
        data = self.raw()
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ProtocolError(f"invalid UTF-8 in a string field at offset {self.pos - len(data)}") from exc

    def count(self, min_item_size: int) -> int:
        # A count that cannot fit in what is left is rejected before any loop runs.
        n = self.u32()
        if n * min_item_size > self.end - self.pos:
            raise ProtocolError(f"count {n} exceeds what the payload can hold")
        return n

    def pairs(self) -> tuple[tuple[str, str], ...]:
        return tuple((self.text(), self.text()) for _ in range(self.count(8)))

    def finish(self) -> None:
        if self.pos != self.end:
            raise ProtocolError(f"{self.end - self.pos} trailing bytes after the payload")


def _enum(kind: type[IntEnum], value: int) -> IntEnum:
    try:
        return kind(value)
    except ValueError:
        raise ProtocolError(f"unknown {kind.__name__} value {value}") from None


def _decode_infer(r: _Reader) -> InferRequest:
    frame_id, n = r.fixed(_FRAME_FIXED)
    if n * 10 > r.end - r.pos:
        raise ProtocolError(f"count {n} exceeds what the payload can hold")
    requests = []
    for _ in range(n):
        request_id = r.text()
        state_value, flags_value = r.fixed(_REQ_FIXED)
        state = _enum(RequestState, state_value)
        if flags_value & ~int(RequestFlags.SEQUENCE_START | RequestFlags.SEQUENCE_END):
            raise ProtocolError(f"unknown request flags {flags_value:#x}")
        sequence_id = r.text()
        headers: tuple = ()
        parameters: tuple = ()
        if state == RequestState.NEW:
            headers = r.pairs()
            parameters = tuple(
                InputParameter(r.text(), r.text(), r.raw()) for _ in range(r.count(12))
            )
        requests.append(WireRequest(request_id, state, sequence_id, RequestFlags(flags_value), headers, parameters))
    return InferRequest(frame_id, tuple(requests))


def _decode_reply(r: _Reader) -> InferReply:
    frame_id, final, n = r.fixed(_REPLY_FIXED)
    if final > 1:
        raise ProtocolError(f"bad final flag {final}")
    if n * 19 > r.end - r.pos:
        raise ProtocolError(f"count {n} exceeds what the payload can hold")
    results = []
    for _ in range(n):
        request_id = r.text()
        status, flags = r.fixed(_RES_FIXED)
        if flags & ~int(ResultFlags.DONE):
            raise ProtocolError(f"unknown result flags {flags:#x}")
        message = r.text()
        content_type = r.text()
        headers = r.pairs()
        body = r.raw()
        results.append(WireResult(request_id, status, bool(flags & ResultFlags.DONE), message, content_type, headers, body))
    return InferReply(frame_id, bool(final), tuple(results))


def _decode_load(r: _Reader) -> LoadRequest:
    model_name, model_dir, handler, worker_id = r.text(), r.text(), r.text(), r.text()
    batch_size, gpu_id, max_response_size = r.fixed(_LOAD_FIXED)
    return LoadRequest(model_name, model_dir, handler, worker_id, batch_size, gpu_id, max_response_size, r.text(), r.text())


def decode_header(header: bytes, max_payload: int = DEFAULT_MAX_PAYLOAD) -> tuple[MessageType, int]:
    """Check a 12-byte header; returns the message type and the payload length to read next."""
    if len(header) != HEADER_SIZE:
        raise ProtocolError(f"header is {len(header)} bytes, expected {HEADER_SIZE}")
    magic, version, msg_type, _flags, length = HEADER.unpack(header)
    if magic != MAGIC:
        raise ProtocolError(f"bad magic {magic!r}")
    if version != VERSION:
        raise ProtocolError(f"unsupported protocol version {version} (this side speaks {VERSION})")
    kind = _enum(MessageType, msg_type)
    if length > max_payload:
        raise ProtocolError(f"{kind.name} payload of {length} bytes exceeds the limit of {max_payload} bytes")
    return kind, length  # type: ignore[return-value]


def decode_payload(msg_type: MessageType, payload: bytes | memoryview) -> Message:
    r = _Reader(payload)
    msg: Message
    if msg_type == MessageType.INFER:
        msg = _decode_infer(r)
    elif msg_type == MessageType.INFER_REPLY:
        msg = _decode_reply(r)
    elif msg_type == MessageType.LOAD:
        msg = _decode_load(r)
    elif msg_type == MessageType.LOAD_REPLY:
        status = r.fixed(_U16)[0]
        msg = LoadReply(status, r.text())
    elif msg_type == MessageType.PING:
        msg = Ping(r.fixed(_U64)[0])
    elif msg_type == MessageType.PONG:
        msg = Pong(r.fixed(_U64)[0])
    elif msg_type == MessageType.SHUTDOWN:
        msg = Shutdown()
    else:  # pragma: no cover - decode_header already rejected it
        raise ProtocolError(f"unknown message type {msg_type}")
    r.finish()
    return msg


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


async def read_message(reader: asyncio.StreamReader, max_payload: int = DEFAULT_MAX_PAYLOAD) -> Message:
    """Read one message from an asyncio stream (the frontend side)."""
    try:
        header = await reader.readexactly(HEADER_SIZE)
    except asyncio.IncompleteReadError as exc:
        raise ConnectionClosed(partial=bool(exc.partial)) from None
    msg_type, length = decode_header(header, max_payload)
    try:
        payload = await reader.readexactly(length) if length else b""
    except asyncio.IncompleteReadError:
        raise ConnectionClosed(partial=True) from None
    return decode_payload(msg_type, payload)


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


def send_message(sock: socket.socket, msg: Message) -> None:
    """Write one message to a blocking socket."""
    sock.sendall(encode(msg))
