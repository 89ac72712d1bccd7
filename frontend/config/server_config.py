"""Server-wide configuration: TorchServe's ``config.properties`` keys, frozen into one typed object.

Where values come from, highest priority first (TorchServe's order):

1. environment variables ``TS_<KEY>`` (e.g. ``TS_JOB_QUEUE_SIZE``), only when the file sets
   ``enable_envvars_config=true``;
2. command-line flags (``--model-store``, ``--models``, ``--enable-model-api``, ...);
3. the properties file: ``$TS_CONFIG_FILE``, else ``--ts-config``, else ``./config.properties``;
4. built-in defaults (``DEFAULTS`` below).

``$$NAME$$`` inside a property value is replaced by the environment variable NAME (TorchServe's
syntax); an unset variable is a configuration error. Unknown keys are kept (``extra``) and logged,
not refused: real TorchServe files carry netty/JVM keys that mean nothing here.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from collections.abc import Mapping
from urllib.parse import urlsplit

from frontend.config.values import as_bool, as_int, as_str, fail
from frontend.errors import InvalidConfig

log = logging.getLogger(__name__)

# Every key this server reads, with its default as the properties file would spell it.
DEFAULTS: dict[str, str] = {
    "inference_address": "http://127.0.0.1:8080",
    "management_address": "http://127.0.0.1:8081",
    "metrics_address": "http://127.0.0.1:8082",
    "grpc_inference_port": "7070",
    "grpc_management_port": "7071",
    "model_store": "",
    "load_models": "",
    "models": "",
    "default_workers_per_model": "0",  # 0: number of GPUs, else number of CPU cores (TorchServe)
    "job_queue_size": "100",
    "default_response_timeout": "120",  # seconds
    "default_startup_timeout": "120",  # seconds
    "max_request_size": "6553500",  # bytes
    "max_response_size": "6553500",  # bytes
    "enable_model_api": "false",
    "disable_token_authorization": "false",
    "ts_header_key_sequence_id": "ts_request_sequence_id",
    "ts_header_key_sequence_start": "ts_request_sequence_start",
    "ts_header_key_sequence_end": "ts_request_sequence_end",
    "install_py_dep_per_model": "false",
    "allowed_urls": r"file://.*|http(s)?://.*",
    "number_of_gpu": "0",
    "enable_envvars_config": "false",
    "default_service_handler": "",
    # Reliability and access control (docs/reliability.md).
    "token_expiration_min": "60",  # TorchServe's: minutes the inference and management keys live
    "token_key_file": "",  # where key_file.json goes; "" = ./key_file.json (TorchServe: the working dir)
    "allow_paths_outside_model_store": "false",  # register API: absolute paths / file:// outside the store
    "max_connections": "1024",  # open connections per HTTP listener; more get 503
    "graceful_shutdown_timeout": "30",  # seconds in-flight requests get at SIGTERM / `conveyor stop`
    "request_body_timeout": "60",  # seconds a client may take to send a request body; then 408
}

# TorchServe keys accepted for compatibility that have no effect here (no JVM, no netty, no snapshots).
IGNORED_KEYS = frozenset({
    "number_of_netty_threads", "netty_client_threads", "async_logging", "vmargs", "model_snapshot",
    "snapshot_store", "prefer_direct_buffer", "use_native_io", "io_ratio", "metric_time_interval",
    "cors_allowed_origin", "cors_allowed_methods", "cors_allowed_headers", "decode_input_request",
    "blacklist_env_vars", "model_server_home", "workflow_store", "unregister_model_timeout",
    "enable_metrics_api", "metrics_mode", "metrics_config", "metrics_format", "tsConfigFile",
    "service_envelope", "debug", "enable_grpc_ssl", "keystore", "keystore_pass", "keystore_type",
    "private_key_file", "certificate_file", "grpc_inference_address", "grpc_management_address",
    "disable_system_metrics", "system_metrics_cmd", "workflow_store", "limit_max_image_pixels",
    "initial_worker_port", "initial_distribution_port", "use_env_allowed_urls", "default_gpu",
    "maxRetryTimeoutInSec",
})

_ENV_REF = re.compile(r"\$\$([^$]+)\$\$")


@dataclass(frozen=True, slots=True)
class Address:
    """Where one HTTP API listens; parsed from TorchServe's ``http://host:port`` form."""

    host: str
    port: int

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @classmethod
    def parse(cls, key: str, value: str, source: str) -> Address:
        parts = urlsplit(value if "://" in value else f"http://{value}")
        if parts.scheme == "https":
            raise fail(key, value, source, "https listeners are not supported yet (terminate TLS in a proxy)")
        if parts.scheme != "http" or not parts.hostname:
            raise fail(key, value, source, "expected http://HOST:PORT")
        try:
            port = parts.port
        except ValueError:
            raise fail(key, value, source, "port must be 0-65535") from None
        if port is None:
            raise fail(key, value, source, "expected http://HOST:PORT (the port is missing)")
        return cls(parts.hostname, port)


