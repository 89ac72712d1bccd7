"""The ``conveyor`` command: ``start``, ``serve``, ``stop``, ``status`` and ``archive``.

``conveyor start`` takes TorchServe's flags, so scripts written for ``torchserve --start`` keep
working (``conveyor --start ...`` and ``conveyor --stop`` are accepted too). Without
``--foreground`` the server runs in the background: the command returns once the server printed
``Model server started.`` (or failed, showing the end of its log). A pid file lets ``conveyor stop``
and ``conveyor status`` find it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import logging.config
import os
import select
import signal
import subprocess
import sys
import tempfile
import urllib.error
import urllib.request
from pathlib import Path
from collections.abc import Sequence

from frontend.config import ServerConfig, load_server_config, locate_config_file
from frontend.errors import InvalidConfig
from frontend.serve import add_serve_parser, cmd_serve

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
STOP_TIMEOUT = 60.0  # seconds `conveyor stop` waits before it kills (at least the server's grace + 30 s)


def default_pid_file() -> Path:
    return Path(os.environ.get("CONVEYOR_PID_FILE") or Path(tempfile.gettempdir()) / ".conveyor.pid")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="conveyor", description="Conveyor model server")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{start,serve,stop,status,archive}")

    start = sub.add_parser("start", help="start the model server")
    start.add_argument("--model-store", help="directory of model archives")
    start.add_argument("--models", nargs="+", metavar="MODEL",
                       help="models to load at start: name=file.mar, file.mar or all (space or comma separated)")
    start.add_argument("--ts-config", "--config", dest="ts_config", help="config.properties file")
    start.add_argument("--foreground", action="store_true", help="run in the foreground (default: background)")
    start.add_argument("--ncs", "--no-config-snapshots", dest="ncs", action="store_true",
                       help="accepted for TorchServe compatibility (Conveyor writes no snapshots)")
    start.add_argument("--disable-token-auth", action="store_true", help="disable token authorization")
    start.add_argument("--enable-model-api", action="store_true", help="allow register/unregister over the API")
    start.add_argument("--log-config", help="logging config (.json/.yaml dictConfig or .ini fileConfig)")
    start.add_argument("--pid-file", type=Path, default=None, help="pid file (default: $CONVEYOR_PID_FILE or "
                       "<tmp>/.conveyor.pid)")
    start.add_argument("--ready-fd", type=int, default=None, help=argparse.SUPPRESS)

    for name, text in (("stop", "stop the running model server"), ("status", "show whether a server runs")):
        cmd = sub.add_parser(name, help=text)
        cmd.add_argument("--pid-file", type=Path, default=None)
        if name == "stop":
            cmd.add_argument("--timeout", type=float, default=None, help="seconds before the server is killed "
                             f"(default: {STOP_TIMEOUT:g}, or the server's graceful_shutdown_timeout + 30 if longer)")

    sub.add_parser("archive", help="build a model archive (torch-model-archiver's flags)", add_help=False)
    add_serve_parser(sub)  # `conveyor serve MODEL_DIR`: a checkpoint directory, no archive (frontend/serve.py)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    if args_list and args_list[0] in ("--start", "--stop"):  # torchserve-style invocation
        args_list[0] = args_list[0][2:]
    if args_list and args_list[0] == "archive":
        from backend.archiver import main as archiver_main  # lazy: only this command needs it

        return archiver_main(args_list[1:])
    args = build_parser().parse_args(args_list)
    if args.command == "start":
        return cmd_start(args)
    if args.command == "serve":
        return cmd_serve(args)
    if args.command == "stop":
        return cmd_stop(args.pid_file or default_pid_file(), args.timeout)
    return cmd_status(args.pid_file or default_pid_file())


# start -------------------------------------------------------------------------------------------


def _overrides(args: argparse.Namespace) -> dict[str, str]:
    overrides: dict[str, str] = {}
    if args.model_store:
        overrides["model_store"] = args.model_store
    if args.models:
        overrides["load_models"] = ",".join(m for entry in args.models for m in entry.split(",") if m.strip())
    if args.enable_model_api:
        overrides["enable_model_api"] = "true"
    if args.disable_token_auth:
        overrides["disable_token_authorization"] = "true"
    return overrides


def _check_startup_models(config: ServerConfig) -> None:
    """Fail fast, before anything forks or listens, when a startup model's file is missing."""
    for entry in config.load_models:
        if entry.lower() == "all":
            continue
        url = entry.partition("=")[2] if "=" in entry else entry
        url = url.strip()
        if url.startswith(("http://", "https://")):
            continue
        path = Path(url.removeprefix("file://")).expanduser()
        if not path.is_absolute():
            if config.model_store is None:
                raise InvalidConfig(f"model '{entry}' is a relative path but no model store is set (--model-store)")
            path = config.model_store / path
        if not path.exists():
            raise InvalidConfig(f"model file not found: {path} (from --models / load_models entry '{entry}')")


