"""Built-in `text_generation` handler: continuous decode for any Hugging Face causal LM on disk.

The worker calls `initialize(context)` once, `handle(data, context)` once per INFER frame and
`cancel(request_ids)` when the frontend cancels requests. One `handle()` call is one engine step
(see llm_engine.py): new requests of the frame are validated and queued, then the engine prefills,
decodes one token for every running request in one forward pass, and frees finished ones.

Contract per frame (docs/llm.md has the full reference):
- `data[idx]` is `{"body": <JSON object | str | bytes>}`; `context.request_ids[idx]` names it;
  `context.is_new_request(idx)` is True on its first frame only. Every unfinished request is in
  every frame; a live request missing from a frame without a cancel is freed (and logged).
- The result for each idx is a dict `{"text", "token_ids", "finish_reason", "prompt_tokens",
  "completion_tokens"}` and `context.set_done(idx, finish_reason is not None)`. An invalid
  request gets status 400 and `{"error": message}`, done; the others are unaffected.
- Without `continuousBatching: true` in model-config.yaml the frontend sends each request once
  (dynamic batching): one `handle()` call then runs its frame's requests to the end (static
  batching), streaming every step's chunks as intermediate replies; new requests wait for the next
  frame.
- `step_ahead()` (optional worker hook, docs/handlers.md): the worker calls it after sending a
  continuous frame's reply when the next frame is not there yet; it runs the next step's decode
  forward in that idle time (`LLMEngine.decode_ahead`), and the next `handle()` uses its tokens.
- A request carrying the header `x-conveyor-llm-stats` gets the engine's load after the step in the
  response header of the same name (`kv_tokens=..;kv_capacity=..;running=..;waiting=..`): the OpenAI
  routes read it for the KV-cache and queue gauges (it never reaches their clients).
"""

from __future__ import annotations

import collections
import logging
import os
from dataclasses import dataclass
from typing import Any

import torch

from backend.handler_utils import send_intermediate_predict_response
from handlers.llm_engine import EngineConfig, LLMEngine, StepOutput
from handlers.llm_requests import (
    DEFAULT_MAX_NEW_TOKENS,
    ParsedRequest,
    RequestError,
    RequestLimits,
    body_of,
    parse_request,
)

logger = logging.getLogger(__name__)

CONFIG_FILE = "model-config.yaml"
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_RECENTLY_CANCELLED = 4096  # ids remembered so a late frame still gets finish_reason "cancelled"
DEFAULT_MAX_BATCH_TOKENS = 16384
DEFAULT_PREFILL_CHUNK_SIZE = 256
# Request header that asks for the engine's load with every chunk, and the response header carrying it.
STATS_HEADER = "x-conveyor-llm-stats"


@dataclass(frozen=True, slots=True)
class HandlerConfig:
    """The `handler:` section of model-config.yaml, validated once at initialize."""

    model_path: str  # absolute: the checkpoint directory
    dtype: torch.dtype = torch.float32
    max_batch_tokens: int = DEFAULT_MAX_BATCH_TOKENS
    prefill_chunk_size: int = DEFAULT_PREFILL_CHUNK_SIZE
    max_new_tokens: int | None = None  # server default; else generation_config's, else 256
    num_threads: int = 1  # torch intra-op threads; 0 = torch's default
    attn_implementation: str | None = None  # e.g. "sdpa" (transformers' default) or "eager"
    trust_remote_code: bool = False

    @classmethod
    def from_context(cls, context: Any) -> HandlerConfig:
        model_dir = (context.system_properties or {}).get("model_dir") or "."
        section = (context.model_yaml_config or {}).get("handler") or {}
        if not isinstance(section, dict):
            raise ValueError(f"{CONFIG_FILE}: 'handler' must be a mapping, got {type(section).__name__}")
        known = {"model_path", "dtype", "max_batch_tokens", "prefill_chunk_size", "max_new_tokens",
                 "num_threads", "attn_implementation", "trust_remote_code"}  # fmt: skip
        unknown = sorted(set(section) - known)
        if unknown:
            raise ValueError(f"{CONFIG_FILE}: unknown key(s) handler.{', handler.'.join(unknown)}; known: {sorted(known)}")
        model_path = section.get("model_path") or "."
        if not isinstance(model_path, str):
            raise ValueError(f"{CONFIG_FILE}: handler.model_path must be a string, got {model_path!r}")
        dtype_name = section.get("dtype", "float32")
        if dtype_name not in _DTYPES:
            raise ValueError(f"{CONFIG_FILE}: handler.dtype must be one of {sorted(_DTYPES)}, got {dtype_name!r}")
        attn = section.get("attn_implementation")
        if attn is not None and not isinstance(attn, str):
            raise ValueError(f"{CONFIG_FILE}: handler.attn_implementation must be a string, got {attn!r}")
        trust = section.get("trust_remote_code", False)
        if not isinstance(trust, bool):
            raise ValueError(f"{CONFIG_FILE}: handler.trust_remote_code must be true or false, got {trust!r}")
        return cls(
            model_path=os.path.normpath(os.path.join(model_dir, model_path)),
            dtype=_DTYPES[dtype_name],
            max_batch_tokens=_positive_int(section, "max_batch_tokens", DEFAULT_MAX_BATCH_TOKENS),
            prefill_chunk_size=_positive_int(section, "prefill_chunk_size", DEFAULT_PREFILL_CHUNK_SIZE),
            max_new_tokens=_positive_int(section, "max_new_tokens", None),
            num_threads=_positive_int(section, "num_threads", 1, allow_zero=True),
            attn_implementation=attn,
            trust_remote_code=trust,
        )


