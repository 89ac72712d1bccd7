"""Unary echo over gRPC next to REST, in one run: requests/s, p50 and p99 at a given concurrency.

    python benchmarks/grpc_vs_rest.py [--concurrency 16] [--duration 8] [--rounds 2]

One server (echo, batchSize 1 and 8), one Python client process for both protocols (grpc.aio and
aiohttp, each with `concurrency` coroutines in a closed loop), runs interleaved REST, gRPC, REST,
gRPC... so drift on a shared machine hits both alike. The client shares the 2 cores with the server:
compare the two columns, not these numbers with wrk's.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import grpc

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from echo_load import BODY, build_store, free_port, start_server, stop_server  # noqa: E402

from frontend.grpc_api.protos import inference_pb2, inference_pb2_grpc  # noqa: E402


async def _closed_loop(call, concurrency: int, duration: float) -> tuple[float, float, float]:
    latencies: list[float] = []
    deadline = time.monotonic() + duration

    async def client() -> None:
        while time.monotonic() < deadline:
            start = time.perf_counter()
            await call()
            latencies.append(time.perf_counter() - start)

    started = time.monotonic()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    elapsed = time.monotonic() - started
    latencies.sort()
    p99 = latencies[min(len(latencies) - 1, int(len(latencies) * 0.99))]
    return len(latencies) / elapsed, statistics.median(latencies) * 1e3, p99 * 1e3


async def rest(url: str, model: str, concurrency: int, duration: float) -> tuple[float, float, float]:
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency)) as session:
        async def call() -> None:
            async with session.post(f"{url}/predictions/{model}", data=BODY,
                                    headers={"Content-Type": "application/json"}) as resp:
                await resp.read()
                assert resp.status == 200, resp.status
        return await _closed_loop(call, concurrency, duration)


async def grpc_unary(port: int, model: str, concurrency: int, duration: float) -> tuple[float, float, float]:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = inference_pb2_grpc.InferenceAPIsServiceStub(channel)
        request = inference_pb2.PredictionsRequest(model_name=model, input={"body": BODY})

        async def call() -> None:
            await stub.Predictions(request)
        return await _closed_loop(call, concurrency, duration)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--duration", type=float, default=8.0)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        grpc_port = free_port()
        proc, url = start_server(root, build_store(root), grpc_port=grpc_port)
        try:
            print(f"unary echo, concurrency {args.concurrency}, {args.duration:.0f} s per run, {args.rounds} rounds, "
                  "Python clients (aiohttp / grpc.aio)")
            print(f"{'model':8} {'protocol':8} {'req/s':>8} {'p50 ms':>8} {'p99 ms':>8}")
            for model in ("echo_b1", "echo_b8"):
                totals: dict[str, list[tuple[float, float, float]]] = {"REST": [], "gRPC": []}
                for _ in range(args.rounds):
                    totals["REST"].append(asyncio.run(rest(url, model, args.concurrency, args.duration)))
                    totals["gRPC"].append(asyncio.run(grpc_unary(grpc_port, model, args.concurrency, args.duration)))
                for protocol, runs in totals.items():
                    rps = statistics.mean(r[0] for r in runs)
                    print(f"{model:8} {protocol:8} {rps:8.0f} {statistics.mean(r[1] for r in runs):8.2f} "
                          f"{statistics.mean(r[2] for r in runs):8.2f}")
                ratio = statistics.mean(r[0] for r in totals["gRPC"]) / statistics.mean(r[0] for r in totals["REST"])
                print(f"{model:8} gRPC/REST req/s ratio: {ratio:.2f}")
        finally:
            stop_server(proc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
