"""Parse and validate one text-generation request body into a prompt and frozen generation params.

Every rule that can refuse a request lives here, so that a refused request never reaches the
engine and never disturbs the others in its batch. A refusal is a `RequestError` carrying the HTTP
status (400 for the client's mistakes) and a message that names the field and the limit broken.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

# Server default for `max_new_tokens` when neither the request, the handler config nor the model's
# generation_config sets one (always further capped by the context length and the KV budget).
DEFAULT_MAX_NEW_TOKENS = 256
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256


class RequestError(ValueError):
    """A request that cannot be served; `status` is the HTTP status for that request alone."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


@dataclass(frozen=True, slots=True)
class GenerationParams:
    """How to generate for one request. Frozen: parsed once, read at every step."""

    max_new_tokens: int
    temperature: float = 0.0  # 0 → greedy (argmax), the default
    top_p: float = 1.0  # nucleus sampling; 1.0 → off
    top_k: int = 0  # 0 → off
    seed: int | None = None  # per-request torch.Generator seed; None → nondeterministic
    stop: tuple[str, ...] = ()  # stop strings: cut from the text, never emitted
    stop_token_ids: frozenset[int] = frozenset()  # extra stop tokens (EOS is implicit)
    ignore_eos: bool = False  # keep generating through EOS (benchmarks)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(frozen=True, slots=True)
class RequestLimits:
    """Model- and config-derived limits every request is checked against."""

    context_length: int  # max prompt + new tokens (max_position_embeddings)
    max_batch_tokens: int  # KV budget; one request needs prompt + max_new_tokens of it
    default_max_new_tokens: int  # used when the request sets none
    vocab_size: int


@dataclass(frozen=True, slots=True)
class ParsedRequest:
    prompt_ids: tuple[int, ...]
    params: GenerationParams


def body_of(item: Any) -> Any:
    """The request payload of one `data` entry: TorchServe puts it under "body" or "data"."""
    if isinstance(item, dict) and ("body" in item or "data" in item):
        body = item.get("body")
        return item.get("data") if body is None else body
    return item


def parse_request(body: Any, tokenizer: Any, limits: RequestLimits) -> ParsedRequest:
    """Validate `body` (a JSON object, a JSON string, or plain text = the prompt)."""
    body = _as_object(body)
    if ("prompt" in body) == ("messages" in body):
        raise RequestError('the body must have exactly one of "prompt" (a string) or "messages" (a list)')
    if "prompt" in body:
        prompt_ids = _encode_prompt(body["prompt"], tokenizer)
    else:
        prompt_ids = _encode_messages(body["messages"], tokenizer)
    num_prompt = len(prompt_ids)
    if num_prompt == 0:
        raise RequestError("the prompt encodes to no tokens")
    room = min(limits.context_length, limits.max_batch_tokens) - num_prompt
    if num_prompt >= limits.context_length:
        raise RequestError(
            f"the prompt has {num_prompt} tokens; this model's context length is {limits.context_length} tokens, "
            "which leaves no room for new tokens"
        )
    if room <= 0:
        raise RequestError(
            f"the prompt has {num_prompt} tokens; the KV-cache budget (handler max_batch_tokens) is "
            f"{limits.max_batch_tokens} tokens per batch, which leaves no room for new tokens"
        )

    max_new = _max_new_tokens(body)
    if max_new is None:
        max_new = min(limits.default_max_new_tokens, room)
    elif num_prompt + max_new > limits.context_length:
        raise RequestError(
            f"prompt ({num_prompt} tokens) + max_new_tokens ({max_new}) exceeds this model's context length "
            f"of {limits.context_length} tokens"
        )
    elif num_prompt + max_new > limits.max_batch_tokens:
        raise RequestError(
            f"prompt ({num_prompt} tokens) + max_new_tokens ({max_new}) exceeds the KV-cache budget "
            f"(handler max_batch_tokens) of {limits.max_batch_tokens} tokens"
        )

    params = GenerationParams(
        max_new_tokens=max_new,
        temperature=_number(body, "temperature", 0.0, low=0.0, high=100.0),
        top_p=_number(body, "top_p", 1.0, low=0.0, high=1.0, low_open=True),
        top_k=_top_k(body),
        seed=_seed(body),
        stop=_stop_strings(body),
        stop_token_ids=_stop_token_ids(body, limits.vocab_size),
        ignore_eos=_flag(body, "ignore_eos"),
    )
    return ParsedRequest(prompt_ids=tuple(prompt_ids), params=params)


