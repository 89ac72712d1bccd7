"""In-process decode throughput: sequential `generate`, static padded `generate` batches, the
`text_generation` handler's static batching and its continuous loop — same requests, same model,
no server.

    python benchmarks/llm_inprocess.py                       # tiny and 27 M models, built into a temp dir
    python benchmarks/llm_inprocess.py --models tiny --requests 32
    python benchmarks/llm_inprocess.py --model-dir /path/to/checkpoint

Workload (issue 6): a closed loop of `--streams` (16) clients; each sends its next request when
its previous one ends; `max_new_tokens` drawn uniformly from 8–128 and prompt lengths from 6–320
tokens with a fixed seed. Every mode generates exactly the requested tokens (EOS is ignored), so
tokens/s compare like for like. Static batching takes the same requests in groups of `--streams`
and counts only the tokens each request asked for (a padded row keeps decoding until its group's
longest request ends: that is static batching's cost). "static (handler)" is the handler's own
static batching (`continuousBatching: false`: each group of `--streams` requests is one frame run to
its end inside `handle()`, finished rows leaving the batch at once) — the baseline the served
benchmark's "conveyor static" runs, here without a server. Not a timed test: numbers depend on the
machine; run with nothing else busy. Uses one torch thread, like the worker.

The continuous loop also reports where its time goes: the share of prompt prefill (forwards into a
`PrefillCache`) and a least-squares fit of each step's remaining time against its decode rows,
`a + b × rows` (`a`: what a step costs whatever its rows — the model's per-call overhead and ours;
`b`: the cost of one more row). llm_throughput.py turns these into the expected continuous/static.
"""

from __future__ import annotations

import argparse
import heapq
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "examples" / "tiny_llm"))

from backend.context import Context, RequestEntry  # noqa: E402
from handlers.llm_kv_cache import PrefillCache  # noqa: E402
from handlers.text_generation import TextGenerationHandler  # noqa: E402

MODELS = {"tiny": dict(hidden=64, layers=2, heads=4, kv_heads=2), "27m": dict(hidden=512, layers=8, heads=8)}


@dataclass(frozen=True)
class Job:
    prompt: str
    num_prompt: int
    max_new_tokens: int


def make_jobs(tokenizer, count: int, seed: int) -> list[Job]:
    corpus = (REPO / "examples" / "tiny_llm" / "corpus.txt").read_text()
    corpus_ids = tokenizer(corpus, add_special_tokens=False, verbose=False)["input_ids"]
    rng = random.Random(seed)
    jobs = []
    for _ in range(count):
        length = rng.randint(6, 320) - 1  # BOS is added on encoding
        start = rng.randrange(0, len(corpus_ids) - length)
        prompt = tokenizer.decode(corpus_ids[start : start + length])
        jobs.append(Job(prompt, len(tokenizer(prompt)["input_ids"]), rng.randint(8, 128)))
    return jobs


def run_sequential(model, tokenizer, jobs: list[Job]) -> float:
    start = time.perf_counter()
    with torch.inference_mode():
        for job in jobs:
            enc = tokenizer(job.prompt, return_tensors="pt")
            out = model.generate(**enc, do_sample=False, max_new_tokens=job.max_new_tokens, min_new_tokens=job.max_new_tokens,
                                 pad_token_id=tokenizer.pad_token_id)  # fmt: skip
            assert out.shape[1] - enc["input_ids"].shape[1] == job.max_new_tokens
    return time.perf_counter() - start


def run_static(model, tokenizer, jobs: list[Job], batch: int) -> float:
    tokenizer.padding_side = "left"
    start = time.perf_counter()
    with torch.inference_mode():
        for i in range(0, len(jobs), batch):
            group = jobs[i : i + batch]
            enc = tokenizer([j.prompt for j in group], return_tensors="pt", padding=True)
            longest = max(j.max_new_tokens for j in group)
            model.generate(**enc, do_sample=False, max_new_tokens=longest, min_new_tokens=longest,
                           pad_token_id=tokenizer.pad_token_id)  # fmt: skip
    return time.perf_counter() - start


@dataclass
class LoopStats:
    seconds: float
    num_steps: int
    forward_seconds: float
    ttft: list[float]
    prefill_seconds: float = 0.0  # model forwards over prompts (into a PrefillCache)
    # Per step: (rows in its decode forward, the step's time minus its prefill forwards).
    step_costs: list[tuple[int, float]] = field(default_factory=list)

    def step_cost_fit(self) -> tuple[float, float]:
        """(a, b) of the least-squares fit `seconds = a + b × rows` over the steps that decoded."""
        decoding = [(rows, seconds) for rows, seconds in self.step_costs if rows]
        slope, intercept = statistics.linear_regression([r for r, _ in decoding], [s for _, s in decoding])
        return intercept, slope


