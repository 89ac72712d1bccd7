"""Incremental detokenization and stop strings: turn one request's token stream into text chunks.

`IncrementalDetokenizer` decodes a small window of recent tokens each step instead of the whole
output, and holds back text that ends in U+FFFD (an incomplete UTF-8 character: a byte-level BPE
model may split one character over several tokens). Emitted text is never revised, and the
concatenation of all chunks equals `tokenizer.decode(output_ids, skip_special_tokens=True,
clean_up_tokenization_spaces=False)` decoded in one go (a real U+FFFD in the output is released
by `flush()` at the end, or as soon as a later token completes a clean decode).

`StopStringFilter` holds back the longest tail of the text that could still grow into a stop
string, so a stop string is never emitted, not even its first characters in an earlier chunk; on
a match the text is cut just before the earliest stop string and the request finishes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from transformers import PreTrainedTokenizerFast

REPLACEMENT_CHAR = "\ufffd"
# Prompt tokens used as left context, so a tokenizer that treats a sequence's first token
# specially (SentencePiece strips its leading space) decodes the first new token as it would mid-text.
PROMPT_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """Decode one request's generated tokens into text chunks, correctly across token boundaries."""

    __slots__ = ("_decode_ids", "_prefix_offset", "_read_offset", "_tokens")

    def __init__(self, tokenizer: Any, prompt_ids: Sequence[int], skip_special_tokens: bool = True) -> None:
        self._decode_ids = text_decoder(tokenizer, skip_special_tokens)
        # tokens[:_read_offset] are already turned into text; tokens[_prefix_offset:_read_offset]
        # is the left context re-decoded with each new token.
        self._tokens: list[int] = list(prompt_ids[-PROMPT_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._tokens)

    def push(self, token_ids: Sequence[int]) -> str:
        """Add new tokens; return the text they complete ('' while a character is incomplete)."""
        self._tokens.extend(token_ids)
        prefix_text = self._decode(self._tokens[self._prefix_offset : self._read_offset])
        full_text = self._decode(self._tokens[self._prefix_offset :])
        if len(full_text) <= len(prefix_text) or full_text.endswith(REPLACEMENT_CHAR):
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._tokens)
        return full_text[len(prefix_text) :]

    def flush(self) -> str:
        """At the end: whatever is still held back, U+FFFD included."""
        prefix_text = self._decode(self._tokens[self._prefix_offset : self._read_offset])
        full_text = self._decode(self._tokens[self._prefix_offset :])
        self._prefix_offset = self._read_offset = len(self._tokens)
        return full_text[len(prefix_text) :]

    def _decode(self, token_ids: list[int]) -> str:
        return self._decode_ids(token_ids) if token_ids else ""


def text_decoder(tokenizer: Any, skip_special_tokens: bool = True) -> Callable[[list[int]], str]:
    """`ids -> text` as `tokenizer.decode(ids, skip_special_tokens, clean_up_tokenization_spaces=False)`.

    Two decodes per token per request add up: for a Rust-backed tokenizer that does not customise
    decoding, call the `tokenizers` decoder directly (what transformers' `_decode` does, without
    its Python layers: about 5× cheaper per call).
    """
    if isinstance(tokenizer, PreTrainedTokenizerFast) and type(tokenizer)._decode is PreTrainedTokenizerFast._decode:
        backend = tokenizer.backend_tokenizer
        return lambda ids: backend.decode(ids, skip_special_tokens=skip_special_tokens)
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False)


class StopStringFilter:
    """Hold back text that may be the start of a stop string; cut the text at the first match."""

    __slots__ = ("_held", "_stops", "stopped")

    def __init__(self, stops: Sequence[str]) -> None:
        self._stops = tuple(stops)
        self._held = ""
        self.stopped = False

    def push(self, text: str) -> str:
        """Return the text that is safe to emit now; sets `stopped` when a stop string appeared."""
        if self.stopped:
            return ""
        if not self._stops:
            return text
        buffer = self._held + text
        cut = min((i for i in (buffer.find(stop) for stop in self._stops) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            self._held = ""
            return buffer[:cut]
        keep = self._longest_partial_match(buffer)
        self._held = buffer[len(buffer) - keep :] if keep else ""
        return buffer[: len(buffer) - keep]

    def flush(self) -> str:
        """At the end of generation without a match: the held text was not a stop string after all."""
        held, self._held = self._held, ""
        return "" if self.stopped else held

    def _longest_partial_match(self, buffer: str) -> int:
        """Length of the longest suffix of `buffer` that is a proper prefix of some stop string."""
        best = 0
        for stop in self._stops:
            for size in range(min(len(stop) - 1, len(buffer)), best, -1):
                if buffer.endswith(stop[:size]):
                    best = size
                    break
        return best