def _setup_logging(log_config: str | None) -> None:
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT, stream=sys.stderr)
    logging.getLogger("frontend.server.access").setLevel(logging.WARNING)  # per-request lines: opt in
    if not log_config:
        return
    path = Path(log_config)
    if not path.is_file():
        raise InvalidConfig(f"log config {path} does not exist")
    suffix = path.suffix.lower()
    try:
        if suffix == ".json":
            logging.config.dictConfig(json.loads(path.read_text()))
        elif suffix in (".yaml", ".yml"):
            import yaml

            logging.config.dictConfig(yaml.safe_load(path.read_text()))
        elif suffix == ".xml":  # TorchServe's log4j2.xml: keep old scripts working
            logging.getLogger(__name__).warning("log4j2 XML config %s ignored; using default logging", path)
        else:
            logging.config.fileConfig(path, disable_existing_loggers=False)
    except (ValueError, KeyError, TypeError, OSError) as exc:
        raise InvalidConfig(f"log config {path} is invalid: {exc}") from None


def cmd_start(args: argparse.Namespace) -> int:
    pid_file: Path = args.pid_file or default_pid_file()
    try:
        config_file = locate_config_file(args.ts_config, Path.cwd())
        config = load_server_config(config_file, _overrides(args))
        _check_startup_models(config)
        running = _read_pid_file(pid_file)
        if running is not None and _alive(running["pid"]):
            raise InvalidConfig(f"a server is already running (pid {running['pid']}, pid file {pid_file}); "
                                "stop it with `conveyor stop` or use another --pid-file")
    except InvalidConfig as exc:
        print(f"conveyor: error: {exc.message}", file=sys.stderr)
        return 2
    if not args.foreground:
        return _start_background(args, pid_file, config)
    try:
        _setup_logging(args.log_config)
    except InvalidConfig as exc:
        print(f"conveyor: error: {exc.message}", file=sys.stderr)
        return 2
    return _run_foreground(config, pid_file, args.ready_fd)


def _run_foreground(config: ServerConfig, pid_file: Path, ready_fd: int | None) -> int:
    import uvloop

    from frontend.server import STARTED_MESSAGE, serve

    def on_started() -> None:
        print(STARTED_MESSAGE, flush=True)
        if ready_fd is not None:
            os.write(ready_fd, b"started\n")
            os.close(ready_fd)

    pid_file.parent.mkdir(parents=True, exist_ok=True)
    pid_file.write_text(json.dumps({
        "pid": os.getpid(), "inference": config.inference_address.url,
        "management": config.management_address.url, "metrics": config.metrics_address.url,
        "graceful_shutdown_timeout": config.graceful_shutdown_timeout,  # `conveyor stop` waits longer than this
    }))
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    try:
        return asyncio.run(serve(config, on_started))
    finally:
        current = _read_pid_file(pid_file)
        if current is not None and current["pid"] == os.getpid():
            pid_file.unlink(missing_ok=True)


