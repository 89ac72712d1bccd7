"""The continuous-decode engine: admit, prefill, decode one token for every running request, free.

One `step()` is one iteration of the scheduler (called once per INFER frame):

1. **Admit** waiting requests in arrival order while the memory budget allows (below).
2. **Prefill** admitted requests, each unpadded in its own `PrefillCache`, in forwards of at most
   `prefill_chunk_size` tokens. While some request is decoding, the step's prefill work is capped
   at `prefill_chunk_size` tokens in total (first come, first served), so a 4k-token prompt costs
   the running requests a few slightly slower steps instead of one long stall; when nothing is
   decoding, every admitted prompt is prefilled at once. A request whose prompt is complete samples
   its first token from the last prefill logits — that token is its output for this step.
3. **Decode**: ONE forward for all rows that were already running before this step: each row feeds
   its last token (left-padded shared length, 2-D mask, explicit position ids, `logits_to_keep=1`)
   against its cached prefix, which is never recomputed. Each request thus gains at most one token
   per step, whether it joined this step or not.
4. **Join / leave**: finished rows leave the KV slab at once; requests prefilled in this step join
   it (right-aligned, copying only their own tokens); all-padding columns are trimmed.

**Decode ahead** (`decode_ahead()`, called by the worker while it waits for the next frame): the
decode forward of step 3 depends only on the rows already in the slab, and no row can join before
the next `step()`, so it can run before that step's frame arrives. Its sampled tokens are kept as
each row's `pending_token` (nothing is appended, finished or emitted yet); the next `step()` uses
them instead of running the forward, and does everything else as usual. A row cancelled in between
drops its pending token with the rest of its state. Per request this is the same forward on the
same cache and the same draw from its own generator, so the output is the same token for token.

Memory budget (`max_batch_tokens`): a request reserves `prompt + max_new_tokens - 1` KV columns
(the most it can ever hold). A request is admitted only if
`(admitted requests + 1) × max(reserved columns over them and it) <= max_batch_tokens`, and the
slab is shaped so that `rows × columns <= max_batch_tokens` — the left-padded batch never needs
more than that. A request that does not fit yet waits (its chunks are empty, not done) until
others finish; a request that could never fit alone was already refused with 400 by
llm_requests. Nothing is sized from free RAM.
"""

from __future__ import annotations

import collections
import math
from dataclasses import dataclass
from enum import IntEnum
from typing import Any

import torch

from handlers.llm_detokenizer import IncrementalDetokenizer, StopStringFilter
from handlers.llm_kv_cache import BatchKVCache, PrefillCache
from handlers.llm_requests import GenerationParams, ParsedRequest, RequestError
from handlers.llm_sampling import make_generator, sample_next_tokens


class SequenceStatus(IntEnum):
    """Lifecycle of one request in the engine; ordered so that "finished" is one comparison."""

    WAITING = 0  # accepted, waiting for KV budget
    PREFILLING = 1  # prompt being prefilled into its own cache (possibly over several steps)
    RUNNING = 2  # a row of the decode batch
    FINISHED_STOPPED = 3  # EOS, a stop token or a stop string
    FINISHED_LENGTH = 4  # max_new_tokens reached
    FINISHED_CANCELLED = 5  # the frontend cancelled it (client gone)

    @property
    def is_finished(self) -> bool:
        return self >= SequenceStatus.FINISHED_STOPPED


FINISH_REASONS: dict[SequenceStatus, str] = {
    SequenceStatus.FINISHED_STOPPED: "stop",
    SequenceStatus.FINISHED_LENGTH: "length",
    SequenceStatus.FINISHED_CANCELLED: "cancelled",
}

_FINISHED = frozenset(FINISH_REASONS)
_TRANSITIONS: dict[SequenceStatus, frozenset[SequenceStatus]] = {
    SequenceStatus.WAITING: frozenset({SequenceStatus.PREFILLING, SequenceStatus.FINISHED_CANCELLED}),
    SequenceStatus.PREFILLING: frozenset({SequenceStatus.RUNNING} | _FINISHED),
    SequenceStatus.RUNNING: _FINISHED,
}


@dataclass(frozen=True, slots=True)
class EngineConfig:
    max_batch_tokens: int  # KV budget in token slots (rows × padded columns), see module docstring
    prefill_chunk_size: int  # max tokens per prefill forward, and per step while others decode
    max_rows_hint: int  # expected concurrent requests (the frontend's batchSize): slab row capacity
    context_length: int  # the model's max positions; bounds the slab's column capacity
    eos_token_ids: frozenset[int]  # tokens that end a request unless it sets ignore_eos


