"""``conveyor serve MODEL_DIR``: serve one Hugging Face checkpoint directory, no archive needed.

    conveyor serve ./my-model                          # http://127.0.0.1:8080, model name "my-model"
    conveyor serve ./my-model --port 8000 --batch-size 16 --served-model-name llm
    conveyor serve ./my-model --no-continuous-batching # static batching (for comparisons)

What it does: it writes a small *no-archive model directory* in a temporary directory — a
``MAR-INF/MANIFEST.json`` naming the built-in ``text_generation`` handler and a ``model-config.yaml``
whose ``handler.model_path`` is the checkpoint's absolute path — and starts the ordinary frontend in
the foreground with that directory as its one startup model. The checkpoint directory is only read,
never written. A ``model-config.yaml`` inside the checkpoint is used as the base (so a directory made
by ``build_tiny_llm.py`` keeps its settings); the flags override it.

Ports: inference ``--port`` (8080), management ``--management-port`` (port + 1), metrics
``--metrics-port`` (port + 2), all on ``--host`` (127.0.0.1). Other server settings (gRPC ports, queue
size, timeouts) come from ``--ts-config`` as for ``conveyor start``; token authorization too, on by
default (``--disable-token-auth`` turns it off; the ``openai`` client's ``api_key`` is sent as the
``Authorization: Bearer`` header the server checks). SIGINT (Ctrl-C) and SIGTERM stop it cleanly:
in-flight requests finish, workers drain, the temporary directory is removed.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import yaml

from frontend.errors import InvalidConfig

DEFAULT_PORT = 8080
DEFAULT_BATCH_SIZE = 16  # concurrent sequences per worker (vLLM's max_num_seqs), bounded by max_batch_tokens too
DEFAULT_MAX_BATCH_DELAY_MS = 5  # an idle worker waits this long for more requests to prefill together


def add_serve_parser(sub: Any) -> None:
    serve = sub.add_parser("serve", help="serve a Hugging Face checkpoint directory (text_generation handler)",
                           description="Serve one Hugging Face checkpoint directory with the text_generation "
                           "handler, no archive needed (docs/llm.md).")
    serve.add_argument("model_dir", type=Path, help="checkpoint directory (config.json, weights, tokenizer)")
    serve.add_argument("--served-model-name", help="model name in the API (default: the directory's basename)")
    serve.add_argument("--host", default="127.0.0.1", help="address of every API (default 127.0.0.1)")
    serve.add_argument("--port", type=int, default=DEFAULT_PORT, help="inference port: REST and /v1 (default 8080)")
    serve.add_argument("--management-port", type=int, help="default: --port + 1")
    serve.add_argument("--metrics-port", type=int, help="default: --port + 2")
    serve.add_argument("--continuous-batching", action=argparse.BooleanOptionalAction, default=None,
                       help="continuous batching (default: on); --no-continuous-batching runs static batches")
    serve.add_argument("--batch-size", type=int, help=f"max requests in the batch (default {DEFAULT_BATCH_SIZE})")
    serve.add_argument("--max-batch-delay", type=int, metavar="MS",
                       help=f"ms an idle worker waits to fill a batch (default {DEFAULT_MAX_BATCH_DELAY_MS})")
    serve.add_argument("--workers", type=int, help="worker processes, each with its own copy of the model (default 1)")
    serve.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], help="default float32")
    serve.add_argument("--max-batch-tokens", type=int, help="KV-cache budget in tokens (default 16384)")
    serve.add_argument("--prefill-chunk-size", type=int, help="max prompt tokens per prefill forward (default 256)")
    serve.add_argument("--max-new-tokens", type=int,
                       help="default for requests without one (else generation_config.json's, else 256)")
    serve.add_argument("--num-threads", type=int, help="torch threads per worker (default 1; 0 = torch's default)")
    serve.add_argument("--attn-implementation", help="e.g. sdpa or eager (default: transformers')")
    serve.add_argument("--trust-remote-code", action="store_true", help="allow the checkpoint's own modelling code")
    serve.add_argument("--disable-token-auth", action="store_true",
                       help="no token authorization (default: on, as for conveyor start; the openai client sends "
                            "the inference key of key_file.json as its api_key)")
    serve.add_argument("--ts-config", "--config", dest="ts_config", help="config.properties for other settings")
    serve.add_argument("--log-config", help="logging config (as for conveyor start)")
    serve.add_argument("--pid-file", type=Path, default=None, help="pid file (as for conveyor start)")


def model_config(args: argparse.Namespace, model_dir: Path) -> dict[str, Any]:
    """The checkpoint's model-config.yaml (if any) with the flags applied and model_path made absolute."""
    base: dict[str, Any] = {}
    own = model_dir / "model-config.yaml"
    if own.is_file():
        loaded = yaml.safe_load(own.read_text(encoding="utf-8"))
        if loaded is not None and not isinstance(loaded, dict):
            raise InvalidConfig(f"{own} must be a YAML mapping")
        base = dict(loaded or {})
    handler = dict(base.get("handler") or {})
    handler["model_path"] = str((model_dir / str(handler.get("model_path") or ".")).resolve())
    for flag, key in (("dtype", "dtype"), ("max_batch_tokens", "max_batch_tokens"),
                      ("prefill_chunk_size", "prefill_chunk_size"), ("max_new_tokens", "max_new_tokens"),
                      ("num_threads", "num_threads"), ("attn_implementation", "attn_implementation")):
        value = getattr(args, flag)
        if value is not None:
            handler[key] = value
    if args.trust_remote_code:
        handler["trust_remote_code"] = True
    config = {**base, "handler": handler}
    workers = args.workers if args.workers is not None else base.get("minWorkers", 1)
    config["minWorkers"] = config["maxWorkers"] = workers
    config["batchSize"] = args.batch_size if args.batch_size is not None else base.get("batchSize", DEFAULT_BATCH_SIZE)
    config["maxBatchDelay"] = (args.max_batch_delay if args.max_batch_delay is not None
                               else base.get("maxBatchDelay", DEFAULT_MAX_BATCH_DELAY_MS))
    continuous = args.continuous_batching
    config["continuousBatching"] = continuous if continuous is not None else base.get("continuousBatching", True)
    config.pop("sequenceBatching", None)  # one-shot generation: no sessions
    return config


