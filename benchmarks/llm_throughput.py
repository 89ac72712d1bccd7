"""Served LLM throughput: a closed loop of OpenAI streaming clients against `conveyor serve`, with
continuous batching vs static batching, vs the handler's own loop in-process, and optionally vs
another OpenAI-compatible server by URL.

    python benchmarks/llm_throughput.py                              # tiny and 27 M models, temp dir (~2 min)
    python benchmarks/llm_throughput.py --models 27m --requests 32
    python benchmarks/llm_throughput.py --build-dir /tmp/llm-bench --build-only   # checkpoints for another server
    python benchmarks/llm_throughput.py --build-dir /tmp/llm-bench --models 27m \\
        --url http://127.0.0.1:8000 --url-model /tmp/llm-bench/27m          # e.g. transformers serve

Workload (issue 6): `--streams` (16) clients; each sends its next request when its previous one ended
(closed loop); `max_new_tokens` uniform in 8–128 and prompts of 6–320 tokens drawn with a fixed seed
(benchmarks/llm_inprocess.py's `make_jobs`); every request generates exactly its tokens (the models
of build_tiny_llm.py never pick EOS greedily: its output row is zero). Requests go to
`POST /v1/completions` with `stream: true` and `temperature: 0`.
Tokens/s counts the tokens of the usage chunk (`stream_options.include_usage`), else the content
chunks. TTFT is from sending the request to its first content chunk.

Both Conveyor servers run `conveyor serve` with the same flags (`--batch-size` = streams,
`--max-batch-delay 20`, one worker, one torch thread) except `--[no-]continuous-batching`: static
batching runs each batch to its longest request before the next one starts (docs/llm.md). The
in-process figure is `llm_inprocess.run_continuous`: the same handler driven frame by frame with no
frontend, no socket and no HTTP — served / in-process is what the server costs on top of the model.

Next to the measured continuous / static it prints, for the same job list, the **occupancy ceiling**:
the ratio if a step cost the same for 1 row as for 16 and prefill were free — static batching (groups
of `--streams` requests, each group running to its longest request) then needs Σ_groups
max(max_new_tokens) steps, continuous about Σ max_new_tokens / streams (`llm_inprocess.occupancy_steps`).
It also prints the in-process loop's prefill share and its step cost fit (`a + b × rows`), and the
ratio those costs predict: static decodes the same rows and prefills the same prompts, in more steps.
Not a timed test: the machine is shared; run it with nothing else busy.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import queue
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))
sys.path.insert(0, str(REPO / "examples" / "tiny_llm"))

import llm_inprocess  # noqa: E402  (benchmarks/ is not a package)

STARTED = "Model server started."
DEFAULT_REQUESTS = {"tiny": 160, "27m": 48}  # long enough to average out a step's noise, short enough to run


@dataclass
class RunStats:
    label: str
    seconds: float = 0.0
    tokens: int = 0
    ttft: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    def percentile(self, q: float) -> float:
        values = sorted(self.ttft)
        return values[min(len(values) - 1, int(q * (len(values) - 1) + 0.5))] if values else float("nan")


# ---- the closed loop ---------------------------------------------------------------------------------


async def _one_request(session, url: str, model: str, job, stats: RunStats) -> None:
    # No `ignore_eos` (other servers refuse unknown fields): these models never pick EOS greedily.
    body = {"model": model, "prompt": job.prompt, "max_tokens": job.max_new_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    sent = time.perf_counter()
    first = None
    chunks = 0
    usage_tokens = None
    async with session.post(f"{url}/v1/completions", json=body) as response:
        if response.status != 200:
            stats.errors.append(f"HTTP {response.status}: {(await response.text())[:200]}")
            return
        async for raw in response.content:  # one SSE line at a time
            if not raw.startswith(b"data: "):
                continue
            data = raw[6:].strip()
            if data == b"[DONE]":
                break
            if b'"usage":{' in data or b'"usage": {' in data:  # the usage chunk (only this one is parsed)
                usage = json.loads(data).get("usage") or {}
                usage_tokens = usage.get("completion_tokens", usage_tokens)
            if b'"text":""' in data or b'"text": ""' in data or b'"choices":[]' in data or b'"choices": []' in data:
                continue
            chunks += 1
            if first is None:
                first = time.perf_counter()
    if first is not None:
        stats.ttft.append(first - sent)
    stats.tokens += usage_tokens if usage_tokens is not None else chunks


async def closed_loop(url: str, model: str, jobs: list, streams: int, label: str) -> RunStats:
    import aiohttp

    stats = RunStats(label)
    pending = list(jobs)
    timeout = aiohttp.ClientTimeout(total=None, sock_read=600)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=streams)) as session:
        # Warm-up (not timed): first forward passes allocate and initialise.
        warm = llm_inprocess.Job("Warm up the model please", 6, 4)
        await _one_request(session, url, model, warm, RunStats("warm-up"))

        async def client() -> None:
            while pending:
                await _one_request(session, url, model, pending.pop(0), stats)

        started = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(streams)))
        stats.seconds = time.perf_counter() - started
    return stats


# ---- a `conveyor serve` process ---------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ServeProcess:
    """`conveyor serve MODEL_DIR` on free ports; every wait bounded; stop() SIGTERMs, then kills."""

    def __init__(self, model_dir: Path, workdir: Path, flags: list[str]) -> None:
        self.port = _free_port()
        ports = [self.port, _free_port(), _free_port()]
        self.argv = [sys.executable, "-m", "frontend.cli", "serve", str(model_dir), "--port", str(ports[0]),
                     "--management-port", str(ports[1]), "--metrics-port", str(ports[2]), "--disable-token-auth",
                     "--pid-file", str(workdir / "conveyor.pid"), *flags]
        self.workdir = workdir
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> ServeProcess:
        self.workdir.mkdir(parents=True, exist_ok=True)
        log = (self.workdir / "server.log").open("ab")
        self.proc = subprocess.Popen(self.argv, cwd=self.workdir, stdout=subprocess.PIPE, stderr=log, text=True,
                                     start_new_session=True, env={**os.environ, "PYTHONPATH": str(REPO)})
        log.close()
        lines: queue.Queue[str | None] = queue.Queue()

        def pump() -> None:
            assert self.proc is not None and self.proc.stdout is not None
            for line in self.proc.stdout:
                lines.put(line)
            lines.put(None)

        threading.Thread(target=pump, daemon=True).start()
        deadline = time.monotonic() + 180
        while True:
            try:
                line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                line = None
            if line is None or time.monotonic() > deadline:
                self.__exit__()
                raise RuntimeError(f"conveyor serve did not start; see {self.workdir / 'server.log'}")
            if STARTED in line:
                return self

    def __exit__(self, *exc: object) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)


# ---- one model ---------------------------------------------------------------------------------------


def bench_model(name: str, model_dir: Path, args: argparse.Namespace, workdir: Path) -> list[RunStats]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    jobs = llm_inprocess.make_jobs(tokenizer, args.requests or DEFAULT_REQUESTS.get(name, 48), args.seed)
    total = sum(j.max_new_tokens for j in jobs)
    print(f"\n== {name}: {len(jobs)} requests, {args.streams} closed-loop streams, {total} new tokens, "
          f"prompts {min(j.num_prompt for j in jobs)}–{max(j.num_prompt for j in jobs)} tokens", flush=True)
    common = ["--batch-size", str(args.streams), "--max-batch-delay", "20", "--max-batch-tokens",
              str(args.max_batch_tokens), "--served-model-name", name]
    runs: list[RunStats] = []
    modes = (("conveyor continuous", "--continuous-batching"), ("conveyor static", "--no-continuous-batching"))
    for label, flag in modes:
        with ServeProcess(model_dir, workdir / f"{name}-{flag.strip('-')}", [*common, flag]) as server:
            runs.append(asyncio.run(closed_loop(server.url, name, jobs, args.streams, label)))
        _report(runs[-1])
    if args.url:
        runs.append(asyncio.run(closed_loop(args.url.rstrip("/"), args.url_model or str(model_dir), jobs, args.streams,
                                            f"other ({args.url})")))
        _report(runs[-1])
    import torch

    torch.set_num_threads(1)
    handler_config = {"prefill_chunk_size": 256, "max_batch_tokens": args.max_batch_tokens}
    loop, handler = llm_inprocess.run_continuous(model_dir, jobs, args.streams, handler_config)
    del handler
    inprocess = RunStats("handler in-process", loop.seconds, total, loop.ttft)
    runs.append(inprocess)
    _report(inprocess)
    by_label = {r.label: r for r in runs}
    cont, static = by_label["conveyor continuous"], by_label["conveyor static"]
    print(f"  continuous / static = {cont.tokens_per_s / static.tokens_per_s:.2f}×   "
          f"served / in-process = {cont.tokens_per_s / inprocess.tokens_per_s:.2f}×", flush=True)
    if args.url:
        other = runs[2]
        print(f"  conveyor continuous / other = {cont.tokens_per_s / other.tokens_per_s:.2f}×", flush=True)
    _report_ceiling(jobs, args.streams, loop, cont.tokens_per_s / static.tokens_per_s)
    return runs


def _report_ceiling(jobs: list, streams: int, loop: llm_inprocess.LoopStats, measured: float) -> None:
    static_steps, floor, closed_loop = llm_inprocess.occupancy_steps(jobs, streams)
    print(f"  occupancy ceiling of continuous / static = {static_steps / floor:.2f}× vs measured {measured:.2f}×"
          f" (static Σ_groups max(max_new_tokens) = {static_steps} steps, continuous Σ max_new_tokens / {streams}"
          f" = {floor:.0f}; closed loop with its ramp-down {closed_loop} → {static_steps / closed_loop:.2f}×)\n"
          f"    = the ratio if a step cost the same for 1 row as for {streams} and prefill were free; on a CPU a step"
          f" costs more with more rows and our static mode drops finished rows, so it is an upper bound", flush=True)
    a, b = loop.step_cost_fit()
    print(f"  in-process loop: prefill {100 * loop.prefill_seconds / loop.seconds:.0f} % of its time; a step without"
          f" prefill ≈ {1000 * a:.2f} ms + {1000 * b:.3f} ms × rows → at these costs continuous / static ≈"
          f" {llm_inprocess.expected_ratio(loop, jobs, streams):.2f}×", flush=True)


def _report(stats: RunStats) -> None:
    errors = f"   {len(stats.errors)} errors, first: {stats.errors[0]}" if stats.errors else ""
    print(f"  {stats.label:<28} {stats.tokens_per_s:8.1f} tokens/s   TTFT p50 {1000 * stats.percentile(0.5):7.0f} ms"
          f"  p99 {1000 * stats.percentile(0.99):7.0f} ms   ({stats.tokens} tokens in {stats.seconds:.1f} s){errors}",
          flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="tiny,27m", help="comma-separated: tiny, 27m")
    parser.add_argument("--requests", type=int, default=None,
                        help="requests per run (default: 160 tiny, 48 27m: ~5 s and ~25 s per Conveyor run)")
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-batch-tokens", type=int, default=16384)
    parser.add_argument("--build-dir", type=Path, help="build (or reuse) the checkpoints here (default: a temp dir)")
    parser.add_argument("--build-only", action="store_true", help="only build the checkpoints into --build-dir")
    parser.add_argument("--url", help="another OpenAI-compatible server serving the same checkpoint")
    parser.add_argument("--url-model", help="the model name to send to --url (default: the checkpoint path)")
    args = parser.parse_args(argv)
    import build_tiny_llm

    with tempfile.TemporaryDirectory(prefix="llm-throughput-") as tmp:
        build_dir = args.build_dir or Path(tmp)
        for name in args.models.split(","):
            model_dir = build_dir / name
            if not (model_dir / "config.json").is_file():
                build_tiny_llm.build(model_dir, **llm_inprocess.MODELS[name])
            if not args.build_only:
                bench_model(name, model_dir, args, Path(tmp) / "servers")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