def _start_background(args: argparse.Namespace, pid_file: Path, config: ServerConfig) -> int:
    log_dir = Path(os.environ.get("LOG_LOCATION", "logs"))
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / "conveyor.log"
    read_fd, write_fd = os.pipe()
    argv = [sys.executable, "-m", "frontend.cli", "start", "--foreground", "--pid-file", str(pid_file),
            "--ready-fd", str(write_fd)]
    for flag, value in (("--model-store", args.model_store), ("--ts-config", args.ts_config),
                        ("--log-config", args.log_config)):
        if value:
            argv += [flag, value]
    if args.models:
        argv += ["--models", *args.models]
    argv += [flag for flag, on in (("--enable-model-api", args.enable_model_api),
                                   ("--disable-token-auth", args.disable_token_auth)) if on]
    with log_path.open("ab") as log_file:
        child = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log_file, stderr=log_file,
                                 pass_fds=(write_fd,), start_new_session=True)
    os.close(write_fd)
    # Bounded wait: loading may take up to the startup timeout, plus time to listen.
    timeout = config.default_startup_timeout + 30
    ready, _, _ = select.select([read_fd], [], [], timeout)
    message = os.read(read_fd, 64) if ready else b""
    os.close(read_fd)
    if message.startswith(b"started"):
        print(f"Model server started. (pid {child.pid}; log {log_path}; inference {config.inference_address.url})")
        return 0
    if child.poll() is None:
        child.terminate()
    tail = log_path.read_text(errors="replace").splitlines()[-20:]
    print(f"conveyor: error: the server did not start{' within %d s' % timeout if not ready else ''}; "
          f"last lines of {log_path}:\n" + "\n".join(tail), file=sys.stderr)
    return 1


# stop / status -----------------------------------------------------------------------------------


def _read_pid_file(pid_file: Path) -> dict | None:
    try:
        data = json.loads(pid_file.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and isinstance(data.get("pid"), int) else None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _wait_exit(pid: int, timeout: float) -> bool:
    """Wait for a process that is not our child, on a pidfd (an event, not a polling loop)."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    try:
        ready, _, _ = select.select([fd], [], [], timeout)
        return bool(ready)
    finally:
        os.close(fd)


def cmd_stop(pid_file: Path, timeout: float | None) -> int:
    info = _read_pid_file(pid_file)
    if info is None or not _alive(info["pid"]):
        print("Conveyor is not running.")
        pid_file.unlink(missing_ok=True)
        return 1
    pid = info["pid"]
    if timeout is None:  # never kill a server that is still within its own graceful shutdown
        grace = info.get("graceful_shutdown_timeout")
        timeout = max(STOP_TIMEOUT, float(grace) + 30.0) if isinstance(grace, (int, float)) else STOP_TIMEOUT
    os.kill(pid, signal.SIGTERM)
    if not _wait_exit(pid, timeout):
        print(f"Conveyor (pid {pid}) did not stop within {timeout:g} s; killing it", file=sys.stderr)
        os.kill(pid, signal.SIGKILL)
        _wait_exit(pid, 10.0)
        pid_file.unlink(missing_ok=True)  # its workers exit on the closed sockets
    print(f"Conveyor (pid {pid}) stopped.")
    return 0


def cmd_status(pid_file: Path) -> int:
    info = _read_pid_file(pid_file)
    if info is None or not _alive(info["pid"]):
        print("Conveyor is not running.")
        return 1
    health = "unknown"
    try:
        with urllib.request.urlopen(f"{info['inference']}/ping", timeout=2) as response:
            health = json.loads(response.read()).get("status", "unknown")
    except urllib.error.HTTPError as exc:  # /ping answers 500 when every model is down
        health = json.loads(exc.read() or b"{}").get("status", f"HTTP {exc.code}")
    except (OSError, ValueError) as exc:
        health = f"not answering ({exc})"
    print(f"Conveyor is running (pid {info['pid']}): {health}\n  inference  {info['inference']}\n"
          f"  management {info['management']}\n  metrics    {info['metrics']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
