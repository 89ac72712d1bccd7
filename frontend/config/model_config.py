"""Per-model configuration: the keys of an archive's ``model-config.yaml``, frozen into ModelConfig.

Precedence for one model version, highest first (TorchServe's order, see ModelManager.createModel):

1. ``model-config.yaml`` inside the archive;
2. the server's ``models`` JSON entry for this name and version (config.properties);
3. register-API parameters (``batch_size``, ``max_batch_delay``, ``response_timeout``, ...);
4. server defaults (``job_queue_size``, ``default_response_timeout``, ``default_startup_timeout``,
   ``default_workers_per_model``), then built-in defaults.

The number of workers is the exception, as in TorchServe: ``initial_workers`` / ``min_worker``
given on the API win, since they are an explicit operator action on a running server.
Unknown top-level keys (TorchServe's ``deviceType``, ``parallelType``, ``torchrun``, ``pt2``...)
are kept in ``raw`` for the handler and are not errors; a wrong value of a known key is.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any
from collections.abc import Mapping

from frontend.batching.base import BatchConfig
from frontend.config.server_config import ServerConfig
from frontend.config.values import as_bool, as_dict, as_int, fail

# model-config.yaml key → (ModelConfig field, kind, minimum). "ms" and "s" are integer durations.
_KEYS: dict[str, tuple[str, str, int]] = {
    "minWorkers": ("min_workers", "int", 0),
    "maxWorkers": ("max_workers", "int", 0),
    "batchSize": ("batch_size", "int", 1),
    "maxBatchDelay": ("max_batch_delay_ms", "int", 0),
    "responseTimeout": ("response_timeout_s", "int", 1),
    "startupTimeout": ("startup_timeout_s", "int", 1),
    "jobQueueSize": ("job_queue_size", "int", 1),
    "continuousBatching": ("continuous_batching", "bool", 0),
    "sequenceBatching": ("sequence_batching", "bool", 0),
    "sequenceMaxIdleMSec": ("sequence_max_idle_ms", "int", 0),
    "sequenceTimeoutMSec": ("sequence_timeout_ms", "int", 0),
    "maxNumSequence": ("max_num_sequence", "int", 1),
    "maxSequenceJobQueueSize": ("max_sequence_job_queue_size", "int", 1),
    "sequenceStrictStart": ("sequence_strict_start", "bool", 0),
    "clientTimeoutInMills": ("client_timeout_ms", "int", 0),
    "maxRetryTimeoutInSec": ("max_retry_timeout_s", "int", 1),
    "sequenceTombstoneTtlMSec": ("sequence_tombstone_ttl_ms", "int", 0),
    "maxSequenceTombstones": ("max_sequence_tombstones", "int", 0),
}


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """One model version's settings, resolved. Durations keep TorchServe's units in their names."""

    min_workers: int = 1
    max_workers: int = 1
    batch_size: int = 1
    max_batch_delay_ms: int = 100
    response_timeout_s: int = 120
    startup_timeout_s: int = 120
    job_queue_size: int = 100
    continuous_batching: bool = False
    sequence_batching: bool = False
    sequence_max_idle_ms: int = 0
    sequence_timeout_ms: int = 0  # 0: no absolute limit
    max_num_sequence: int = 1
    max_sequence_job_queue_size: int = 1
    sequence_strict_start: bool = False
    client_timeout_ms: int = 0  # 0: a queued job never expires
    max_retry_timeout_s: int = 300
    sequence_tombstone_ttl_ms: int = 600_000  # closed/expired sequence ids stay rejected this long
    max_sequence_tombstones: int = 100_000
    handler: Mapping[str, Any] = field(default_factory=dict)  # the yaml's `handler:` section
    raw: Mapping[str, Any] = field(default_factory=dict)  # the whole model-config.yaml, for LOAD

    def to_batch_config(self, sequence_end_header: str = "ts_request_sequence_end") -> BatchConfig:
        return BatchConfig(
            batch_size=self.batch_size,
            max_batch_delay=self.max_batch_delay_ms / 1000.0,
            job_queue_size=self.job_queue_size,
            continuous=self.continuous_batching,
            sequence=self.sequence_batching,
            sequence_max_idle=self.sequence_max_idle_ms / 1000.0,
            sequence_timeout=self.sequence_timeout_ms / 1000.0 if self.sequence_timeout_ms else None,
            max_num_sequence=self.max_num_sequence,
            max_sequence_job_queue_size=self.max_sequence_job_queue_size,
            sequence_strict_start=self.sequence_strict_start,
            tombstone_ttl=self.sequence_tombstone_ttl_ms / 1000.0,
            max_tombstones=self.max_sequence_tombstones,
            sequence_end_header=sequence_end_header,
        )

    def to_describe(self) -> dict[str, Any]:
        """The config part of TorchServe's describe-model response (camelCase, TorchServe units)."""
        return {yaml_key: getattr(self, name) for yaml_key, (name, _, _) in _KEYS.items()}


