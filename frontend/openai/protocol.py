"""OpenAI request bodies → the text_generation handler's body, and handler chunks → OpenAI JSON.

Only what is OpenAI-specific is checked here (`n`, parameters we do not support, stream options,
the shape of chat messages); value ranges (temperature, top_p, stop, seed, token budgets) are the
handler's to check, and its 400 comes back with its own message naming the field.

Parameter mapping (OpenAI → handler): `max_completion_tokens` / `max_tokens` → `max_new_tokens`
(absent: the handler's default, never an error); `temperature`, `top_p`, `seed`, `stop` as is;
vLLM's extras `top_k`, `stop_token_ids`, `ignore_eos` as is. `temperature` absent means greedy here
(the handler's documented default), where OpenAI's own default is 1.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

# Sampling fields passed to the handler unchanged when the client sets them (null = unset).
_PASSED = ("temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids", "ignore_eos")


class OpenAIError(Exception):
    """An error answered in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 retry_after: int | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.retry_after = retry_after

    @property
    def error_type(self) -> str:
        # OpenAI's error types; clients branch on the HTTP status, people read the type.
        if self.status == 401:
            return "authentication_error"
        if self.status == 404:
            return "not_found_error"
        if self.status == 429:
            return "rate_limit_error"
        if self.status >= 500:
            return "server_error"
        return "invalid_request_error"

    def to_json(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.error_type, "param": self.param, "code": self.code}}


class Endpoint(Enum):
    COMPLETIONS = "completions"
    CHAT = "chat"


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    """One validated OpenAI request: what to send to the handler and how to answer."""

    endpoint: Endpoint
    model: str
    body: dict[str, Any]  # the handler's request body (docs/llm.md, "Request")
    stream: bool = False
    include_usage: bool = False  # stream_options.include_usage: a last chunk with usage only


def _invalid(message: str, param: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, param)


def parse_json_body(raw: bytes) -> dict[str, Any]:
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise _invalid(f"the request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise _invalid(f"the request body must be a JSON object, got {type(body).__name__}")
    return body


def parse_request(endpoint: Endpoint, body: dict[str, Any]) -> GenerationRequest:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise _invalid('"model" is required: the name of a model served here (GET /v1/models)', "model")
    _check_unsupported(endpoint, body)
    stream = body.get("stream") or False
    if not isinstance(stream, bool):
        raise _invalid(f'"stream" must be true or false, got {stream!r}', "stream")
    include_usage = False
    options = body.get("stream_options")
    if options is not None:
        if not stream:
            raise _invalid('"stream_options" is only allowed when "stream" is true', "stream_options")
        if not isinstance(options, dict):
            raise _invalid('"stream_options" must be an object', "stream_options")
        include_usage = bool(options.get("include_usage"))

    handler_body: dict[str, Any] = {}
    if endpoint is Endpoint.CHAT:
        handler_body["messages"] = _messages(body.get("messages"))
        max_new = body.get("max_completion_tokens")
        if max_new is None:
            max_new = body.get("max_tokens")
    else:
        handler_body["prompt"] = _prompt(body.get("prompt"))
        max_new = body.get("max_tokens")
    if max_new is not None:
        handler_body["max_new_tokens"] = max_new
    for key in _PASSED:
        if body.get(key) is not None:
            handler_body[key] = body[key]
    return GenerationRequest(endpoint, model, handler_body, stream, include_usage)


def _check_unsupported(endpoint: Endpoint, body: dict[str, Any]) -> None:
    """Refuse clearly what we would otherwise silently ignore and answer wrongly."""
    n = body.get("n")
    if n is not None and n != 1:
        raise _invalid(f'"n" must be 1: one choice per request is supported, got {n!r}', "n")
    best_of = body.get("best_of")
    if best_of is not None and best_of != 1:
        raise _invalid(f'"best_of" must be 1, got {best_of!r}', "best_of")
    for key in ("presence_penalty", "frequency_penalty"):
        value = body.get(key)
        if value not in (None, 0, 0.0):
            raise _invalid(f'"{key}" is not supported (send 0 or leave it out)', key)
    checks = {
        "logprobs": body.get("logprobs") not in (None, False),
        "top_logprobs": body.get("top_logprobs") is not None,
        "echo": bool(body.get("echo")),
        "suffix": body.get("suffix") is not None,
        "logit_bias": bool(body.get("logit_bias")),
        "tools": bool(body.get("tools")) or bool(body.get("functions")),
        "tool_choice": body.get("tool_choice") not in (None, "none"),
    }
    for key, used in checks.items():
        if used:
            raise _invalid(f'"{key}" is not supported by this server', key)
    response_format = body.get("response_format")
    if response_format is not None and (not isinstance(response_format, dict) or response_format.get("type") != "text"):
        raise _invalid('"response_format" other than {"type": "text"} is not supported', "response_format")


def _prompt(prompt: Any) -> str:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        return prompt[0]  # a batch of one prompt
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        raise _invalid("one prompt per request is supported; send each prompt as its own request", "prompt")
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) or isinstance(t, list) for t in prompt):
        raise _invalid("prompts as token ids are not supported; send the prompt as a string", "prompt")
    raise _invalid('"prompt" must be a string', "prompt")


