"""The backend worker's per-frame CPU cost, in process, without sockets or a frontend. Not a test.

    python benchmarks/profile_worker.py [--batch-size 1 8] [--frames 20000] [--cprofile]

Loads ``benchmarks/ts_echo_handler.py`` into a ``Service`` the way ``backend.worker`` does, then
times the worker's whole path for one INFER frame of echo requests as wrk sends them (three HTTP
headers, a small JSON body): decode the frame, ``Service.predict``, encode the reply. Prints
microseconds per frame and per request (best of 5 rounds), or with ``--cprofile`` the functions
with the most own time.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from backend.context import SERVER_VERSION, Context  # noqa: E402
from backend.handler_loader import load_handler  # noqa: E402
from backend.protocol import (  # noqa: E402
    HEADER_SIZE, InferRequest, InputParameter, MessageType, RequestState, WireRequest, decode_payload, encode,
)
from backend.service import Service  # noqa: E402

BODY = b'{"text": "hello conveyor"}'
HEADERS = (("Host", "127.0.0.1:8080"), ("Content-Length", str(len(BODY))), ("Content-Type", "application/json"))


def make_service(batch_size: int) -> Service:
    model_dir = tempfile.mkdtemp(prefix="conveyor-profile-worker-")
    (Path(model_dir) / "ts_echo_handler.py").write_text((REPO / "benchmarks" / "ts_echo_handler.py").read_text())
    context = Context("echo", model_dir, {"model": {"modelName": "echo", "handler": "ts_echo_handler.py"}},
                      batch_size, None, SERVER_VERSION, True, None, {})
    return Service(load_handler("ts_echo_handler.py", model_dir, context), context, 6553500, lambda reply: None)


def make_frame(frame_id: int, batch_size: int) -> bytes:
    return encode(InferRequest(frame_id, tuple(
        WireRequest(f"2fee8a8f-2413-4865-a1f7-{frame_id:06d}{i:06d}", RequestState.NEW, headers=HEADERS,
                    parameters=(InputParameter("body", "application/json", BODY),))
        for i in range(batch_size))))


def one_frame(service: Service, frame: bytes) -> bytes:
    request = decode_payload(MessageType.INFER, frame[HEADER_SIZE:])
    return encode(service.predict(request))  # type: ignore[arg-type]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-size", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--frames", type=int, default=20000)
    parser.add_argument("--cprofile", action="store_true")
    args = parser.parse_args()
    for batch_size in args.batch_size:
        service = make_service(batch_size)
        frames = [make_frame(i, batch_size) for i in range(64)]
        if args.cprofile:
            profiler = cProfile.Profile()
            profiler.enable()
            for i in range(args.frames):
                one_frame(service, frames[i % 64])
            profiler.disable()
            print(f"\n== batchSize {batch_size}, {args.frames} frames")
            pstats.Stats(profiler).sort_stats("tottime").print_stats(25)
            continue
        best = float("inf")
        for _ in range(5):
            start = time.perf_counter()
            for i in range(args.frames):
                one_frame(service, frames[i % 64])
            best = min(best, (time.perf_counter() - start) / args.frames)
        print(f"batchSize {batch_size}: {best * 1e6:.1f} us per frame, {best * 1e6 / batch_size:.1f} us per request "
              "(decode + predict + encode)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
