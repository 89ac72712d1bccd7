"""Wire bytes ↔ handler values: how a request's parameters become ``data[idx]`` and how a handler's
output for one request becomes a result body. TorchServe's rules, so handlers port unchanged.

Input (per parameter, the HTTP body being the parameter named ``body``):
    ``application/json`` (any ``+json`` too) → ``json.loads`` (on failure: the raw bytes),
    ``text/*`` → str (on invalid UTF-8: the raw bytes), anything else → bytes.
    ``TS_DECODE_INPUT_REQUEST=false`` in the worker's environment turns decoding off (TorchServe's switch).

Output (per request), with the content type used when the handler set none:
    bytes/bytearray/memoryview → as is, ``application/octet-stream``;
    str → UTF-8, ``text/plain; charset=utf-8``;
    torch.Tensor → ``torch.save`` bytes, ``application/octet-stream``;
    anything else → ``json.dumps(value, indent=2)`` like TorchServe (numpy values and tensors nested
    inside are converted with ``.tolist()``), ``application/json``. Plain dicts, lists and scalars
    take ``_dumps_indent2``, which writes the same bytes as that call several times faster
    (``json.dumps`` with an indent runs the pure-Python encoder; tests compare the two).
"""

from __future__ import annotations

import io
import json
import os
import sys
from functools import lru_cache
from json.encoder import encode_basestring_ascii
from typing import Any
from collections.abc import Sequence

from backend.protocol import InputParameter, RequestFlags

JSON_CONTENT_TYPE = "application/json"
OCTET_STREAM = "application/octet-stream"
TEXT_PLAIN = "text/plain; charset=utf-8"


class UnsupportedOutput(TypeError):
    """A handler output that none of the serialisation rules accepts."""


def media_type(content_type: str) -> str:
    """``"Application/JSON; charset=utf-8"`` → ``"application/json"``."""
    return content_type.split(";", 1)[0].strip().lower()


_JSON, _TEXT, _RAW = 0, 1, 2


@lru_cache(maxsize=256)
def _decoding_of(content_type: str) -> int:
    """How a parameter of this content type is decoded (cached: clients send few distinct types)."""
    kind = media_type(content_type)
    if kind == JSON_CONTENT_TYPE or kind.endswith("+json"):
        return _JSON
    return _TEXT if kind.startswith("text/") else _RAW


def decoding_enabled() -> bool:
    """TorchServe's switch, read from the worker's environment (once per frame by the worker)."""
    return os.environ.get("TS_DECODE_INPUT_REQUEST", "true").lower() != "false"


def decode_parameter(param: InputParameter, decode: bool = True) -> Any:
    if not decode:
        return param.value
    kind = _decoding_of(param.content_type)
    if kind == _JSON:
        try:
            return json.loads(param.value)
        except ValueError:  # includes UnicodeDecodeError: forward the payload undecoded, as TorchServe
            return param.value
    if kind == _TEXT:
        try:
            return param.value.decode("utf-8")
        except UnicodeDecodeError:
            return param.value
    return param.value


def build_input(parameters: Sequence[InputParameter], decode: bool | None = None) -> dict[str, Any]:
    """One ``data`` entry: ``{parameter name: decoded value}``. ``decode`` defaults to
    ``decoding_enabled()``; a caller building many entries reads that once and passes it."""
    if decode is None:
        decode = decoding_enabled()
    return {p.name: decode_parameter(p, decode) for p in parameters}


