"""HTTP request → the parts of a Job: input parameters, headers, sequence id and flags.

As TorchServe hands requests to handlers: query parameters become parameters (content type ""),
then either one parameter per form field (multipart: its name and its own content type, "" for a
plain field; urlencoded: name, "") or the raw body as the parameter ``body`` with the request's
content type. The worker decodes JSON and text for the handler.
"""

from __future__ import annotations

import uuid

from aiohttp import BodyPartReader, web
from multidict import CIMultiDictProxy

from backend.protocol import InputParameter, RequestFlags
from frontend.config import ServerConfig
from frontend.errors import BadRequest, RequestTooLarge

FORM_URLENCODED = "application/x-www-form-urlencoded"
MULTIPART_FORM = "multipart/form-data"


def check_content_length(request: web.Request, limit: int) -> None:
    """Refuse an oversized body from its Content-Length, before a byte of it is read."""
    length = request.content_length
    if length is not None and length > limit:
        raise RequestTooLarge(f"Request body of {length} bytes exceeds max_request_size ({limit} bytes)")


async def read_parameters(request: web.Request, limit: int) -> list[InputParameter]:
    # request.query parses the query string into a MultiDict: skip it when there is none.
    params = [InputParameter(name, "", value.encode()) for name, value in request.query.items()] \
        if request.query_string else []
    media_type = request.content_type  # lower-cased, without parameters
    if media_type == MULTIPART_FORM:
        params += await _read_multipart(request, limit)
    elif media_type == FORM_URLENCODED:
        try:
            form = await request.post()  # bounded by the app's client_max_size (= max_request_size)
        except ValueError as exc:
            raise BadRequest(f"malformed form body: {exc}") from None
        params += [InputParameter(name, "", str(value).encode()) for name, value in form.items()]
    else:
        body = await request.read()  # bounded by client_max_size: a chunked body cannot outgrow it
        content_type = request.headers.get("Content-Type", "")
        params.append(InputParameter("body", content_type, body))
    return params


async def _read_multipart(request: web.Request, limit: int) -> list[InputParameter]:
    # The multipart reader is not bounded by client_max_size: count the bytes ourselves.
    params: list[InputParameter] = []
    total = 0
    try:
        reader = await request.multipart()
        while (part := await reader.next()) is not None:
            if not isinstance(part, BodyPartReader):
                raise BadRequest("nested multipart bodies are not supported")
            chunks: list[bytes] = []
            while chunk := await part.read_chunk(1 << 16):
                total += len(chunk)
                if total > limit:
                    raise RequestTooLarge(f"Request body exceeds max_request_size ({limit} bytes)")
                chunks.append(chunk)
            data = part.decode(b"".join(chunks))  # undo Content-Transfer-Encoding if any
            content_type = part.headers.get("Content-Type", "")  # "" for a plain field, as TorchServe
            params.append(InputParameter(part.name or "body", content_type, bytes(data)))
    except (ValueError, AssertionError) as exc:  # aiohttp signals malformed multipart this way
        raise BadRequest(f"malformed multipart body: {exc}") from None
    return params


def request_headers(headers: CIMultiDictProxy[str]) -> list[tuple[str, str]]:
    return list(headers.items())


def sequence_fields(
    headers: CIMultiDictProxy[str], config: ServerConfig,
) -> tuple[str, RequestFlags, bool]:
    """For a sequence model: (sequence id, flags, id was made by the server).

    Header names come from config (``ts_header_key_sequence_*``) and match case-insensitively.
    No id → a new sequence with a server-made ``ts-seq-<uuid4>`` id and the START flag. Whether an
    id is valid (open, closed, expired, unknown) is the batcher's decision, not this layer's.
    """
    flags = RequestFlags.NONE
    sequence_id = headers.get(config.sequence_id_header, "").strip()
    generated = False
    if not sequence_id:
        sequence_id = f"ts-seq-{uuid.uuid4()}"
        generated = True
        flags |= RequestFlags.SEQUENCE_START
    if config.sequence_start_header in headers:
        flags |= RequestFlags.SEQUENCE_START
    if config.sequence_end_header in headers:
        flags |= RequestFlags.SEQUENCE_END
    if len(sequence_id) > 256:
        raise BadRequest(f"header {config.sequence_id_header} is longer than 256 characters")
    return sequence_id, flags, generated