def _positive_int(section: dict, key: str, default: int | None, allow_zero: bool = False) -> int | None:
    value = section.get(key, default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < (0 if allow_zero else 1):
        bound = ">= 0" if allow_zero else ">= 1"
        raise ValueError(f"{CONFIG_FILE}: handler.{key} must be an integer {bound}, got {value!r}")
    return value


class TextGenerationHandler:
    """Continuous-decode text generation; one instance per worker process."""

    def __init__(self) -> None:
        self.initialized = False
        self.config: HandlerConfig | None = None
        self.model: Any = None
        self.tokenizer: Any = None
        self.engine: LLMEngine | None = None
        self.limits: RequestLimits | None = None
        self._recently_cancelled: collections.OrderedDict[str, None] = collections.OrderedDict()
        # Set when step_ahead()'s forward raised: the next step fails the way a failing step does.
        self._ahead_failed = False

    # ---- lifecycle ----------------------------------------------------------------------------------
    def initialize(self, context: Any) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        config = HandlerConfig.from_context(context)
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        device = _device(context)
        tokenizer = AutoTokenizer.from_pretrained(config.model_path, trust_remote_code=config.trust_remote_code)
        kwargs: dict[str, Any] = {"dtype": config.dtype, "trust_remote_code": config.trust_remote_code}
        if config.attn_implementation:
            kwargs["attn_implementation"] = config.attn_implementation
        model = AutoModelForCausalLM.from_pretrained(config.model_path, **kwargs).to(device).eval()
        self.setup(model, tokenizer, config, max_rows_hint=_batch_size(context))
        logger.info(
            "text_generation: loaded %s (%s, %s) context %d, max_batch_tokens %d, prefill_chunk_size %d",
            config.model_path, type(model).__name__, config.dtype, self.limits.context_length,
            config.max_batch_tokens, config.prefill_chunk_size,
        )  # fmt: skip

    def setup(self, model: Any, tokenizer: Any, config: HandlerConfig, max_rows_hint: int = 8) -> None:
        """Wire an already loaded model and tokenizer (initialize() does the loading)."""
        _check_supported(model)
        text_config = model.config.get_text_config()
        context_length = _context_length(text_config, tokenizer)
        generation_config = getattr(model, "generation_config", None)
        default_max_new = config.max_new_tokens or getattr(generation_config, "max_new_tokens", None)
        self.config, self.model, self.tokenizer = config, model, tokenizer
        self.limits = RequestLimits(
            context_length=context_length,
            max_batch_tokens=config.max_batch_tokens,
            default_max_new_tokens=default_max_new or DEFAULT_MAX_NEW_TOKENS,
            vocab_size=text_config.vocab_size,
        )
        self.engine = LLMEngine(
            model,
            tokenizer,
            EngineConfig(
                max_batch_tokens=config.max_batch_tokens,
                prefill_chunk_size=config.prefill_chunk_size,
                max_rows_hint=max_rows_hint,
                context_length=context_length,
                eos_token_ids=_eos_token_ids(generation_config, tokenizer, text_config),
            ),
        )
        self.initialized = True

    # ---- per frame -----------------------------------------------------------------------------------
    def handle(self, data: list[Any], context: Any) -> list[dict[str, Any]]:
        engine = self._engine()
        cancelled_now = {str(request_id) for request_id in context.cancelled_request_ids or ()}
        self.cancel(sorted(cancelled_now))
        results, frame = self._take_frame(data, context, cancelled_now)
        if not _continuous(context):
            return self._run_to_completion(results, frame, context)
        for request_id in engine.request_ids():
            if request_id not in frame:
                logger.warning("request %s is live but absent from the frame without a cancel: freeing it", request_id)
                engine.cancel(request_id)
        outputs = self._step(results, frame, context)
        if outputs is None:
            return results  # type: ignore[return-value]
        stats = self._stats()
        for request_id, idx in frame.items():
            results[idx] = self._finish(context, idx, outputs[request_id], stats)
        return results  # type: ignore[return-value]

    def _take_frame(
        self, data: list[Any], context: Any, cancelled_now: set[str]
    ) -> tuple[list[dict[str, Any] | None], dict[str, int]]:
        """Queue the frame's new requests; answer at once the ones that cannot run (errors, cancelled).
        Returns the results so far (None = to be filled by the step) and {request id: idx} to step."""
        engine = self._engine()
        results: list[dict[str, Any] | None] = [None] * len(data)
        frame: dict[str, int] = {}
        for idx, item in enumerate(data):
            request_id = str(context.request_ids[idx])
            if request_id in cancelled_now:
                results[idx] = self._finish(context, idx, _cancelled(request_id))
                continue
            if context.is_new_request(idx):
                try:
                    if request_id in frame:
                        raise RequestError(f"request id {request_id!r} appears twice in one frame")
                    parsed = self.parse(body_of(item))
                    if engine.has_request(request_id):  # a NEW for a live id restarts it (as the worker does)
                        logger.warning("request %s sent as NEW while live: restarting it", request_id)
                        engine.cancel(request_id)
                    engine.add_request(request_id, parsed)
                except RequestError as exc:
                    results[idx] = self._error(context, idx, exc.status, exc.message)
                    continue
                except Exception:  # a tokenizer or template crash must not take the batch down
                    logger.exception("request %s: could not prepare the prompt", request_id)
                    results[idx] = self._error(context, idx, 500, "could not prepare the prompt")
                    continue
            elif not engine.has_request(request_id):
                if request_id in self._recently_cancelled:
                    results[idx] = self._finish(context, idx, _cancelled(request_id))
                else:
                    results[idx] = self._error(context, idx, 500, f"request {request_id!r} is not active in this worker")
                continue
            frame[request_id] = idx
        return results, frame

    def step_ahead(self) -> None:
        """Worker hook, between two continuous frames when the next one has not arrived: run the next
        step's decode forward now (`LLMEngine.decode_ahead`); the next `handle()` applies its tokens
        after that frame's cancels and prefills. A failure is not raised here (there is no frame to
        answer): the next step fails with it, exactly as if its own decode forward had raised."""
        engine = self._engine()
        if self._ahead_failed:
            return
        try:
            engine.decode_ahead()
        except Exception:
            logger.exception("text_generation decode-ahead failed; the next step fails its requests")
            self._ahead_failed = True

    def _step(
        self, results: list[dict[str, Any] | None], frame: dict[str, int], context: Any
    ) -> dict[str, StepOutput] | None:
        """One engine step; on failure every request of the frame gets 500 and None is returned."""
        engine = self._engine()
        ahead_failed, self._ahead_failed = self._ahead_failed, False
        # If every row it decoded was cancelled since, the failure reached no one: the slab went with them.
        if ahead_failed and engine.num_running_requests:
            logger.error("text_generation step failed: its decode forward, run ahead, raised (traceback above); "
                         "aborting all %d requests", engine.num_active_requests)
        else:
            try:
                return engine.step()
            except Exception:
                logger.exception("text_generation step failed; aborting all %d requests", engine.num_active_requests)
        engine.abort_all()
        for idx in frame.values():
            results[idx] = self._error(context, idx, 500, "generation failed in the model worker")
        return None

    def _run_to_completion(
        self, results: list[dict[str, Any] | None], frame: dict[str, int], context: Any
    ) -> list[dict[str, Any]]:
        """Static batching (continuousBatching off): the frontend sends each request once, so this
        frame's requests run here until the last one ends; nothing joins meanwhile. Each step's
        chunks go out as an intermediate reply; a request's final chunk is the frame's return value
        (its stream ends when the batch does, which is what request-level batching costs)."""
        running = dict(frame)
        finals: dict[int, StepOutput] = {}
        sender = getattr(context, "intermediate_sender", None)
        while running:
            outputs = self._step(results, running, context)
            if outputs is None:
                return results  # type: ignore[return-value]
            stats = self._stats()
            partial: list[dict[str, Any] | None] = [None] * len(results)
            to_send: dict[int, str] = {}
            for request_id, idx in list(running.items()):
                output = outputs[request_id]
                if output.finish_reason is not None:
                    finals[idx] = output
                    del running[request_id]
                elif output.token_ids or output.text:  # skip the empty chunks of a wait or a chunked prefill
                    partial[idx] = self._finish(context, idx, output, stats)
                    to_send[idx] = request_id
            if to_send and running and sender is not None:
                send_intermediate_predict_response(partial, to_send, "", 200, context)
        stats = self._stats()
        for idx, output in finals.items():
            results[idx] = self._finish(context, idx, output, stats)
        return results  # type: ignore[return-value]

    def cancel(self, request_ids: list[str]) -> dict[str, dict[str, Any]]:
        """Stop these requests and free their caches now; returns their final chunks by id."""
        engine = self._engine()
        finals = {}
        for request_id in request_ids:
            request_id = str(request_id)
            output = engine.cancel(request_id)
            self._recently_cancelled[request_id] = None
            while len(self._recently_cancelled) > _RECENTLY_CANCELLED:
                self._recently_cancelled.popitem(last=False)
            if output is not None:
                finals[request_id] = output.to_dict()
                # One line per cancelled stream: operators (and tests) see that the state went at once.
                logger.info("request %s cancelled: its state is freed (%d live requests, %d KV tokens held)",
                            request_id, engine.num_active_requests, engine.kv_cache_tokens)
        return finals

    def parse(self, body: Any) -> ParsedRequest:
        """Validate one request body against this model's limits (raises RequestError)."""
        return parse_request(body, self.tokenizer, self.limits)

    # ---- metrics -------------------------------------------------------------------------------------
    @property
    def num_active_requests(self) -> int:
        return self._engine().num_active_requests

    @property
    def kv_cache_tokens(self) -> int:
        return self._engine().kv_cache_tokens

    @property
    def kv_cache_capacity(self) -> int:
        return self._engine().kv_cache_capacity

    # ---- helpers -------------------------------------------------------------------------------------
    def _engine(self) -> LLMEngine:
        if self.engine is None:
            raise RuntimeError("TextGenerationHandler used before initialize()")
        return self.engine

    def _stats(self) -> str:
        """The engine's load after this step, in the STATS_HEADER format."""
        engine = self._engine()
        return (f"kv_tokens={engine.kv_cache_tokens};kv_capacity={engine.config.max_batch_tokens};"
                f"running={engine.num_running_requests + engine.num_prefilling_requests};"
                f"waiting={engine.num_waiting_requests}")

    @staticmethod
    def _finish(context: Any, idx: int, output: StepOutput, stats: str | None = None) -> dict[str, Any]:
        context.set_response_content_type(idx, "application/json")
        context.set_done(idx, output.finish_reason is not None)
        if stats is not None and context.get_request_header(idx, STATS_HEADER) is not None:
            context.set_response_header(idx, STATS_HEADER, stats)
        return output.to_dict()

    @staticmethod
    def _error(context: Any, idx: int, status: int, message: str) -> dict[str, Any]:
        context.set_response_status(status, message, idx)
        context.set_response_content_type(idx, "application/json")
        context.set_done(idx, True)
        return {"error": message}


def _cancelled(request_id: str) -> StepOutput:
    return StepOutput(request_id, "", [], "cancelled", 0, 0)


def _continuous(context: Any) -> bool:
    """Whether the frontend runs this model with continuous batching (model-config.yaml)."""
    value = (getattr(context, "model_yaml_config", None) or {}).get("continuousBatching", False)
    return value.strip().lower() == "true" if isinstance(value, str) else bool(value)


def _device(context: Any) -> torch.device:
    gpu_id = (context.system_properties or {}).get("gpu_id")
    if isinstance(gpu_id, int) and gpu_id >= 0 and torch.cuda.is_available():  # None or -1: CPU
        return torch.device(f"cuda:{int(gpu_id)}")
    return torch.device("cpu")


def _batch_size(context: Any) -> int:
    value = (context.system_properties or {}).get("batch_size")
    return value if isinstance(value, int) and value > 0 else 8


def _check_supported(model: Any) -> None:
    text_config = model.config.get_text_config()
    if getattr(text_config, "is_encoder_decoder", False):
        raise ValueError("text_generation serves decoder-only causal LMs; this model is encoder-decoder")
    layer_types = getattr(text_config, "layer_types", None) or []
    odd = sorted({t for t in layer_types if t not in ("full_attention", "sliding_attention")})
    if odd:
        raise ValueError(f"text_generation supports attention layers only; this model has layer types {odd}")


def _context_length(text_config: Any, tokenizer: Any) -> int:
    lengths = [getattr(text_config, "max_position_embeddings", None)]
    model_max = getattr(tokenizer, "model_max_length", None)
    if isinstance(model_max, int) and model_max < 10**8:  # tokenizers use 1e30 for "unset"
        lengths.append(model_max)
    lengths = [n for n in lengths if isinstance(n, int) and n > 0]
    if not lengths:
        raise ValueError("cannot tell the model's context length: set max_position_embeddings in config.json")
    return min(lengths)


def _eos_token_ids(generation_config: Any, tokenizer: Any, text_config: Any) -> frozenset[int]:
    for source in (generation_config, text_config):
        eos = getattr(source, "eos_token_id", None)
        if eos is not None:
            return frozenset([eos] if isinstance(eos, int) else eos)
    eos = getattr(tokenizer, "eos_token_id", None)
    return frozenset() if eos is None else frozenset([eos])