def occupancy_steps(jobs: list[Job], streams: int) -> tuple[int, float, int]:
    """Steps each mode needs if a step cost the same whatever its rows and prefill were free (every
    running request gains one token per step, its first in the step that admits it):
    static = Σ over consecutive groups of `streams` requests of the group's longest `max_new_tokens`;
    continuous ≈ Σ max_new_tokens / streams (a lower bound), and exactly, for the closed loop (each
    request starts in the slot that frees first), the longest slot."""
    static = sum(max(j.max_new_tokens for j in jobs[i : i + streams]) for i in range(0, len(jobs), streams))
    slots = [0] * streams
    for job in jobs:
        heapq.heappush(slots, heapq.heappop(slots) + job.max_new_tokens)
    return static, sum(j.max_new_tokens for j in jobs) / streams, max(slots)


def _handler(model_dir: Path, streams: int, continuous: bool, handler_config: dict) -> tuple[TextGenerationHandler, Context]:
    config = {"continuousBatching": continuous, "batchSize": streams, "handler": {"model_path": ".", **handler_config}}
    context = Context("bench", str(model_dir), {}, streams, None, model_yaml_config=config)
    handler = TextGenerationHandler()
    handler.initialize(context)
    return handler, context


def run_static_handler(model_dir: Path, jobs: list[Job], streams: int, handler_config: dict) -> float:
    """The handler's static batching: each group of `streams` requests is one frame that `handle()` runs
    to its end (no intermediate replies to send here). Returns the seconds taken."""
    handler, context = _handler(model_dir, streams, False, handler_config)
    generated = 0
    start = time.perf_counter()
    for first in range(0, len(jobs), streams):
        group = jobs[first : first + streams]
        ids = [f"r{first + k}" for k in range(len(group))]
        context.begin_frame([RequestEntry(rid, {}, "", True) for rid in ids])
        bodies = [{"body": {"prompt": j.prompt, "max_new_tokens": j.max_new_tokens, "ignore_eos": True}} for j in group]
        for rid, result in zip(ids, handler.handle(bodies, context)):
            if "error" in result or result["finish_reason"] != "length":
                raise RuntimeError(f"{rid}: {result}")
            generated += result["completion_tokens"]
    seconds = time.perf_counter() - start
    assert generated == sum(j.max_new_tokens for j in jobs), generated
    return seconds


def run_continuous(model_dir: Path, jobs: list[Job], streams: int, handler_config: dict) -> tuple[LoopStats, TextGenerationHandler]:
    """The handler driven frame by frame as the worker would, by a closed loop of `streams` clients."""
    handler, context = _handler(model_dir, streams, True, handler_config)
    forward_seconds = [0.0]
    step_prefill = [0.0]  # prefill forwards of the current step
    step_rows = [0]  # rows of the current step's decode forward
    real_forward = handler.model.forward

    def timed_forward(*args, **kwargs):
        t = time.perf_counter()
        try:
            return real_forward(*args, **kwargs)
        finally:
            elapsed = time.perf_counter() - t
            forward_seconds[0] += elapsed
            if isinstance(kwargs.get("cache"), PrefillCache):
                step_prefill[0] += elapsed
            else:
                step_rows[0] = kwargs["input_ids"].shape[0]

    handler.model.forward = timed_forward
    queue = list(enumerate(jobs))
    active: dict[str, tuple[dict, float, bool]] = {}  # id -> (body, submitted at, got first token)
    new_ids: set[str] = set()
    ttft: list[float] = []
    step_costs: list[tuple[int, float]] = []
    prefill_seconds = 0.0
    generated = 0
    steps = 0
    start = time.perf_counter()
    while queue or active:
        while queue and len(active) < streams:  # a client whose request ended sends its next one
            i, job = queue.pop(0)
            body = {"prompt": job.prompt, "max_new_tokens": job.max_new_tokens, "ignore_eos": True}
            active[f"r{i}"] = (body, time.perf_counter(), False)
            new_ids.add(f"r{i}")
        ids = list(active)
        context.begin_frame([RequestEntry(rid, {}, "", rid in new_ids) for rid in ids])
        new_ids.clear()
        step_prefill[0], step_rows[0] = 0.0, 0
        began = time.perf_counter()
        results = handler.handle([{"body": active[rid][0]} for rid in ids], context)
        steps += 1
        now = time.perf_counter()
        step_costs.append((step_rows[0], now - began - step_prefill[0]))
        prefill_seconds += step_prefill[0]
        for idx, rid in enumerate(ids):
            result = results[idx]
            if "error" in result:
                raise RuntimeError(f"{rid}: {result['error']}")
            body, submitted, started = active[rid]
            if result["token_ids"] and not started:
                ttft.append(now - submitted)
                active[rid] = (body, submitted, True)
            generated += len(result["token_ids"])
            if context.is_done(idx):
                del active[rid]
    seconds = time.perf_counter() - start
    assert generated == sum(j.max_new_tokens for j in jobs), generated
    handler.model.forward = real_forward
    return LoopStats(seconds, steps, forward_seconds[0], ttft, prefill_seconds, step_costs), handler