@dataclass(frozen=True, slots=True)
class ServerConfig:
    """Everything server-wide, typed and immutable after start. Times in seconds, sizes in bytes."""

    inference_address: Address
    management_address: Address
    metrics_address: Address
    grpc_inference_port: int
    grpc_management_port: int
    model_store: Path | None
    load_models: tuple[str, ...]  # raw entries: "all", "name=file.mar", "file.mar"
    models: Mapping[str, Mapping[str, Mapping[str, Any]]]  # `models` JSON: name → version → keys
    default_workers_per_model: int  # resolved: never 0
    configured_workers_per_model: int  # as configured (0: unset); the register API's default
    job_queue_size: int
    default_response_timeout: int
    default_startup_timeout: int
    max_request_size: int
    max_response_size: int
    enable_model_api: bool
    disable_token_authorization: bool
    sequence_id_header: str  # lower-cased: aiohttp headers compare case-insensitively anyway
    sequence_start_header: str
    sequence_end_header: str
    install_py_dep_per_model: bool
    allowed_urls: tuple[re.Pattern[str], ...]
    number_of_gpu: int
    default_service_handler: str
    config_file: Path | None  # the properties file read, if any
    token_expiration_min: float = 60.0
    token_key_file: Path | None = None  # None: key_file.json in the working directory at start
    allow_paths_outside_model_store: bool = False
    max_connections: int = 1024
    graceful_shutdown_timeout: float = 30.0
    request_body_timeout: float = 60.0
    extra: Mapping[str, str] = field(default_factory=dict)  # unknown keys, kept for handlers/logs

    def url_allowed(self, url: str) -> bool:
        return any(p.fullmatch(url) for p in self.allowed_urls)


def parse_properties(text: str) -> dict[str, str]:
    """Java ``.properties`` syntax: ``key=value``, ``key: value`` or ``key value``; ``#``/``!``
    comments; a trailing backslash continues the line (TorchServe's ``models`` JSON uses that)."""
    logical: list[str] = []
    pending = ""
    for raw in text.splitlines():
        line = raw.lstrip() if pending else raw.strip()
        if not pending and (not line or line[0] in "#!"):
            continue
        trailing = len(line) - len(line.rstrip("\\"))
        if trailing % 2 == 1:  # an odd number of backslashes: continuation
            pending += line[:-1]
            continue
        logical.append(pending + line)
        pending = ""
    if pending:
        logical.append(pending)
    out: dict[str, str] = {}
    for line in logical:
        match = re.match(r"((?:\\.|[^=:\s\\])+)\s*[=:\s]\s*(.*)$", line, re.S)
        key, value = (match.group(1), match.group(2)) if match else (line, "")
        out[_unescape(key)] = _unescape(value.strip())
    return out


def _unescape(text: str) -> str:
    return re.sub(r"\\(.)", lambda m: {"n": "\n", "t": "\t", "r": "\r"}.get(m.group(1), m.group(1)), text)


def _resolve_env_refs(props: dict[str, str], source: str) -> None:
    for key, value in props.items():
        def sub(match: re.Match[str], key: str = key) -> str:
            name = match.group(1)
            if name not in os.environ:
                raise fail(key, value, source, f"environment variable {name} is not set")
            return os.environ[name]

        props[key] = _ENV_REF.sub(sub, value)


def locate_config_file(cli_path: str | None, cwd: Path) -> Path | None:
    """TorchServe's search order: $TS_CONFIG_FILE, --ts-config, ./config.properties."""
    env_path = os.environ.get("TS_CONFIG_FILE")
    if env_path:
        path = Path(env_path)
        if not path.is_file():
            raise InvalidConfig(f"TS_CONFIG_FILE points to {path}, which is not a file")
        return path
    if cli_path:
        path = Path(cli_path)
        if not path.is_file():
            raise InvalidConfig(f"config file {path} (--ts-config) does not exist")
        return path
    default = cwd / "config.properties"
    return default if default.is_file() else None


