"""Echo throughput and latency: requests/s, p50 and p99 at concurrency 1, 16 and 64, for batchSize 1
and batchSize 8 (maxBatchDelay 5 ms), one worker each. Not a test: run it by hand.

    python benchmarks/echo_load.py [--duration 10] [--concurrency 1 16 64] [--generator auto|wrk|aiohttp]

It builds two echo archives, starts a real server (``python -m frontend.cli start --foreground``)
on free ports, drives it with ``wrk`` when it is on PATH (``apt-get install -y wrk``) or else with
an aiohttp client, prints one table, and stops the server. The load generator is named in the
output: figures from different generators are not comparable (the aiohttp client shares the
CPU with the server and is itself the bottleneck well before wrk is).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BODY = b'{"text": "hello conveyor"}'
WRK_SCRIPT = 'wrk.method = "POST"\nwrk.body = \'{"text": "hello conveyor"}\'\nwrk.headers["Content-Type"] = "application/json"\n'


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def build_store(root: Path) -> Path:
    store = root / "store"
    store.mkdir()
    for batch_size in (1, 8):
        cfg = root / f"echo_b{batch_size}.yaml"
        cfg.write_text(f"minWorkers: 1\nmaxWorkers: 1\nbatchSize: {batch_size}\nmaxBatchDelay: 5\njobQueueSize: 1000\n")
        subprocess.run([sys.executable, "-m", "frontend.cli", "archive", "--model-name", f"echo_b{batch_size}",
                        "--version", "1.0", "--handler", str(REPO / "examples" / "echo" / "echo_handler.py"),
                        "--config-file", str(cfg), "--export-path", str(store)], check=True, cwd=REPO)
    return store


def start_server(root: Path, store: Path, grpc_port: int | None = None) -> tuple[subprocess.Popen, str]:
    ports = [free_port() for _ in range(3)]
    config = root / "config.properties"
    config.write_text("".join(f"{name}_address=http://127.0.0.1:{port}\n"
                              for name, port in zip(("inference", "management", "metrics"), ports))
                      + f"grpc_inference_port={grpc_port or free_port()}\ngrpc_management_port={free_port()}\n"
                      + "disable_token_authorization=true\n")
    log = (root / "server.log").open("wb")
    proc = subprocess.Popen([sys.executable, "-m", "frontend.cli", "start", "--foreground", "--ts-config", str(config),
                             "--model-store", str(store), "--models", "echo_b1.mar", "echo_b8.mar",
                             "--pid-file", str(root / "pid")],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=log, text=True, start_new_session=True)
    deadline = time.monotonic() + 60
    assert proc.stdout is not None
    for line in proc.stdout:  # the server prints nothing else on stdout
        if "Model server started" in line:
            return proc, f"http://127.0.0.1:{ports[0]}"
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


def _wrk_ms(text: str) -> float:
    match = re.fullmatch(r"([\d.]+)(us|ms|s)", text)
    if not match:
        raise ValueError(text)
    value, unit = float(match.group(1)), match.group(2)
    return value / 1000 if unit == "us" else value * 1000 if unit == "s" else value


def run_wrk(url: str, concurrency: int, duration: float, script: Path) -> tuple[float, float, float, int]:
    threads = min(concurrency, 2)  # two cores: more threads only fight the server for them
    out = subprocess.run(["wrk", "-t", str(threads), "-c", str(concurrency), "-d", f"{duration:g}s", "--latency",
                          "-s", str(script), url], check=True, capture_output=True, text=True).stdout
    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))  # type: ignore[union-attr]
    p50 = _wrk_ms(re.search(r"\s50%\s+(\S+)", out).group(1))  # type: ignore[union-attr]
    p99 = _wrk_ms(re.search(r"\s99%\s+(\S+)", out).group(1))  # type: ignore[union-attr]
    errors = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    return rps, p50, p99, int(errors.group(1)) if errors else 0


async def _aiohttp_load(url: str, concurrency: int, duration: float) -> tuple[float, float, float, int]:
    import aiohttp

    latencies: list[float] = []
    errors = 0
    stop_at = time.perf_counter() + duration
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector) as session:
        async def client() -> None:
            nonlocal errors
            while time.perf_counter() < stop_at:
                t0 = time.perf_counter()
                async with session.post(url, data=BODY, headers={"Content-Type": "application/json"}) as response:
                    await response.read()
                    if response.status != 200:
                        errors += 1
                latencies.append(time.perf_counter() - t0)

        started = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(concurrency)))
        elapsed = time.perf_counter() - started
    latencies.sort()
    pick = lambda q: latencies[min(len(latencies) - 1, int(q * len(latencies)))] * 1000  # noqa: E731
    return len(latencies) / elapsed, pick(0.50), pick(0.99), errors


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=float, default=10.0, help="seconds per measurement")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--generator", choices=["auto", "wrk", "aiohttp"], default="auto")
    args = parser.parse_args()
    generator = args.generator
    if generator == "auto":
        generator = "wrk" if shutil.which("wrk") else "aiohttp"
    root = Path(tempfile.mkdtemp(prefix="conveyor-bench-"))
    store = build_store(root)
    script = root / "post.lua"
    script.write_text(WRK_SCRIPT)
    proc, base = start_server(root, store)
    try:
        print(f"load generator: {generator}; {args.duration:g} s per cell; 1 worker per model; "
              f"{os.cpu_count()} CPUs shared by server, worker and generator")
        print(f"{'batchSize':>9} {'concurrency':>11} {'req/s':>10} {'p50 ms':>8} {'p99 ms':>8} {'errors':>6}")
        for batch_size in (1, 8):
            url = f"{base}/predictions/echo_b{batch_size}"
            for concurrency in args.concurrency:
                if generator == "wrk":
                    rps, p50, p99, errors = run_wrk(url, concurrency, args.duration, script)
                else:
                    rps, p50, p99, errors = asyncio.run(_aiohttp_load(url, concurrency, args.duration))
                print(f"{batch_size:>9} {concurrency:>11} {rps:>10.0f} {p50:>8.2f} {p99:>8.2f} {errors:>6}", flush=True)
    finally:
        stop_server(proc)
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