def bench(name: str, model_dir: Path, args: argparse.Namespace) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    num_params = sum(p.numel() for p in model.parameters())
    jobs = make_jobs(tokenizer, args.requests, args.seed)
    tokens = sum(j.max_new_tokens for j in jobs)
    print(f"\n== {name}: {num_params / 1e6:.1f} M params, {len(jobs)} requests, {args.streams} streams, "
          f"{tokens} new tokens, prompts {min(j.num_prompt for j in jobs)}–{max(j.num_prompt for j in jobs)} tokens")  # fmt: skip
    handler_config = {"prefill_chunk_size": args.prefill_chunk_size, "max_batch_tokens": args.max_batch_tokens}
    rows = []
    stats, handler = run_continuous(model_dir, jobs, args.streams, handler_config)
    del handler
    continuous = tokens / stats.seconds
    static_handler = None
    if not args.skip_baselines:
        seq = tokens / run_sequential(model, tokenizer, jobs)
        static = tokens / run_static(model, tokenizer, jobs, args.streams)
        static_handler = tokens / run_static_handler(model_dir, jobs, args.streams, handler_config)
        rows += [("sequential generate", seq, 1.0), (f"static generate ×{args.streams}", static, static / seq),
                 (f"static (handler) ×{args.streams}", static_handler, static_handler / seq)]
    else:
        seq = None
    rows.append(("continuous (handler)", continuous, continuous / seq if seq else float("nan")))
    for label, rate, ratio in rows:
        versus = f"{ratio:5.2f}× sequential" if seq else ""
        print(f"  {label:<24} {rate:8.1f} tokens/s   {versus}")
    ttft = sorted(stats.ttft)
    print(f"  continuous: {stats.num_steps} steps, {1000 * stats.seconds / stats.num_steps:.1f} ms/step, "
          f"model forward {100 * stats.forward_seconds / stats.seconds:.0f} % of the loop "
          f"(prefill {100 * stats.prefill_seconds / stats.seconds:.0f} %); "
          f"TTFT p50 {1000 * statistics.median(ttft):.0f} ms, p99 {1000 * ttft[int(0.99 * (len(ttft) - 1))]:.0f} ms")  # fmt: skip
    a, b = stats.step_cost_fit()
    print(f"  continuous step without prefill ≈ {1000 * a:.2f} ms + {1000 * b:.3f} ms × rows", end="")
    if static_handler:
        static_steps, floor, closed_loop = occupancy_steps(jobs, args.streams)
        print(f"; continuous / static (handler) = {continuous / static_handler:.2f}× "
              f"(occupancy ceiling {static_steps / floor:.2f}×, {static_steps / closed_loop:.2f}× with the closed loop's "
              f"ramp-down; expected from the fit {expected_ratio(stats, jobs, args.streams):.2f}×)")
    else:
        print()


def expected_ratio(stats: LoopStats, jobs: list[Job], streams: int) -> float:
    """Continuous/static expected from the continuous loop's own costs: static decodes the same rows
    (each request's tokens after its first) and prefills the same prompts, but in Σ_groups (max − 1)
    decode steps instead of the loop's, each paying the fit's per-step cost `a` once more."""
    a, _ = stats.step_cost_fit()
    static_decode_steps = sum(max(j.max_new_tokens for j in jobs[i : i + streams]) - 1
                              for i in range(0, len(jobs), streams))  # fmt: skip
    continuous_decode_steps = sum(1 for rows, _ in stats.step_costs if rows)
    return (stats.seconds + (static_decode_steps - continuous_decode_steps) * a) / stats.seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="tiny,27m", help="comma-separated: tiny, 27m (built into a temp dir)")
    parser.add_argument("--model-dir", type=Path, help="benchmark this checkpoint instead")
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--prefill-chunk-size", type=int, default=256)
    parser.add_argument("--max-batch-tokens", type=int, default=16384)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--skip-baselines", action="store_true", help="only the continuous loop")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s)")
    if args.model_dir:
        bench(args.model_dir.name, args.model_dir, args)
        return 0
    import build_tiny_llm

    with tempfile.TemporaryDirectory(prefix="llm-bench-") as tmp:
        for name in args.models.split(","):
            model_dir = build_tiny_llm.build(Path(tmp) / name, **MODELS[name])
            bench(name, model_dir, args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