# ---- body and prompt ---------------------------------------------------------------------------


def _as_object(body: Any) -> dict:
    if isinstance(body, (bytes, bytearray)):
        try:
            body = bytes(body).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise RequestError(f"the body is not valid UTF-8: {exc}") from None
    if isinstance(body, str):
        if body.lstrip().startswith("{"):
            try:
                body = json.loads(body)
            except json.JSONDecodeError as exc:
                raise RequestError(f"the body looks like JSON but does not parse: {exc}") from None
        else:
            return {"prompt": body}
    if not isinstance(body, dict):
        raise RequestError(f"the body must be a JSON object or plain text, got {type(body).__name__}")
    return body


def _encode_prompt(prompt: Any, tokenizer: Any) -> list[int]:
    if not isinstance(prompt, str):
        raise RequestError(f'"prompt" must be a string, got {type(prompt).__name__}')
    return list(tokenizer(prompt, add_special_tokens=True)["input_ids"])


def _encode_messages(messages: Any, tokenizer: Any) -> list[int]:
    if not isinstance(messages, list) or not messages:
        raise RequestError('"messages" must be a non-empty list of {"role": ..., "content": ...} objects')
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise RequestError(f'"messages"[{i}] must be an object with a string "role"')
        if not isinstance(message.get("content"), str):
            raise RequestError(f'"messages"[{i}]["content"] must be a string')
    if not getattr(tokenizer, "chat_template", None):
        raise RequestError('this model has no chat template; send "prompt" instead of "messages"')
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    except Exception as exc:  # a template's own `raise_exception` (e.g. roles must alternate)
        raise RequestError(f"the chat template refused the messages: {exc}") from None
    # The template already contains BOS and friends: do not add special tokens a second time.
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


# ---- fields --------------------------------------------------------------------------------------


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _max_new_tokens(body: dict) -> int | None:
    # `max_tokens` (OpenAI's name) is accepted when `max_new_tokens` is absent.
    key = "max_new_tokens" if "max_new_tokens" in body else "max_tokens"
    value = body.get(key)
    if value is None:
        return None
    if not _is_int(value) or value < 1:
        raise RequestError(f'"{key}" must be an integer >= 1, got {value!r}')
    return value


def _number(body: dict, key: str, default: float, *, low: float, high: float, low_open: bool = False) -> float:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise RequestError(f'"{key}" must be a number, got {value!r}')
    if value > high or value < low or (low_open and value == low):
        bound = f"({low}, {high}]" if low_open else f"[{low}, {high}]"
        raise RequestError(f'"{key}" must be in {bound}, got {value!r}')
    return float(value)


def _top_k(body: dict) -> int:
    value = body.get("top_k")
    if value is None:
        return 0
    if not _is_int(value) or value < -1:
        raise RequestError(f'"top_k" must be an integer >= 0 (0 or -1 = off), got {value!r}')
    return max(value, 0)


def _seed(body: dict) -> int | None:
    value = body.get("seed")
    if value is None:
        return None
    if not _is_int(value) or not 0 <= value < 2**63:
        raise RequestError(f'"seed" must be an integer in [0, 2**63), got {value!r}')
    return value


def _stop_strings(body: dict) -> tuple[str, ...]:
    value = body.get("stop")
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise RequestError('"stop" must be a non-empty string or a list of non-empty strings')
    if len(stops) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_STRING_CHARS for s in stops):
        raise RequestError(f'"stop" allows at most {MAX_STOP_STRINGS} strings of at most {MAX_STOP_STRING_CHARS} characters')
    return tuple(dict.fromkeys(stops))


def _stop_token_ids(body: dict, vocab_size: int) -> frozenset[int]:
    value = body.get("stop_token_ids")
    if value is None:
        return frozenset()
    if not isinstance(value, list) or not all(_is_int(t) and 0 <= t < vocab_size for t in value):
        raise RequestError(f'"stop_token_ids" must be a list of token ids in [0, {vocab_size})')
    return frozenset(value)


def _flag(body: dict, key: str) -> bool:
    value = body.get(key, False)
    if not isinstance(value, bool):
        raise RequestError(f'"{key}" must be true or false, got {value!r}')
    return value
