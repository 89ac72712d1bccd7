"""Micro-benchmark of the socket codec: encode + decode time per request.

    python benchmarks/codec_bench.py [--repeat 2000]

Frames: INFER with 32 CONTINUE requests (a continuous-batching step), INFER with 32 NEW requests
carrying 1 KiB bodies and two headers, and INFER_REPLY with 32 results of 64-byte chunks.
Prints microseconds per request (best of 5 rounds, to damp the noise of a shared machine).
"""

from __future__ import annotations

import argparse
import time

from backend import protocol as p


def frames() -> dict[str, p.Message]:
    cont = p.InferRequest(1, tuple(p.WireRequest(f"req-{i:06d}", p.RequestState.CONTINUE) for i in range(32)))
    new = p.InferRequest(
        2,
        tuple(
            p.WireRequest(
                f"req-{i:06d}", p.RequestState.NEW, "", p.RequestFlags.NONE,
                (("content-type", "application/octet-stream"), ("x-request-id", f"req-{i:06d}")),
                (p.InputParameter("body", "application/octet-stream", bytes(1024)),),
            )
            for i in range(32)
        ),
    )
    reply = p.InferReply(2, True, tuple(p.WireResult(f"req-{i:06d}", 200, False, "", "application/json", (), b"x" * 64) for i in range(32)))
    return {"INFER 32 x CONTINUE": cont, "INFER 32 x NEW (1 KiB)": new, "INFER_REPLY 32 x 64 B": reply}


def per_request_us(msg: p.Message, repeat: int) -> float:
    n = len(msg.requests) if isinstance(msg, p.InferRequest) else len(msg.results)  # type: ignore[union-attr]
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(repeat):
            p.decode(p.encode(msg))
        best = min(best, (time.perf_counter() - start) / repeat / n)
    return best * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=2000)
    args = parser.parse_args()
    print(f"{'frame':28} {'encode+decode per request':>26} {'frame bytes':>12}")
    for name, msg in frames().items():
        print(f"{name:28} {per_request_us(msg, args.repeat):23.2f} us {len(p.encode(msg)):12d}")


if __name__ == "__main__":
    main()