def load_server_config(
    config_file: Path | None,
    overrides: Mapping[str, str] | None = None,
    environ: Mapping[str, str] | None = None,
    cpu_count: int | None = None,
) -> ServerConfig:
    """Read ``config_file`` (may be None), apply CLI ``overrides`` (already in property form) and,
    when enabled, ``TS_*`` environment variables; validate every value into a ServerConfig."""
    environ = os.environ if environ is None else environ
    props: dict[str, str] = {}
    source = "built-in defaults"
    if config_file is not None:
        source = str(config_file)
        try:
            props = parse_properties(config_file.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError) as exc:
            raise InvalidConfig(f"cannot read config file {config_file}: {exc}") from None
        _resolve_env_refs(props, source)
    origin = {key: source for key in props}
    for key, value in (overrides or {}).items():
        props[key], origin[key] = value, "the command line"
    if as_bool("enable_envvars_config", props.get("enable_envvars_config", "false"), origin.get("enable_envvars_config", source)):
        for key in DEFAULTS:
            env_value = environ.get(f"TS_{key.upper()}")
            if env_value is not None:
                props[key], origin[key] = env_value, f"environment variable TS_{key.upper()}"

    def get(key: str) -> tuple[str, str]:
        return props.get(key, DEFAULTS[key]), origin.get(key, "built-in defaults")

    def integer(key: str, minimum: int = 0) -> int:
        value, where = get(key)
        return as_int(key, value, where, minimum=minimum)

    def boolean(key: str) -> bool:
        value, where = get(key)
        return as_bool(key, value, where)

    def positive_number(key: str, allow_zero: bool = False) -> float:
        value, where = get(key)
        try:
            number = float(value)
        except ValueError:
            raise fail(key, value, where, "must be a number") from None
        if not math.isfinite(number) or number < 0 or (number == 0 and not allow_zero):
            raise fail(key, value, where, "must be >= 0" if allow_zero else "must be > 0")
        return number

    def address(key: str) -> Address:
        value, where = get(key)
        return Address.parse(key, as_str(key, value, where), where)

    store_value, store_where = get("model_store")
    model_store = Path(store_value).expanduser().resolve() if store_value else None
    if model_store is not None and not model_store.is_dir():
        raise fail("model_store", store_value, store_where, "is not a directory")

    models_value, models_where = get("models")
    models: dict[str, Any] = {}
    if models_value.strip():
        try:
            models = json.loads(models_value)
        except json.JSONDecodeError as exc:
            raise fail("models", models_value, models_where, f"is not valid JSON ({exc.msg})") from None
        if not isinstance(models, dict) or not all(
            isinstance(v, dict) and all(isinstance(c, dict) for c in v.values()) for v in models.values()
        ):
            raise fail("models", models_value, models_where, 'expected {"name": {"version": {...}}}')

    urls_value, urls_where = get("allowed_urls")
    allowed: list[re.Pattern[str]] = []
    for pattern in filter(None, (p.strip() for p in urls_value.split(","))):
        try:
            allowed.append(re.compile(pattern))
        except re.error as exc:
            raise fail("allowed_urls", pattern, urls_where, f"is not a regular expression ({exc})") from None

    number_of_gpu = integer("number_of_gpu")
    workers = configured_workers = integer("default_workers_per_model")
    if workers == 0:  # TorchServe: one per GPU, else one per CPU core
        workers = number_of_gpu or cpu_count or os.cpu_count() or 1

    load_value, _ = get("load_models")
    headers = {}
    for key in ("ts_header_key_sequence_id", "ts_header_key_sequence_start", "ts_header_key_sequence_end"):
        value, where = get(key)
        if not re.fullmatch(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+", value.strip()):
            raise fail(key, value, where, "must be a valid HTTP header name")
        headers[key] = value.strip().lower()

    for key in props:
        if key not in DEFAULTS and key not in IGNORED_KEYS:
            log.warning("unknown configuration key '%s' in %s (ignored)", key, origin.get(key, source))

    return ServerConfig(
        inference_address=address("inference_address"),
        management_address=address("management_address"),
        metrics_address=address("metrics_address"),
        grpc_inference_port=integer("grpc_inference_port"),
        grpc_management_port=integer("grpc_management_port"),
        model_store=model_store,
        load_models=tuple(filter(None, (m.strip() for m in load_value.split(",")))),
        models=models,
        default_workers_per_model=workers,
        configured_workers_per_model=configured_workers,
        job_queue_size=integer("job_queue_size", minimum=1),
        default_response_timeout=integer("default_response_timeout", minimum=1),
        default_startup_timeout=integer("default_startup_timeout", minimum=1),
        max_request_size=integer("max_request_size", minimum=1),
        max_response_size=integer("max_response_size", minimum=1),
        enable_model_api=boolean("enable_model_api"),
        disable_token_authorization=boolean("disable_token_authorization"),
        sequence_id_header=headers["ts_header_key_sequence_id"],
        sequence_start_header=headers["ts_header_key_sequence_start"],
        sequence_end_header=headers["ts_header_key_sequence_end"],
        install_py_dep_per_model=boolean("install_py_dep_per_model"),
        allowed_urls=tuple(allowed),
        number_of_gpu=number_of_gpu,
        default_service_handler=get("default_service_handler")[0].strip(),
        config_file=config_file,
        token_expiration_min=positive_number("token_expiration_min"),
        token_key_file=Path(key_file).expanduser() if (key_file := get("token_key_file")[0].strip()) else None,
        allow_paths_outside_model_store=boolean("allow_paths_outside_model_store"),
        max_connections=integer("max_connections", minimum=1),
        graceful_shutdown_timeout=positive_number("graceful_shutdown_timeout", allow_zero=True),
        request_body_timeout=positive_number("request_body_timeout"),
        extra={k: v for k, v in props.items() if k not in DEFAULTS},
    )