def _messages(messages: Any) -> list[dict[str, str]]:
    """OpenAI messages → [{"role", "content": str}] for the chat template. A content given as a list
    of parts keeps its text parts, joined by newlines (as vLLM does)."""
    if not isinstance(messages, list) or not messages:
        raise _invalid('"messages" must be a non-empty list of {"role": ..., "content": ...}', "messages")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise _invalid(f'"messages"[{i}] must be an object with a string "role"', "messages")
        if message.get("tool_calls"):
            raise _invalid(f'"messages"[{i}] has tool calls; tools are not supported by this server', "messages")
        content = message.get("content")
        if isinstance(content, list):
            texts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise _invalid(f'"messages"[{i}]: only text content parts are supported', "messages")
                texts.append(part["text"])
            content = "\n".join(texts)
        elif content is None:
            content = ""
        elif not isinstance(content, str):
            raise _invalid(f'"messages"[{i}]["content"] must be a string or a list of text parts', "messages")
        out.append({"role": message["role"], "content": content})
    return out


# ---- responses ---------------------------------------------------------------------------------


def finish_reason(reason: str | None) -> str | None:
    # The handler's "cancelled" reaches a client only when the server gave up on the request
    # (vLLM calls that "abort"); "stop" and "length" are OpenAI's own.
    return "abort" if reason == "cancelled" else reason


@dataclass(slots=True)
class Completion:
    """What one request generated so far; builds every response and stream chunk shape."""

    request: GenerationRequest
    response_id: str
    created: int = field(default_factory=lambda: int(time.time()))
    texts: list[str] = field(default_factory=list)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    finish_reason: str | None = None

    @property
    def chat(self) -> bool:
        return self.request.endpoint is Endpoint.CHAT

    def usage(self) -> dict[str, int]:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens}

    def response(self) -> dict[str, Any]:
        """The whole non-streamed answer."""
        text = "".join(self.texts)
        if self.chat:
            choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": text},
                                      "logprobs": None, "finish_reason": self.finish_reason}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": self.finish_reason}
        return {"id": self.response_id, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self.request.model, "choices": [choice], "usage": self.usage(),
                "system_fingerprint": None}

    def chunk(self, text: str, reason: str | None, first: bool = False) -> dict[str, Any]:
        """One stream chunk with a choice (`first`: the chat stream's role announcement)."""
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant", "content": text} if first else {"content": text}
            if reason is not None and not text:
                delta = {}
            choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}
        return self._chunk([choice])

    def usage_chunk(self) -> dict[str, Any]:
        """stream_options.include_usage: the last chunk, with no choices and the usage."""
        chunk = self._chunk([])
        chunk["usage"] = self.usage()
        return chunk

    def _chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        chunk: dict[str, Any] = {"id": self.response_id,
                                 "object": "chat.completion.chunk" if self.chat else "text_completion",
                                 "created": self.created, "model": self.request.model, "choices": choices}
        if self.request.include_usage:
            chunk["usage"] = None  # OpenAI: null on every chunk but the last
        return chunk


def sse(data: dict[str, Any] | str) -> bytes:
    """One Server-Sent Event carrying only `data:` (JSON has no raw newlines, so one line)."""
    text = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return f"data: {text}\n\n".encode()


SSE_DONE = sse("[DONE]")
