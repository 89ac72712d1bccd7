"""The backend worker process: one model, one Unix-socket connection, one frame at a time.

    python -m backend.worker --sock-path PATH --worker-id ID [--log-level INFO]
                             [--max-request-size BYTES] [--num-threads N] [--accept-timeout SECONDS]

Lifecycle:

1. Bind PATH (a stale file is removed first), listen, print exactly one line to stdout and flush::

       CONVEYOR_WORKER_LISTENING pid=<pid> sock=<path>

   From then on stdout is redirected to stderr, so a frontend may stop reading it. All logging goes
   to stderr, every line prefixed ``[<worker id>]``.
2. Accept ONE connection. While waiting, exit (1) if the parent process goes away or after
   ``--accept-timeout`` seconds: a worker never outlives the frontend that started it.
3. Serve messages (backend/protocol.py) until SHUTDOWN or end of stream (exit 0). LOAD → LOAD_REPLY
   (200 / 500 / 507); INFER → zero or more INFER_REPLY(final=False) then one INFER_REPLY(final=True);
   PING → PONG(nonce). After an INFER's final reply of a continuous-batching model, if no next
   message is waiting, the handler's optional ``step_ahead`` hook runs (backend/service.py: decode
   ahead). A malformed frame, or a message a worker never receives (LOAD_REPLY, ...), is
   logged and the worker exits 2: the frontend restarts it, never the server.

The model directory becomes the working directory at LOAD, as in TorchServe. Intra-op threads are
set by ``--num-threads`` (default 1: several workers share the cores), through OMP_NUM_THREADS
before any torch import and ``torch.set_num_threads`` after the handler loaded.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import socket
import sys
import time
from collections.abc import Sequence

from backend.context import SERVER_VERSION, Context
from backend.errors import describe, is_out_of_memory
from backend.handler_loader import load_handler
from backend.protocol import (
    DEFAULT_MAX_PAYLOAD,
    ConnectionClosed,
    InferReply,
    InferRequest,
    LoadReply,
    LoadRequest,
    Ping,
    Pong,
    ProtocolError,
    RequestState,
    Shutdown,
    WireResult,
    SocketReader,
    send_message,
)
from backend.service import Service

READY_PREFIX = "CONVEYOR_WORKER_LISTENING"
EXIT_OK = 0
EXIT_ERROR = 1
EXIT_PROTOCOL = 2

logger = logging.getLogger("conveyor.worker")


class _PrefixFormatter(logging.Formatter):
    """Prefix every line of a record (tracebacks included) with the worker id."""

    def __init__(self, worker_id: str) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s - %(message)s")
        self.prefix = f"[{worker_id}] "

    def format(self, record: logging.LogRecord) -> str:
        return "\n".join(self.prefix + line for line in super().format(record).splitlines())


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m backend.worker", description="Conveyor backend worker")
    p.add_argument("--sock-path", "--sock", dest="sock_path", required=True, help="Unix socket path to listen on")
    p.add_argument("--worker-id", required=True, help="shown in every log line, e.g. W-echo-1")
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    p.add_argument("--max-request-size", type=int, default=6553500, help="bytes, per request (bounds INFER frames)")
    p.add_argument("--num-threads", type=int, default=1, help="torch intra-op threads")
    p.add_argument("--accept-timeout", type=float, default=120.0, help="seconds to wait for the frontend")
    return p.parse_args(argv)


def setup_logging(worker_id: str, level: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_PrefixFormatter(worker_id))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)


def listen(path: str) -> socket.socket:
    if os.path.lexists(path):
        os.unlink(path)  # a stale socket of a previous worker
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(1)
    return server


def accept(server: socket.socket, timeout: float) -> socket.socket | None:
    """The frontend's connection, or None if the parent died or the timeout passed."""
    parent = os.getppid()
    deadline = time.monotonic() + timeout
    server.settimeout(0.25)  # short, so a dead parent is noticed quickly
    while True:
        try:
            conn, _ = server.accept()
        except TimeoutError:
            if os.getppid() != parent:
                logger.error("parent process %d is gone; exiting", parent)
                return None
            if time.monotonic() > deadline:
                logger.error("no connection within %.0f s; exiting", timeout)
                return None
            continue
        conn.settimeout(None)
        return conn


