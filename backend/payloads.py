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
    inside are converted with ``.tolist()``), ``application/json``.
"""

from __future__ import annotations

import io
import json
import os
import sys
from typing import Any, Sequence

from backend.protocol import InputParameter, RequestFlags

JSON_CONTENT_TYPE = "application/json"
OCTET_STREAM = "application/octet-stream"
TEXT_PLAIN = "text/plain; charset=utf-8"


class UnsupportedOutput(TypeError):
    """A handler output that none of the serialisation rules accepts."""


def media_type(content_type: str) -> str:
    """``"Application/JSON; charset=utf-8"`` → ``"application/json"``."""
    return content_type.split(";", 1)[0].strip().lower()


def _decoding_enabled() -> bool:
    return os.environ.get("TS_DECODE_INPUT_REQUEST", "true").lower() != "false"


def decode_parameter(param: InputParameter, decode: bool = True) -> Any:
    if not decode:
        return param.value
    kind = media_type(param.content_type)
    if kind == JSON_CONTENT_TYPE or kind.endswith("+json"):
        try:
            return json.loads(param.value)
        except ValueError:  # includes UnicodeDecodeError: forward the payload undecoded, as TorchServe
            return param.value
    if kind.startswith("text/"):
        try:
            return param.value.decode("utf-8")
        except UnicodeDecodeError:
            return param.value
    return param.value


def build_input(parameters: Sequence[InputParameter]) -> dict[str, Any]:
    """One ``data`` entry: ``{parameter name: decoded value}``."""
    decode = _decoding_enabled()
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
        key = seen.get(name.lower())
        if key is not None and isinstance(out.get(key), str):
            out[key] = f"{out[key]}, {value}"
        else:
            seen[name.lower()] = name
            out[name] = value
    id_key, start_key, end_key = sequence_header_keys
    if sequence_id and id_key.lower() not in seen:
        out[id_key] = sequence_id
    if flags & RequestFlags.SEQUENCE_START and start_key.lower() not in seen:
        out[start_key] = "true"
    if flags & RequestFlags.SEQUENCE_END and end_key.lower() not in seen:
        out[end_key] = "true"
    return out


def _json_default(value: Any) -> Any:
    tolist = getattr(value, "tolist", None)  # numpy arrays/scalars, tensors inside a dict
    if callable(tolist):
        return tolist()
    raise TypeError(f"Object of type {type(value).__name__} is not JSON serializable")


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
        return json.dumps(value, indent=2, default=_json_default).encode("utf-8"), JSON_CONTENT_TYPE
    except (TypeError, ValueError) as exc:
        raise UnsupportedOutput(f"Unsupported model output data type {type(value).__name__}: {exc}") from exc