def _read(values: Mapping[str, Any], source: str) -> dict[str, Any]:
    """Validate the known keys of one layer; returns ModelConfig field → value."""
    out: dict[str, Any] = {}
    for key, value in values.items():
        spec = _KEYS.get(key)
        if spec is None:
            continue
        name, kind, minimum = spec
        out[name] = as_bool(key, value, source) if kind == "bool" else as_int(key, value, source, minimum=minimum)
    return out


def resolve_model_config(
    server: ServerConfig,
    model_name: str,
    model_version: str,
    yaml_config: Mapping[str, Any] | None,
    yaml_source: str,
    api_params: Mapping[str, Any] | None = None,
    initial_workers: int | None = None,
    default_workers: int | None = None,
) -> ModelConfig:
    """Merge the layers described in the module docstring and check the cross-key rules.

    ``api_params`` uses model-config.yaml key names (the API layer translates ``batch_size`` →
    ``batchSize``); ``initial_workers`` overrides min/max workers when given; ``default_workers``
    is the worker count when nothing else sets one (startup models: ``default_workers_per_model``;
    the register API: 0 unless that key was set explicitly, as in TorchServe).
    """
    if default_workers is None:
        default_workers = server.default_workers_per_model
    yaml_config = as_dict("model-config.yaml", yaml_config, yaml_source)
    fields: dict[str, Any] = {
        "job_queue_size": server.job_queue_size,
        "response_timeout_s": server.default_response_timeout,
        "startup_timeout_s": server.default_startup_timeout,
        "min_workers": default_workers,
        "max_workers": default_workers,
    }
    json_entry = server.models.get(model_name, {}).get(model_version, {})
    layers = [
        _read(api_params or {}, "the register request"),
        _read(json_entry, f"config.properties `models` entry for {model_name} {model_version}"),
        _read(yaml_config, yaml_source),
    ]
    for layer in layers:  # lowest priority first
        fields.update(layer)
    if not any("max_workers" in layer for layer in layers):
        fields["max_workers"] = fields["min_workers"]  # maxWorkers defaults to minWorkers
    if initial_workers is not None:
        fields["min_workers"] = fields["max_workers"] = initial_workers
    handler = as_dict("handler", yaml_config.get("handler"), yaml_source)

    config = ModelConfig(**fields, handler=handler, raw=dict(yaml_config))
    if config.max_workers < config.min_workers:
        raise fail("maxWorkers", config.max_workers, yaml_source, f"must be >= minWorkers ({config.min_workers})")
    if config.sequence_batching and config.sequence_max_idle_ms <= 0:
        # TorchServe's trap: with idle 0 every sequence expires at once and all requests fail.
        raise fail("sequenceMaxIdleMSec", config.sequence_max_idle_ms, yaml_source,
                   "must be > 0 when sequenceBatching is true")
    return config