@dataclass(slots=True)
class StepOutput:
    """What one request produced in one step (wire shape: `to_dict()`)."""

    request_id: str
    text: str  # new text this step (complete characters, stop strings cut)
    token_ids: list[int]  # new token ids this step (a final EOS / stop token included)
    finish_reason: str | None  # None while running; "stop" | "length" | "cancelled"
    prompt_tokens: int
    completion_tokens: int  # generated so far, this step's included

    def to_dict(self) -> dict[str, Any]:
        return {
            "text": self.text,
            "token_ids": self.token_ids,
            "finish_reason": self.finish_reason,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
        }


class Sequence:
    """The live, mutable state of one request inside the engine."""

    __slots__ = (
        "detokenizer",
        "generator",
        "num_prefilled",
        "output_ids",
        "params",
        "pending_token",
        "prefill_cache",
        "prompt_ids",
        "request_id",
        "row",
        "status",
        "step_text",
        "step_token_ids",
        "stop_filter",
    )  # fmt: skip

    def __init__(self, request_id: str, parsed: ParsedRequest, tokenizer: Any, device: torch.device) -> None:
        self.request_id = request_id
        self.prompt_ids = parsed.prompt_ids
        self.params: GenerationParams = parsed.params
        self.status = SequenceStatus.WAITING
        self.output_ids: list[int] = []
        self.num_prefilled = 0
        self.prefill_cache: PrefillCache | None = None
        self.generator = None if self.params.greedy else make_generator(self.params.seed, device)
        self.detokenizer = IncrementalDetokenizer(tokenizer, self.prompt_ids)
        self.stop_filter = StopStringFilter(self.params.stop)
        self.row = -1  # index in the decode batch while RUNNING
        self.pending_token: int | None = None  # sampled by decode_ahead(), applied by the next step()
        self.step_text: list[str] = []
        self.step_token_ids: list[int] = []

    @property
    def reserved_columns(self) -> int:
        """The most KV columns this request can ever hold: the prompt and all but the last new token."""
        return len(self.prompt_ids) + self.params.max_new_tokens - 1

    def take_output(self) -> StepOutput:
        output = StepOutput(
            request_id=self.request_id,
            text="".join(self.step_text),
            token_ids=self.step_token_ids,
            finish_reason=FINISH_REASONS.get(self.status),
            prompt_tokens=len(self.prompt_ids),
            completion_tokens=len(self.output_ids),
        )
        self.step_text, self.step_token_ids = [], []
        return output


