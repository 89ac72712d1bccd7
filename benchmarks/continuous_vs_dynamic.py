"""Continuous vs dynamic batching on the streaming test handler, and the frontend's per-step overhead.
Not a test: run it by hand.

    python benchmarks/continuous_vs_dynamic.py [--streams 96] [--concurrency 16] [--step-ms 10] [--seed 5]

1. **Throughput.** One server, two models of the same handler (examples/streaming) with the same
   ``batchSize`` (= concurrency): ``cb`` with ``continuousBatching: true`` (one chunk per request per
   step, requests join and leave between steps) and ``db`` with plain dynamic batching (a frame runs
   all the steps of its requests and streams the chunks as intermediate replies). Every decode step
   costs ``step_ms`` per step in both modes. ``concurrency`` clients run a closed loop
   over the same seeded list of streams of mixed lengths; throughput is chunks received per second,
   and the ratio cb/db comes from this one run.
2. **Per-step overhead** at 32 active streams: model ``cb32`` (batchSize 32, continuous), 32 long
   streams. The worker's step loop times each back-to-back step from the reply's bytes read to the
   next frame written (decode, hand the results to the streams, build, encode and send the next
   frame) and logs it at DEBUG; the server runs with that logger at DEBUG and the script reports the
   p50 / p99 of the steps that carried 32 requests. (The same timer feeds the Prometheus histogram
   ``conveyor_step_overhead_seconds``.)

The load generator is an aiohttp client in this process, sharing the CPUs with the server and the
workers; figures from a loaded machine are lower bounds on what the server can do.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

REPO = Path(__file__).resolve().parents[1]
STREAMING = REPO / "examples" / "streaming" / "streaming_handler.py"

LOG_CONFIG = {"version": 1, "incremental": True, "loggers": {"frontend.workers.worker": {"level": "DEBUG"}}}
OVERHEAD_LINE = re.compile(r"step overhead ([\d.]+) us batch=(\d+)")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def archive(root: Path, store: Path, name: str, yaml: str) -> None:
    config = root / f"{name}.yaml"
    config.write_text(yaml)
    subprocess.run([sys.executable, "-m", "frontend.cli", "archive", "--model-name", name, "--version", "1.0",
                    "--handler", str(STREAMING),
                    "--config-file", str(config), "--export-path", str(store)], check=True, cwd=REPO)


def build_store(root: Path, batch_size: int, delay_ms: int) -> Path:
    store = root / "store"
    store.mkdir()
    common = f"minWorkers: 1\nmaxWorkers: 1\nmaxBatchDelay: {delay_ms}\njobQueueSize: 1000\nresponseTimeout: 600\n"
    archive(root, store, "cb", common + f"batchSize: {batch_size}\ncontinuousBatching: true\n")
    archive(root, store, "db", common + f"batchSize: {batch_size}\ncontinuousBatching: false\n")
    archive(root, store, "cb32", common + "batchSize: 32\ncontinuousBatching: true\n")
    return store


def start_server(root: Path, store: Path) -> tuple[subprocess.Popen, dict[str, str]]:
    names = ("inference", "management", "metrics")
    ports = {name: free_port() for name in names}
    config = root / "config.properties"
    config.write_text("".join(f"{name}_address=http://127.0.0.1:{port}\n" for name, port in ports.items())
                      + f"grpc_inference_port={free_port()}\ngrpc_management_port={free_port()}\n")
    (root / "log.json").write_text(json.dumps(LOG_CONFIG))
    log = (root / "server.log").open("wb")
    proc = subprocess.Popen([sys.executable, "-m", "frontend.cli", "start", "--foreground", "--ts-config", str(config),
                             "--model-store", str(store), "--models", "cb.mar", "db.mar", "cb32.mar",
                             "--log-config", str(root / "log.json"), "--pid-file", str(root / "pid"),
                             "--disable-token-auth"],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=log, text=True, start_new_session=True)
    deadline = time.monotonic() + 120
    assert proc.stdout is not None
    for line in proc.stdout:  # the server prints nothing else on stdout
        if "Model server started" in line:
            return proc, {name: f"http://127.0.0.1:{port}" for name, port in ports.items()}
        if time.monotonic() > deadline:
            break
    stop_server(proc)
    raise SystemExit(f"server did not start; see {root / 'server.log'}")


def stop_server(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


async def one_stream(session: aiohttp.ClientSession, url: str, n: int, step_ms: float) -> int:
    """Stream one request; returns the number of chunks (checked against n)."""
    chunks, buf = 0, b""
    async with session.post(url, json={"n": n, "step_ms": step_ms}) as response:
        if response.status != 200:
            raise RuntimeError(f"{url}: HTTP {response.status}: {await response.text()}")
        async for data, end_of_chunk in response.content.iter_chunks():
            buf += data
            if end_of_chunk and buf:
                chunks += 1
                buf = b""
    if chunks != n:
        raise RuntimeError(f"{url}: expected {n} chunks, got {chunks}")
    return chunks


async def closed_loop(url: str, lengths: list[int], concurrency: int, step_ms: float) -> tuple[int, float]:
    """``concurrency`` clients take the next stream of ``lengths`` as soon as their last one ended."""
    pending = list(reversed(lengths))
    total = 0
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        async def client() -> None:
            nonlocal total
            while pending:
                chunks = await one_stream(session, url, pending.pop(), step_ms)
                total += chunks  # not `total += await …`: that reads total before the await

        started = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(concurrency)))
        return total, time.perf_counter() - started


def scrape(metrics_url: str) -> dict[tuple[str, str], float]:
    """(metric name, model) → value, for the unlabelled-but-model series of /metrics."""
    import requests

    out: dict[tuple[str, str], float] = {}
    for match in re.finditer(r'^(\w+)\{model="(\w+)"\} (\S+)$', requests.get(metrics_url, timeout=10).text, re.M):
        out[(match[1], match[2])] = float(match[3])
    return out


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, default=96, help="streams per mode")
    parser.add_argument("--concurrency", type=int, default=16, help="concurrent streams (also batchSize)")
    parser.add_argument("--min-len", type=int, default=4)
    parser.add_argument("--max-len", type=int, default=64)
    parser.add_argument("--step-ms", type=float, default=10.0, help="fixed cost of one decode step")
    parser.add_argument("--delay-ms", type=int, default=10, help="maxBatchDelay of both models")
    parser.add_argument("--overhead-streams", type=int, default=32)
    parser.add_argument("--overhead-len", type=int, default=300)
    parser.add_argument("--overhead-step-ms", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=5)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    lengths = [rng.randint(args.min_len, args.max_len) for _ in range(args.streams)]

    root = Path(tempfile.mkdtemp(prefix="conveyor-cb-bench-"))
    store = build_store(root, args.concurrency, args.delay_ms)
    proc, urls = start_server(root, store)
    try:
        print(f"{args.streams} streams per mode, lengths {args.min_len}..{args.max_len} (seed {args.seed}, "
              f"mean {statistics.mean(lengths):.1f} chunks), {args.concurrency} concurrent, batchSize "
              f"{args.concurrency}, step {args.step_ms:g} ms, maxBatchDelay {args.delay_ms} ms; "
              f"{os.cpu_count()} CPUs shared by server, worker and client")
        rates = {}
        for model in ("cb", "db"):
            chunks, seconds = asyncio.run(closed_loop(f"{urls['inference']}/predictions/{model}", lengths,
                                                      args.concurrency, args.step_ms))
            rates[model] = chunks / seconds
            print(f"  {model}: {chunks} chunks in {seconds:.2f} s = {rates[model]:.0f} chunks/s", flush=True)
        print(f"  continuous / dynamic throughput: {rates['cb'] / rates['db']:.2f}x")
        metrics = scrape(f"{urls['metrics']}/metrics")
        for model in ("cb", "db"):
            frames = metrics.get(("conveyor_steps_total", model), 0.0)
            size = metrics.get(("conveyor_batch_size_sum", model), 0.0) / frames if frames else 0.0
            print(f"  {model}: {frames:.0f} frames, mean {size:.1f} requests per frame")

        log_path = root / "server.log"
        mark = log_path.stat().st_size
        asyncio.run(closed_loop(f"{urls['inference']}/predictions/cb32", [args.overhead_len] * args.overhead_streams,
                                args.overhead_streams, args.overhead_step_ms))
        with log_path.open("rb") as log:
            log.seek(mark)
            text = log.read().decode("utf-8", "replace")
        full = [float(m[1]) for m in OVERHEAD_LINE.finditer(text) if int(m[2]) == args.overhead_streams]
        if not full:
            print("  no full-batch steps logged (is the step loop's DEBUG log on?)")
            return 1
        print(f"per-step frontend overhead at {args.overhead_streams} active streams ({len(full)} steps, "
              f"step {args.overhead_step_ms:g} ms): p50 {percentile(full, 0.5):.0f} us, "
              f"p99 {percentile(full, 0.99):.0f} us, mean {statistics.mean(full):.0f} us")
    finally:
        stop_server(proc)
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
