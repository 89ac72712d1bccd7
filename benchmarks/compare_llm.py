"""Conveyor vs `transformers serve --continuous-batching` on the same tiny LLM: tokens/s and time to
first token, turns interleaved. Run through ``python benchmarks/compare.py --llm`` (or directly);
not a test.

    python benchmarks/compare.py --llm [--llm-models tiny] [--rounds 2] [--write-docs]
    python benchmarks/compare_llm.py --transformers-python /path/to/venv/bin/python

* The checkpoints come from examples/tiny_llm/build_tiny_llm.py (``tiny``: hidden 64, 2 layers;
  ``27m``: hidden 512, 8 layers), built once into a temporary directory (or ``--build-dir``).
* Workload: issue 6's closed loop (benchmarks/llm_throughput.py): 16 clients, each sending its next
  request when its previous one ended, ``max_new_tokens`` uniform in 8–128, prompts of 6–320
  tokens, seed 0, greedy, ``POST /v1/completions`` with ``stream: true``.
* Conveyor: ``conveyor serve MODEL_DIR --continuous-batching --batch-size 16 --max-batch-delay 20
  --max-batch-tokens 16384 --prefill-chunk-size 512`` (one worker, one torch thread: the other core
  is the frontend's; `--num-threads 2` measured no faster on the 27 M model).
* transformers serve: ``python -m transformers.cli.transformers serve --continuous-batching
  --device cpu --dtype float32 --cb-block-size 32 --cb-num-blocks 512 --cb-max-batch-tokens 512``
  — a bounded KV cache of 16384 tokens like Conveyor's (its default sizes the cache from free RAM)
  and 512 tokens per step, the budget Conveyor gets for prompts; torch's default thread count. It needs ``pip install 'transformers[serving]'`` (a separate venv
  is fine): ``--transformers-python``, ``$TRANSFORMERS_SERVE_PYTHON``, ``/tmp/tfserve-venv/bin/python``,
  then this interpreter are tried in that order.
* Each round runs Conveyor then transformers serve on the same request list; the table gives the
  means over rounds and the ratio Conveyor / transformers serve.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
sys.path.insert(0, str(BENCH))
sys.path.insert(0, str(REPO / "examples" / "tiny_llm"))

import llm_inprocess  # noqa: E402
import llm_throughput  # noqa: E402

DOCS = REPO / "docs" / "benchmarks.md"
SECTION = "## LLM: Conveyor vs transformers serve"
BEGIN, END = "<!-- compare.py --llm: begin generated block -->", "<!-- compare.py --llm: end generated block -->"
# Same budgets on both sides: a 16384-token KV cache, and at most 512 prompt tokens per step
# (Conveyor's default prefill chunk is 256: shorter stalls for running streams, later first tokens).
CONVEYOR_FLAGS = ["--continuous-batching", "--batch-size", "16", "--max-batch-delay", "20", "--max-batch-tokens", "16384",
                  "--prefill-chunk-size", "512"]
TRANSFORMERS_FLAGS = ["--continuous-batching", "--device", "cpu", "--dtype", "float32", "--cb-block-size", "32",
                      "--cb-num-blocks", "512", "--cb-max-batch-tokens", "512"]


def find_transformers_python(explicit: str | None) -> str | None:
    """An interpreter whose transformers has the ``serve`` command (transformers[serving])."""
    candidates = [explicit, os.environ.get("TRANSFORMERS_SERVE_PYTHON"), "/tmp/tfserve-venv/bin/python",
                  sys.executable]
    for python in candidates:
        if not python or not Path(python).exists():
            continue
        probe = subprocess.run([python, "-m", "transformers.cli.transformers", "serve", "--help"],
                               capture_output=True, timeout=120)
        if probe.returncode == 0:
            return python
    return None


class TransformersServe:
    """``transformers serve`` on a free port; ready when /v1/models answers (bounded wait)."""

    def __init__(self, python: str, workdir: Path) -> None:
        self.port = llm_throughput._free_port()
        self.argv = [python, "-m", "transformers.cli.transformers", "serve", *TRANSFORMERS_FLAGS,
                     "--host", "127.0.0.1", "--port", str(self.port)]
        self.workdir = workdir
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> TransformersServe:
        self.workdir.mkdir(parents=True, exist_ok=True)
        with (self.workdir / "server.log").open("ab") as log:
            self.proc = subprocess.Popen(self.argv, cwd=self.workdir, stdout=log, stderr=log,
                                         stdin=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                break
            try:
                with urllib.request.urlopen(f"{self.url}/v1/models", timeout=2):
                    return self
            except OSError:
                time.sleep(0.5)
        self.__exit__()
        raise RuntimeError(f"transformers serve did not start; see {self.workdir / 'server.log'}")

    def __exit__(self, *exc: object) -> None:
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


def bench(name: str, model_dir: Path, python: str, rounds: int, workdir: Path) -> tuple[list, list, int]:
    """(Conveyor runs, transformers serve runs, number of requests) for one model."""
    from transformers import AutoTokenizer

    jobs = llm_inprocess.make_jobs(AutoTokenizer.from_pretrained(model_dir),
                                   llm_throughput.DEFAULT_REQUESTS.get(name, 48), 0)
    flags = ["--served-model-name", name, *CONVEYOR_FLAGS]
    ours, theirs = [], []
    for round_ in range(rounds):
        with llm_throughput.ServeProcess(model_dir, workdir / f"conveyor-{name}-{round_}", flags) as server:
            ours.append(asyncio.run(llm_throughput.closed_loop(server.url, name, jobs, 16, "conveyor")))
        llm_throughput._report(ours[-1])
        with TransformersServe(python, workdir / f"transformers-{name}-{round_}") as other:
            theirs.append(asyncio.run(llm_throughput.closed_loop(other.url, str(model_dir), jobs, 16, "transformers serve")))
        llm_throughput._report(theirs[-1])
    return ours, theirs, len(jobs)


def _row(name: str, num_requests: int, ours: list, theirs: list) -> str:
    def cols(runs: list) -> list[str]:
        return [f"{statistics.fmean(r.tokens_per_s for r in runs):.1f}",
                f"{1000 * statistics.fmean(r.percentile(0.5) for r in runs):.0f}",
                f"{1000 * statistics.fmean(r.percentile(0.99) for r in runs):.0f}"]

    ratio = statistics.fmean(r.tokens_per_s for r in ours) / max(statistics.fmean(r.tokens_per_s for r in theirs), 1e-9)
    per_round = [a.tokens_per_s / b.tokens_per_s for a, b in zip(ours, theirs) if b.tokens_per_s]
    spread = f" ({min(per_round):.2f}–{max(per_round):.2f})" if len(per_round) > 1 else ""
    ttft = statistics.fmean(r.percentile(0.5) for r in ours) / max(statistics.fmean(r.percentile(0.5) for r in theirs), 1e-9)
    errors = f"{sum(len(r.errors) for r in ours)}/{sum(len(r.errors) for r in theirs)}"
    return "| " + " | ".join([name, str(num_requests), *cols(ours), *cols(theirs), f"**{ratio:.2f}**{spread}",
                              f"{ttft:.2f}", errors]) + " |"


def report(rows: list[str], rounds: int, python: str) -> str:
    import torch
    import transformers

    other = subprocess.run([python, "-c", "import transformers, torch; print(transformers.__version__, torch.__version__)"],
                           capture_output=True, text=True, timeout=120).stdout.strip()
    return "\n".join([
        f"Generated by `python benchmarks/compare.py {' '.join(sys.argv[1:])}` on "
        f"{datetime.datetime.now().strftime('%Y-%m-%d %H:%M')}; load average after: "
        f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}.",
        "",
        f"- machine: {_machine()}",
        f"- Conveyor: transformers {transformers.__version__}, torch {torch.__version__}, `conveyor serve "
        f"{' '.join(CONVEYOR_FLAGS)}`, 1 torch thread",
        f"- transformers serve: transformers/torch {other}, `transformers serve {' '.join(TRANSFORMERS_FLAGS)}`, "
        "torch's default threads",
        f"- workload: 16 closed-loop streams, max_new_tokens 8–128, prompts 6–320 tokens, seed 0, greedy, streamed "
        f"`/v1/completions`; {rounds} round(s), the servers in turn; means over rounds",
        "",
        "| model | requests | Conveyor tok/s | TTFT p50 ms | TTFT p99 ms | transformers serve tok/s | TTFT p50 ms "
        "| TTFT p99 ms | tok/s Conveyor/transformers | TTFT p50 ratio | errors |",
        "|" + "---|" * 11,
        *rows,
    ])


def _machine() -> str:
    from compare import machine  # compare.py imports this module: import at call time

    return machine()


def write_docs(block: str) -> None:
    generated = f"{BEGIN}\n{block}\n{END}"
    text = DOCS.read_text()
    if BEGIN in text and END in text:
        head, rest = text.split(BEGIN, 1)
        text = head + generated + rest.split(END, 1)[1]
    else:
        text = text.rstrip("\n") + f"\n\n{SECTION}\n\n{generated}\n"
    DOCS.write_text(text)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--llm-models", default="tiny", help="comma-separated: tiny, 27m")
    parser.add_argument("--transformers-python", help="python of a venv with transformers[serving]")
    parser.add_argument("--build-dir", type=Path, help="build (or reuse) the checkpoints here")


def run(args: argparse.Namespace) -> int:
    import build_tiny_llm

    python = find_transformers_python(args.transformers_python)
    if python is None:
        print("transformers serve not found (pip install 'transformers[serving]'; see --transformers-python)",
              file=sys.stderr)
        return 1
    with tempfile.TemporaryDirectory(prefix="conveyor-compare-llm-") as tmp:
        build_dir = args.build_dir or Path(tmp) / "models"
        rows = []
        for name in args.llm_models.split(","):
            model_dir = build_dir / name
            if not (model_dir / "config.json").is_file():
                build_tiny_llm.build(model_dir, **llm_inprocess.MODELS[name])
            print(f"== {name}", flush=True)
            ours, theirs, num_requests = bench(name, model_dir, python, args.rounds, Path(tmp) / "servers")
            rows.append(_row(name, num_requests, ours, theirs))
        block = report(rows, args.rounds, python)
    print("\n" + block)
    if args.write_docs:
        write_docs(block)
        print(f"\nwrote {DOCS.relative_to(REPO)}")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--write-docs", action="store_true")
    return run(parser.parse_args())


if __name__ == "__main__":
    raise SystemExit(main())