class LLMEngine:
    """Owns the model, the decode batch and every live request of one worker."""

    def __init__(self, model: Any, tokenizer: Any, config: EngineConfig) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.config = config
        self.device = model.device
        self.num_layers = model.config.get_text_config().num_hidden_layers
        self._sequences: dict[str, Sequence] = {}  # every live request, by id
        self._waiting: collections.deque[Sequence] = collections.deque()
        self._prefilling: list[Sequence] = []  # arrival order
        self._rows: list[Sequence] = []  # the decode batch, aligned with the slab's rows
        self._batch = BatchKVCache(self.num_layers)
        # True between decode_ahead() and the next step(): every row then holds its pending_token
        # and its KV column for it is written (rows only leave in between; none can join).
        self._decoded_ahead = False

    # ---- observability ----------------------------------------------------------------------------
    @property
    def num_active_requests(self) -> int:
        """Live requests: waiting, prefilling or decoding."""
        return len(self._sequences)

    @property
    def num_running_requests(self) -> int:
        return len(self._rows)

    @property
    def num_waiting_requests(self) -> int:
        """Accepted but waiting for KV budget."""
        return len(self._waiting)

    @property
    def num_prefilling_requests(self) -> int:
        return len(self._prefilling)

    @property
    def kv_cache_tokens(self) -> int:
        """Real tokens held in KV caches (decode batch + partial prefills), padding excluded."""
        return self._batch.num_tokens + sum(seq.num_prefilled for seq in self._prefilling)

    @property
    def kv_cache_capacity(self) -> int:
        """Token slots currently allocated for the decode batch (always <= max_batch_tokens)."""
        return self._batch.num_cells

    @property
    def decoded_ahead(self) -> bool:
        """Whether the next step's decode forward already ran (its tokens are pending)."""
        return self._decoded_ahead

    @property
    def batch_cache(self) -> BatchKVCache:
        return self._batch

    def has_request(self, request_id: str) -> bool:
        return request_id in self._sequences

    def request_ids(self) -> list[str]:
        return list(self._sequences)

    # ---- lifecycle --------------------------------------------------------------------------------
    def add_request(self, request_id: str, parsed: ParsedRequest) -> None:
        if request_id in self._sequences:
            raise RequestError(f"request id {request_id!r} is already being generated")
        seq = Sequence(request_id, parsed, self.tokenizer, self.device)
        self._sequences[request_id] = seq
        self._waiting.append(seq)

    def cancel(self, request_id: str) -> StepOutput | None:
        """Stop a request now and free its cache; its final output (or None if unknown)."""
        seq = self._sequences.get(request_id)
        if seq is None:
            return None
        if seq.status is SequenceStatus.WAITING:
            self._waiting.remove(seq)
        elif seq.status is SequenceStatus.PREFILLING:
            self._prefilling.remove(seq)
        self._finish(seq, SequenceStatus.FINISHED_CANCELLED)
        seq.pending_token = None  # a token decoded ahead for it is never emitted
        with torch.inference_mode():  # the slab holds inference tensors
            self._leave_batch([seq])
            self._release_if_idle()
        del self._sequences[request_id]
        return seq.take_output()

    def abort_all(self) -> None:
        """Forget every request and the whole cache (after a failed forward: state is unknown)."""
        self._sequences.clear()
        self._waiting.clear()
        self._prefilling.clear()
        self._rows.clear()
        self._batch = BatchKVCache(self.num_layers)
        self._decoded_ahead = False

    def decode_ahead(self) -> bool:
        """Run the next step's decode forward and sampling now (see the module docstring); False if
        there is nothing to decode or it already ran. After a raise the batch's state is unknown
        (the slab may have advanced): the caller must `abort_all()`, as after a failed step."""
        if self._decoded_ahead or not self._rows:
            return False
        with torch.inference_mode():
            tokens = self._decode_forward()
        for seq, token in zip(self._rows, tokens):
            seq.pending_token = token
        self._decoded_ahead = True
        return True

    def step(self) -> dict[str, StepOutput]:
        """One scheduler iteration: one output per live request; a finished one carries its finish_reason
        and is forgotten."""
        with torch.inference_mode():
            self._admit()
            ready = self._prefill()
            self._decode()
            self._leave_batch([seq for seq in self._rows if seq.status.is_finished])
            self._join_batch([seq for seq in ready if not seq.status.is_finished])
            self._release_if_idle()
        outputs = {request_id: seq.take_output() for request_id, seq in self._sequences.items()}
        for request_id, output in outputs.items():
            if output.finish_reason is not None:
                del self._sequences[request_id]
        return outputs

    # ---- the four phases ---------------------------------------------------------------------------
    def _admit(self) -> None:
        admitted = self._rows + self._prefilling
        num_rows = len(admitted)
        columns = max((seq.reserved_columns for seq in admitted), default=0)
        while self._waiting:
            seq = self._waiting[0]
            needed = max(columns, seq.reserved_columns)
            if (num_rows + 1) * needed > self.config.max_batch_tokens:
                break  # first come, first served: later requests do not overtake
            self._waiting.popleft()
            num_rows, columns = num_rows + 1, needed
            seq.prefill_cache = PrefillCache(self.num_layers, len(seq.prompt_ids))
            self._transition(seq, SequenceStatus.PREFILLING)
            self._prefilling.append(seq)

    def _prefill(self) -> list[Sequence]:
        """Advance prompt prefills; return the requests whose prompt completed (first token sampled)."""
        budget = self.config.prefill_chunk_size if self._rows else math.inf
        ready: list[Sequence] = []
        for seq in list(self._prefilling):
            if budget <= 0:
                break
            num_prompt = len(seq.prompt_ids)
            logits = None
            while seq.num_prefilled < num_prompt and budget > 0:
                size = int(min(self.config.prefill_chunk_size, num_prompt - seq.num_prefilled, budget))
                logits = self._prefill_chunk(seq, size)
                budget -= size
            if seq.num_prefilled < num_prompt:
                continue
            self._prefilling.remove(seq)
            ready.append(seq)
            token = sample_next_tokens(logits, [seq.params], [seq.generator])[0]
            self._append_token(seq, token)
        return ready

    def _prefill_chunk(self, seq: Sequence, size: int) -> torch.Tensor:
        begin = seq.num_prefilled
        input_ids = torch.tensor([seq.prompt_ids[begin : begin + size]], dtype=torch.long, device=self.device)
        position_ids = torch.arange(begin, begin + size, device=self.device)[None, :]
        out = self.model(
            input_ids=input_ids, position_ids=position_ids, cache=seq.prefill_cache, use_cache=True, logits_to_keep=1
        )
        seq.prefill_cache.advance(size)
        seq.num_prefilled += size
        return out.logits[:, -1, :].float()

    def _decode(self) -> None:
        rows = self._rows
        ahead, self._decoded_ahead = self._decoded_ahead, False
        if not rows:
            return
        if ahead:
            tokens = [seq.pending_token for seq in rows]
            if None in tokens:  # only step() adds rows, so this is a bug, not an input error
                raise RuntimeError("a row of the decode batch has no token decoded ahead")
        else:
            tokens = self._decode_forward()
        for seq, token in zip(rows, tokens):
            seq.pending_token = None
            self._append_token(seq, token)

    def _decode_forward(self) -> list[int]:
        """One forward for every row (one new KV column each) and the next token of each row."""
        rows = self._rows
        self._batch.ensure_decode_room()
        attention_mask, position_ids = self._batch.decode_inputs(self.device)
        input_ids = torch.tensor([[seq.output_ids[-1]] for seq in rows], dtype=torch.long, device=self.device)
        out = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=self._batch,
            use_cache=True,
            logits_to_keep=1,
        )
        self._batch.advance(1)
        return sample_next_tokens(
            out.logits[:, -1, :].float(), [seq.params for seq in rows], [seq.generator for seq in rows]
        )

    def _leave_batch(self, leaving: list[Sequence]) -> None:
        """Remove rows from the slab (highest index first, so a moved row is never a leaving one)."""
        for seq in sorted((s for s in leaving if s.row >= 0), key=lambda s: s.row, reverse=True):
            moved_from = self._batch.remove_row(seq.row)
            if moved_from is not None:
                moved = self._rows[moved_from]
                self._rows[seq.row] = moved
                moved.row = seq.row
            self._rows.pop()
            seq.row = -1

    def _release_if_idle(self) -> None:
        if not self._rows and self._batch.row_capacity:
            self._batch.release()  # idle: give the slab's memory back

    def _join_batch(self, joining: list[Sequence]) -> None:
        if not joining:
            return
        num_rows = len(self._rows) + len(joining)
        columns = max(seq.reserved_columns for seq in self._rows + joining)
        if not self._batch.fits(num_rows, columns):
            self._batch.reshape(*self._slab_shape(num_rows, columns), like=joining[0].prefill_cache)
        for seq in joining:
            seq.row = self._batch.add_row(seq.prefill_cache)
            seq.prefill_cache = None  # its tokens now live in the slab
            self._rows.append(seq)
            self._transition(seq, SequenceStatus.RUNNING)

    def _slab_shape(self, num_rows: int, columns: int) -> tuple[int, int]:
        """Rows × columns within the budget: room for the expected batch, and spare columns so the
        window is compacted rarely. Admission guarantees `num_rows × columns <= max_batch_tokens`."""
        budget = self.config.max_batch_tokens
        row_capacity = max(num_rows, min(self.config.max_rows_hint, budget // columns))
        col_capacity = max(columns, min(budget // row_capacity, 2 * self.config.context_length))
        return row_capacity, col_capacity

    # ---- per-token bookkeeping ----------------------------------------------------------------------
    def _append_token(self, seq: Sequence, token: int) -> None:
        seq.output_ids.append(token)
        seq.step_token_ids.append(token)
        params = seq.params
        if (token in self.config.eos_token_ids and not params.ignore_eos) or token in params.stop_token_ids:
            # The stop token's own text is never emitted; what was held back is.
            self._emit(seq, seq.detokenizer.flush(), final=True)
            self._finish(seq, SequenceStatus.FINISHED_STOPPED)
            return
        self._emit(seq, seq.detokenizer.push([token]), final=False)
        if seq.stop_filter.stopped:
            self._finish(seq, SequenceStatus.FINISHED_STOPPED)
        elif len(seq.output_ids) >= params.max_new_tokens:
            self._emit(seq, seq.detokenizer.flush(), final=True)
            reached_stop = seq.stop_filter.stopped
            self._finish(seq, SequenceStatus.FINISHED_STOPPED if reached_stop else SequenceStatus.FINISHED_LENGTH)

    def _emit(self, seq: Sequence, text: str, *, final: bool) -> None:
        out = seq.stop_filter.push(text)
        if final:
            out += seq.stop_filter.flush()
        if out:
            seq.step_text.append(out)

    def _finish(self, seq: Sequence, status: SequenceStatus) -> None:
        self._transition(seq, status)
        seq.prefill_cache = None

    @staticmethod
    def _transition(seq: Sequence, new: SequenceStatus) -> None:
        if new not in _TRANSITIONS.get(seq.status, frozenset()):
            raise RuntimeError(f"request {seq.request_id!r}: illegal transition {seq.status.name} -> {new.name}")
        seq.status = new