def build_headers(
    headers: Sequence[tuple[str, str]],
    parameters: Sequence[InputParameter],
    sequence_id: str = "",
    flags: RequestFlags = RequestFlags.NONE,
    sequence_header_keys: tuple[str, str, str] = ("ts_request_sequence_id", "ts_request_sequence_start",
                                                  "ts_request_sequence_end"),
) -> dict[str, Any]:
    """The request-header view a handler reads with ``context.get_request_header``.

    As TorchServe: each parameter's content type appears as ``{name: {"content-type": ...}}`` and
    request headers override those. A repeated header is joined with ", " (HTTP's rule). The sequence
    headers are filled from the frame's sequence id and flags when the client did not send them, so a
    TorchServe stateful handler finds them where it looks.
    """
    out: dict[str, Any] = {p.name: {"content-type": p.content_type} for p in parameters}
    seen: dict[str, str] = {}  # lower-case name -> key used in out
    for name, value in headers:
        lower = name.lower()
        key = seen.get(lower)
        if key is not None and isinstance(out.get(key), str):
            out[key] = f"{out[key]}, {value}"
        else:
            seen[lower] = name
            out[name] = value
    if not sequence_id and not flags:
        return out
    id_key, start_key, end_key = sequence_header_keys
    bits = int(flags)  # plain int: IntFlag operators are Python-level calls
    if sequence_id and id_key.lower() not in seen:
        out[id_key] = sequence_id
    if bits & _SEQUENCE_START and start_key.lower() not in seen:
        out[start_key] = "true"
    if bits & _SEQUENCE_END and end_key.lower() not in seen:
        out[end_key] = "true"
    return out


_SEQUENCE_START = int(RequestFlags.SEQUENCE_START)
_SEQUENCE_END = int(RequestFlags.SEQUENCE_END)


def _json_default(value: Any) -> Any:
    tolist = getattr(value, "tolist", None)  # numpy arrays/scalars, tensors inside a dict
    if callable(tolist):
        return tolist()
    raise TypeError(f"Object of type {type(value).__name__} is not JSON serializable")


class _NotPlain(Exception):
    """A value ``_dumps_indent2`` leaves to ``json.dumps`` (its exact type is not a plain JSON type)."""


_MAX_FAST_DEPTH = 32  # deeper (or circular) values go to json.dumps, which detects cycles
_INF = float("inf")


def _dumps_indent2(value: Any, level: int = 0) -> str:
    """``json.dumps(value, indent=2)`` for exact dicts (str keys), lists, tuples, str, int, float,
    bool and None; raises _NotPlain for anything else, subclasses included."""
    kind = type(value)
    if kind is str:
        return encode_basestring_ascii(value)
    if value is None:
        return "null"
    if value is True:
        return "true"
    if value is False:
        return "false"
    if kind is int:
        return int.__repr__(value)
    if kind is float:
        if value != value:
            return "NaN"
        if value == _INF:
            return "Infinity"
        if value == -_INF:
            return "-Infinity"
        return float.__repr__(value)
    if level >= _MAX_FAST_DEPTH:
        raise _NotPlain
    if kind is dict:
        if not value:
            return "{}"
        inner = "\n" + "  " * (level + 1)
        items = []
        for key, item in value.items():
            if type(key) is not str:
                raise _NotPlain
            items.append(f"{encode_basestring_ascii(key)}: {_dumps_indent2(item, level + 1)}")
        return "{" + inner + ("," + inner).join(items) + "\n" + "  " * level + "}"
    if kind is list or kind is tuple:
        if not value:
            return "[]"
        inner = "\n" + "  " * (level + 1)
        return "[" + inner + ("," + inner).join([_dumps_indent2(item, level + 1) for item in value]) \
            + "\n" + "  " * level + "]"
    raise _NotPlain


def encode_output(value: Any) -> tuple[bytes, str]:
    """One request's output → (body, content type to use if the handler set none)."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value), OCTET_STREAM
    if isinstance(value, str):
        return value.encode("utf-8"), TEXT_PLAIN
    torch = sys.modules.get("torch")  # an output can only be a tensor if torch is loaded
    if torch is not None and isinstance(value, torch.Tensor):
        buf = io.BytesIO()
        torch.save(value, buf)
        return buf.getvalue(), OCTET_STREAM
    try:
        return _dumps_indent2(value).encode("ascii"), JSON_CONTENT_TYPE
    except _NotPlain:
        pass
    try:
        return json.dumps(value, indent=2, default=_json_default).encode("utf-8"), JSON_CONTENT_TYPE
    except (TypeError, ValueError) as exc:
        raise UnsupportedOutput(f"Unsupported model output data type {type(value).__name__}: {exc}") from exc
