"""The LLM load each worker reports with its chunks, kept for the scrape-time gauges.

The text_generation handler knows its KV-cache use and its queue; the frontend does not. A request
carrying the header ``x-conveyor-llm-stats`` gets, in the response header of the same name on every
chunk, the engine's state after that step: ``kv_tokens=N;kv_capacity=M;running=R;waiting=W`` (no
protocol change: an ordinary result header). The OpenAI routes ask for it and record it here by
(model, version, worker); the value never reaches the client, since those routes build their own
responses. At scrape time the latest report of each worker is summed per model, with one rule that
keeps the gauges true after a cancel (a CANCEL-only frame has no result to report with): a worker
whose aggregator holds no job holds no request state either — the frontend CONTINUEs or CANCELs every
unfinished request, and the handler frees a request on its CANCEL — so it counts as empty.
"""

from __future__ import annotations

from dataclasses import dataclass
from collections.abc import Iterator

from backend.protocol import WireResult
from frontend.metrics import LLMSample
from frontend.models import ModelRegistry

STATS_HEADER = "x-conveyor-llm-stats"  # the name handlers/text_generation.py answers to (STATS_HEADER)
TEXT_GENERATION = "text_generation"  # the built-in handler: listed in the gauges before its first report


@dataclass(frozen=True, slots=True)
class WorkerLoad:
    kv_tokens: int  # KV slots holding real tokens
    kv_capacity: int  # the KV budget (max_batch_tokens)
    running: int  # prefilling or decoding
    waiting: int  # accepted by the handler, waiting for KV budget

    @classmethod
    def parse(cls, value: str) -> WorkerLoad | None:
        fields: dict[str, int] = {}
        for part in value.split(";"):
            key, _, number = part.partition("=")
            if number.strip().isdigit():
                fields[key.strip()] = int(number)
        try:
            return cls(fields["kv_tokens"], fields["kv_capacity"], fields["running"], fields["waiting"])
        except KeyError:
            return None


class LLMLoad:
    """Latest WorkerLoad per (model, version, worker id); a sampler for ServerMetrics.watch_llm."""

    def __init__(self, registry: ModelRegistry) -> None:
        self.registry = registry
        # The raw header value per worker: parsed at scrape time, not once per chunk.
        self._reports: dict[tuple[str, str, str], str] = {}

    def observe(self, model: str, version: str, worker_id: str | None, result: WireResult) -> None:
        if worker_id is None:
            return
        for name, value in result.headers:
            if name == STATS_HEADER or name.lower() == STATS_HEADER:
                self._reports[(model, version, worker_id)] = value
                return

    def sample(self) -> Iterator[LLMSample]:
        """One sample per model name (versions summed, as vLLM labels by model name only)."""
        seen: set[tuple[str, str, str]] = set()
        totals: dict[str, list[int]] = {}  # name → [running, waiting, kv tokens, kv capacity]
        for model in self.registry.all_versions():
            workers = model.batcher.stats()
            reported = [key for key in ((model.name, model.version, w) for w in workers) if key in self._reports]
            if not reported and model.archive.handler != TEXT_GENERATION:
                continue  # not an LLM as far as we know
            total = totals.setdefault(model.name, [0, 0, 0, 0])
            total[1] += model.batcher.queue_depth
            for key in reported:
                seen.add(key)
                load = WorkerLoad.parse(self._reports[key])
                if load is None:
                    continue
                total[3] += load.kv_capacity
                if workers[key[2]]["num_active"] == 0:
                    continue  # idle worker: nothing held (module docstring)
                total[0] += load.running
                total[1] += load.waiting
                total[2] += load.kv_tokens
        for key in set(self._reports) - seen:  # workers gone (replaced, scaled down, unregistered)
            del self._reports[key]
        for name, (running, waiting, kv_tokens, kv_capacity) in totals.items():
            yield name, running, waiting, kv_tokens, kv_capacity