def write_model_dir(root: Path, name: str, config: dict[str, Any]) -> Path:
    """The no-archive model directory the registry opens: a manifest and a model-config.yaml."""
    model_dir = root / "model"
    (model_dir / "MAR-INF").mkdir(parents=True)
    manifest = {"runtime": "python", "model": {"modelName": name, "modelVersion": "1.0",
                                               "handler": "text_generation", "configFile": "model-config.yaml"}}
    (model_dir / "MAR-INF" / "MANIFEST.json").write_text(json.dumps(manifest, indent=2), encoding="utf-8")
    (model_dir / "model-config.yaml").write_text(yaml.safe_dump(config, sort_keys=False), encoding="utf-8")
    return model_dir


def server_overrides(args: argparse.Namespace, model_dir: Path) -> dict[str, str]:
    port = args.port
    ports = {"inference": port, "management": args.management_port if args.management_port is not None else port + 1,
             "metrics": args.metrics_port if args.metrics_port is not None else port + 2}
    if port != 0 and len(set(ports.values())) < 3:
        raise InvalidConfig(f"--port, --management-port and --metrics-port must differ, got {ports}")
    overrides = {f"{api}_address": f"http://{args.host}:{p}" for api, p in ports.items()}
    overrides["load_models"] = str(model_dir)
    if args.disable_token_auth:
        overrides["disable_token_authorization"] = "true"
    return overrides


def _check_model_dir(model_dir: Path) -> None:
    if not model_dir.is_dir():
        raise InvalidConfig(f"model directory {model_dir} does not exist")
    if not (model_dir / "config.json").is_file():
        raise InvalidConfig(f"{model_dir} has no config.json: expected a Hugging Face checkpoint directory "
                            "(save_pretrained output)")


def cmd_serve(args: argparse.Namespace) -> int:
    from frontend.cli import _alive, _read_pid_file, _run_foreground, _setup_logging, default_pid_file
    from frontend.config import load_server_config, locate_config_file

    pid_file: Path = args.pid_file or default_pid_file()
    source = args.model_dir.expanduser().resolve()
    name = args.served_model_name or source.name
    work = Path(tempfile.mkdtemp(prefix="conveyor-serve-"))
    try:
        try:
            _check_model_dir(source)
            if not name or any(c in name for c in ",=") or name.startswith("."):
                raise InvalidConfig(f"model name {name!r} is not usable: no ',' or '=' and no leading '.'")
            synthesized = write_model_dir(work, name, model_config(args, source))
            config_file = locate_config_file(args.ts_config, Path.cwd())
            config = load_server_config(config_file, server_overrides(args, synthesized))
            running = _read_pid_file(pid_file)
            if running is not None and _alive(running["pid"]):
                raise InvalidConfig(f"a server is already running (pid {running['pid']}, pid file {pid_file}); "
                                    "stop it with `conveyor stop` or use another --pid-file")
            _setup_logging(args.log_config)
        except InvalidConfig as exc:
            print(f"conveyor: error: {exc.message}", file=sys.stderr)
            return 2
        print(f"Serving {source} as model '{name}' (text_generation, continuousBatching="
              f"{str(model_config(args, source)['continuousBatching']).lower()}) on {config.inference_address.url}",
              flush=True)
        return _run_foreground(config, pid_file, None)
    finally:
        shutil.rmtree(work, ignore_errors=True)