def load_model(req: LoadRequest, num_threads: int, send) -> tuple[Service | None, LoadReply]:
    try:
        manifest = json.loads(req.manifest_json or "{}")
        if not isinstance(manifest, dict):
            manifest = {}
        model = manifest.setdefault("model", {})
        model.setdefault("modelName", req.model_name)
        model.setdefault("handler", req.handler)
        yaml_config = json.loads(req.model_yaml_config_json or "{}")
        context = Context(req.model_name, req.model_dir, manifest, req.batch_size,
                          None if req.gpu_id < 0 else req.gpu_id, SERVER_VERSION, True, None,
                          yaml_config if isinstance(yaml_config, dict) else {})
        if os.path.isdir(req.model_dir):
            os.chdir(req.model_dir)  # TorchServe runs handlers with the model dir as cwd
        handler = load_handler(req.handler or model["handler"], req.model_dir, context)
        torch = sys.modules.get("torch")
        if torch is not None:
            torch.set_num_threads(num_threads)
    except Exception as exc:  # the reply carries it; the frontend decides to retry or give up
        status = 507 if is_out_of_memory(exc) else 500
        logger.error("failed to load model %s with handler %r", req.model_name, req.handler, exc_info=True)
        return None, LoadReply(status, f"failed to load model {req.model_name}: {describe(exc)}")
    logger.info("loaded model %s (handler %s, batch size %d)", req.model_name, handler.description, req.batch_size)
    service = Service(handler, context, req.max_response_size, send)
    return service, LoadReply(200, f"loaded model {req.model_name}")


def serve(conn: socket.socket, args: argparse.Namespace) -> int:
    max_payload = DEFAULT_MAX_PAYLOAD + args.max_request_size
    service: Service | None = None
    reader = SocketReader(conn)

    def send(msg) -> None:
        send_message(conn, msg)

    while True:
        try:
            msg = reader.recv_message(max_payload)
        except ConnectionClosed as exc:
            logger.info("frontend closed the connection%s; exiting", " mid-frame" if exc.partial else "")
            return EXIT_OK
        except ProtocolError as exc:
            logger.error("protocol error from the frontend: %s; exiting", exc)
            return EXIT_PROTOCOL
        if isinstance(msg, InferRequest):
            if service is None:
                send(InferReply(msg.frame_id, True, tuple(
                    WireResult(r.request_id, 503, True, "model not loaded in this worker")
                    for r in msg.requests if r.state != RequestState.CANCEL)))
            else:
                send(service.predict(msg))
                # Decode ahead: the frontend now reads this reply and builds the next frame; instead of
                # idling meanwhile, let the handler start its next step (never when a frame is waiting,
                # so a CANCEL already sent is not kept waiting behind a step run for nothing).
                if service.can_step_ahead and not reader.input_ready():
                    service.step_ahead()
        elif isinstance(msg, Ping):
            send(Pong(msg.nonce))
        elif isinstance(msg, LoadRequest):
            if service is not None:
                send(LoadReply(500, f"a model is already loaded in this worker ({service.context.model_name})"))
                continue
            service, reply = load_model(msg, args.num_threads, send)
            if service is not None:
                batch = max(1, msg.batch_size)
                max_payload = max(max_payload, batch * args.max_request_size + (1 << 20))
            send(reply)
        elif isinstance(msg, Shutdown):
            logger.info("shutdown requested; exiting")
            return EXIT_OK
        else:
            logger.error("unexpected %s from the frontend; exiting", type(msg).__name__)
            return EXIT_PROTOCOL


def _terminate(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)  # unwinds through finally: the socket file is removed


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    setup_logging(args.worker_id, args.log_level)
    # Before any torch import, so the thread pools start at the right size.
    os.environ["OMP_NUM_THREADS"] = str(args.num_threads)
    signal.signal(signal.SIGTERM, _terminate)
    path = os.path.abspath(args.sock_path)
    server: socket.socket | None = None
    inode = None
    try:
        server = listen(path)
        inode = os.stat(path).st_ino
        print(f"{READY_PREFIX} pid={os.getpid()} sock={path}", flush=True)
        os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # handler prints must never block on a stdout pipe
        sys.stdout = sys.stderr
        conn = accept(server, args.accept_timeout)
        if conn is None:
            return EXIT_ERROR
        # Ctrl-C in a terminal reaches the whole process group; the frontend decides when we stop.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        with conn:
            return serve(conn, args)
    except (BrokenPipeError, ConnectionResetError):
        logger.info("frontend went away; exiting")
        return EXIT_OK
    except KeyboardInterrupt:
        return 130
    except Exception:
        logger.critical("worker crashed", exc_info=True)
        return EXIT_ERROR
    finally:
        if server is not None:
            server.close()
            # Only our own file: a replacement worker may already have bound the same path.
            if os.path.lexists(path) and os.stat(path).st_ino == inode:
                os.unlink(path)


if __name__ == "__main__":
    sys.exit(main())
