"""The model registry: model name → versions → (config, job queue, workers), plus a default version.

Registration opens the archive (in a thread), resolves the model's configuration (precedence in
frontend/config/model_config.py), builds its ModelBatcher and WorkerPool, and starts workers.
All mutations run on the event loop; a per-registry lock keeps register/unregister/set-default
from interleaving half-done.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from collections.abc import Iterator, Mapping

from backend.archive import ModelArchive
from frontend.batching.model_batcher import ModelBatcher
from frontend.config import ModelConfig, ServerConfig, resolve_model_config
from frontend.errors import (
    Conflict, Forbidden, ModelLoadError, ModelNotFound, ModelVersionNotFound, NoWorkers,
)
from frontend.jobs import Job, JobState
from frontend.metrics import ServerMetrics
from frontend.models.loader import install_dependencies, is_remote, open_model
from frontend.sinks import report_failure
from frontend.workers import WorkerPool, WorkerSpec

log = logging.getLogger(__name__)


@dataclass(eq=False)
class ModelVersion:
    """One registered version. ``config`` is frozen; the worker targets change with scaling."""

    name: str
    version: str
    url: str
    archive: ModelArchive
    config: ModelConfig
    batcher: ModelBatcher
    pool: WorkerPool
    extract_dir: Path  # owned by this registration, removed with it
    loaded_at_startup: bool = False
    downloaded: Path | None = None  # a remote archive saved in the model store: deleted on unregister
    min_workers: int = 0
    max_workers: int = 0
    registered_at: float = field(default_factory=time.time)

    def submit(self, job: Job) -> None:
        """Queue a job; 503 when no worker is configured at all, or when the queue is full."""
        if self.pool.num_workers == 0:
            raise NoWorkers(f"No worker is available to serve request for model '{self.name}' "
                            f"version {self.version}: scale the model up first")
        self.batcher.submit(job)

    def fail_queued(self) -> None:
        """The version has no worker left (scaled to 0, unregistered): answer what still waits."""
        error = NoWorkers(f"model '{self.name}' version {self.version} has no worker any more "
                          "(scaled to 0 or unregistered)")
        while (job := self.batcher.queue.pop()) is not None:
            job.transition(JobState.FAILED)
            report_failure(job, error)
        for job, failure in self.batcher.tick():  # sequences that lost their worker
            report_failure(job, failure)

    async def probe_workers(self, timeout: float) -> dict[str, dict[str, int] | None]:
        """Every worker's backend state, probed at once (``Worker.probe_state``): None for a worker
        that is not serving or did not answer within ``timeout`` seconds."""
        workers = self.pool.all_workers()
        answers = await asyncio.gather(*(w.probe_state(timeout) for w in workers))
        return {w.worker_id: answer for w, answer in zip(workers, answers)}

    def describe(self, default_version: str, backend: Mapping[str, dict[str, int] | None] | None = None) -> dict[str, Any]:
        """TorchServe's describe-model fields, plus the rest of model-config.yaml's keys, and the
        state the server holds (``state``, per model and per worker: every count is 0 once a load
        ended, but the bounded tombstones). ``backend``: probe answers by worker id, shown as each
        worker's ``state.backend``."""
        cfg = self.config
        queue_depth = self.batcher.queue_depth
        return {
            "modelName": self.name,
            "modelVersion": self.version,
            "modelUrl": self.url,
            "runtime": str(self.archive.manifest.get("runtime", "python")),
            "minWorkers": self.min_workers,
            "maxWorkers": self.max_workers,
            "batchSize": cfg.batch_size,
            "maxBatchDelay": cfg.max_batch_delay_ms,
            "loadedAtStartup": self.loaded_at_startup,
            "isDefaultVersion": self.version == default_version,
            **{k: v for k, v in cfg.to_describe().items() if k not in ("minWorkers", "maxWorkers", "batchSize", "maxBatchDelay")},
            "workers": [
                {
                    "id": w.worker_id,
                    "startTime": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(w.start_time)) + "Z",
                    "status": w.state.describe_name,
                    "memoryUsage": 0,
                    "pid": w.pid if w.pid is not None else -1,
                    "gpu": w.gpu_id >= 0,
                    "gpuUsage": "N/A",
                    "restarts": w.num_restarts,
                    **({"lastError": w.last_error} if w.last_error else {}),
                    # Sequence models: the open sequences pinned to this worker (count and ids).
                    **({"sequences": table.describe_worker(w.worker_id)} if (table := self.batcher.sequences) else {}),
                    "state": {**w.describe_state(),
                              **({"backend": backend.get(w.worker_id)} if backend is not None else {})},
                }
                for w in self.pool.all_workers()
            ],
            "jobQueueStatus": {
                "remainingCapacity": max(0, cfg.job_queue_size - queue_depth),
                "pendingRequests": queue_depth,
            },
            **({"sequences": sequences} if (sequences := self.batcher.describe_sequences()) is not None else {}),
            "state": self.batcher.describe_state(),
        }


@dataclass
class ModelEntry:
    versions: dict[str, ModelVersion] = field(default_factory=dict)
    default_version: str = ""

    @property
    def default(self) -> ModelVersion:
        return self.versions[self.default_version]


class ModelRegistry:
    def __init__(self, config: ServerConfig, metrics: ServerMetrics, clock: Any = time.monotonic) -> None:
        self.config = config
        self.metrics = metrics
        self.clock = clock
        self.models: dict[str, ModelEntry] = {}
        self._lock = asyncio.Lock()
        # Short paths: Unix socket paths are limited to ~107 bytes.
        self.work_dir = Path(tempfile.mkdtemp(prefix="conveyor-"))
        self.sock_dir = self.work_dir / "s"
        self.sock_dir.mkdir()
        self.models_dir = self.work_dir / "models"
        self.models_dir.mkdir()
        metrics.watch_state(self._sample)
        metrics.watch_sequences(self._sample_sequences)

    def _sample(self) -> Iterator[tuple[str, str, int, dict[str, int]]]:
        for name, entry in list(self.models.items()):
            for version, model in list(entry.versions.items()):
                yield name, version, model.batcher.queue_depth, model.pool.count_by_state()

    def _sample_sequences(self) -> Iterator[tuple[str, str, dict[str, int]]]:
        for model in self.all_versions():
            if (counts := model.batcher.describe_sequences()) is not None:
                yield model.name, model.version, counts

    # Lookups ------------------------------------------------------------------------------------

    def get(self, name: str, version: str | None = None) -> ModelVersion:
        entry = self.models.get(name)
        if entry is None:
            raise ModelNotFound(f"Model not found: {name}")
        if not version:
            return entry.default
        model = entry.versions.get(version)
        if model is None:
            raise ModelVersionNotFound(f"Model version: {version} does not exist for model: {name}")
        return model

    def entry(self, name: str) -> ModelEntry:
        entry = self.models.get(name)
        if entry is None:
            raise ModelNotFound(f"Model not found: {name}")
        return entry

    def all_versions(self) -> list[ModelVersion]:
        return [m for entry in self.models.values() for m in entry.versions.values()]

    # Mutations ----------------------------------------------------------------------------------

    async def register(
        self,
        url: str,
        model_name: str | None = None,
        handler: str | None = None,
        api_params: Mapping[str, Any] | None = None,
        initial_workers: int | None = None,
        synchronous: bool = True,
        at_startup: bool = False,
    ) -> tuple[ModelVersion, list[str]]:
        """Open, configure and start a model version. Returns it and the workers' load failures
        (synchronous only). A synchronous registration whose workers all fail is rolled back."""
        extract_dir = Path(tempfile.mkdtemp(dir=self.models_dir))
        downloaded: Path | None = None
        try:
            archive = await open_model(self.config, url, extract_dir, model_name, handler)
            downloaded = archive.source if is_remote(url) else None
            name, version = archive.model_name, archive.model_version
            source = f"model-config.yaml of {archive.source.name}"
            if archive.config_file is not None:
                source = f"{archive.config_file.name} in {archive.source.name}"
            defaults = self.config.default_workers_per_model if at_startup else self.config.configured_workers_per_model
            config = resolve_model_config(
                self.config, name, version, archive.model_yaml_config, source,
                api_params=api_params, initial_workers=initial_workers, default_workers=defaults,
            )
            async with self._lock:
                if name in self.models and version in self.models[name].versions:
                    raise Conflict(f"Model version {version} for model {name} is already registered")
                # Workers read the configured sequence header names from TorchServe's variables.
                env = {**os.environ, **sequence_header_env(self.config)}
                if self.config.install_py_dep_per_model:
                    env.update(await install_dependencies(archive))
                model = self._build(name, version, url, archive, config, source, extract_dir, env, at_startup)
                model.downloaded = downloaded
                entry = self.models.setdefault(name, ModelEntry())
                entry.versions[version] = model
                json_entry = self.config.models.get(name, {}).get(version, {})
                if not entry.default_version or (at_startup and json_entry.get("defaultVersion") is True):
                    entry.default_version = version
        except BaseException:
            shutil.rmtree(extract_dir, ignore_errors=True)
            if downloaded is not None:
                downloaded.unlink(missing_ok=True)
            raise
        log.info("model '%s' version %s registered from %s (%d workers)", name, version, url, config.min_workers)
        errors = await self.scale(model, config.min_workers, config.max_workers, synchronous)
        if errors and len(errors) >= config.min_workers and not at_startup:
            await self.unregister(name, version, force=True)
            raise ModelLoadError(f"Failed to start workers for model '{name}' version {version}: {errors[0]}")
        return model, errors

    def _build(self, name: str, version: str, url: str, archive: ModelArchive, config: ModelConfig, source: str,
               extract_dir: Path, env: Mapping[str, str] | None, at_startup: bool) -> ModelVersion:
        batch_config = config.to_batch_config(self.config.sequence_end_header)
        # Validates the batching keys (InvalidConfig naming key, value and source).
        batcher = ModelBatcher(name, batch_config, self.clock, source)
        spec = WorkerSpec(
            model_name=name, model_version=version, model_dir=str(archive.model_dir), handler=archive.handler,
            batch_size=config.batch_size, max_request_size=self.config.max_request_size,
            max_response_size=self.config.max_response_size, startup_timeout=float(config.startup_timeout_s),
            response_timeout=float(config.response_timeout_s), max_retry_timeout=float(config.max_retry_timeout_s),
            manifest=archive.manifest, model_yaml_config=load_yaml_config(config), sock_dir=self.sock_dir, env=env,
        )
        pool = WorkerPool(spec, batcher, self.metrics, num_gpus=self.config.number_of_gpu)
        model = ModelVersion(name, version, url, archive, config, batcher, pool, extract_dir, at_startup)
        pool.set_on_empty(model.fail_queued)
        return model

    async def scale(self, model: ModelVersion, min_workers: int, max_workers: int, synchronous: bool) -> list[str]:
        """Run ``min_workers`` workers (no autoscaling yet: max_workers is recorded for describe)."""
        model.min_workers, model.max_workers = min_workers, max_workers
        return await model.pool.scale(min_workers, synchronous)

    def set_default(self, name: str, version: str) -> None:
        entry = self.entry(name)
        if version not in entry.versions:
            raise ModelVersionNotFound(f"Model version: {version} does not exist for model: {name}")
        entry.default_version = version

    async def unregister(self, name: str, version: str | None = None, force: bool = False) -> None:
        """Remove a version: its workers drain (in-flight work finishes), then stop."""
        async with self._lock:
            entry = self.entry(name)
            version = version or entry.default_version
            model = entry.versions.get(version)
            if model is None:
                raise ModelVersionNotFound(f"Model version: {version} does not exist for model: {name}")
            if version == entry.default_version and len(entry.versions) > 1 and not force:
                raise Forbidden(f"Cannot remove default version {version} for model {name}; "
                                "set another default version first")
            del entry.versions[version]
            if not entry.versions:
                del self.models[name]
            elif entry.default_version == version:
                entry.default_version = sorted(entry.versions)[-1]
        await self._stop_model(model, timeout=None)
        if model.downloaded is not None:  # TorchServe removes a downloaded archive with its model
            model.downloaded.unlink(missing_ok=True)
        log.info("model '%s' version %s unregistered", name, version)

    async def _stop_model(self, model: ModelVersion, timeout: float | None) -> None:
        try:
            await model.pool.stop(timeout)
        finally:
            await _remove_tree(model.extract_dir)

    async def close(self, timeout: float) -> None:
        """Server shutdown: stop every model's workers (each drains for up to ``timeout`` s)."""
        models = self.all_versions()  # idempotent: a second call finds nothing to stop
        self.models.clear()
        await asyncio.gather(*(self._stop_model(m, timeout) for m in models), return_exceptions=True)
        await _remove_tree(self.work_dir)


def sequence_header_env(config: ServerConfig) -> dict[str, str]:
    """TorchServe's environment variables naming the sequence headers (``ts_header_key_sequence_*``):
    the worker's Context reads ``header_key_sequence_id`` / ``_start`` / ``_end`` from them."""
    return {
        "TS_REQUEST_SEQUENCE_ID": config.sequence_id_header,
        "TS_REQUEST_SEQUENCE_START": config.sequence_start_header,
        "TS_REQUEST_SEQUENCE_END": config.sequence_end_header,
    }


def load_yaml_config(config: ModelConfig) -> dict[str, Any]:
    """model-config.yaml as LOAD hands it to the handler (``context.model_yaml_config``): the archive's
    yaml with the EFFECTIVE batching policy. A register parameter (``continuous_batching``) or the
    ``models`` JSON entry may set it without the yaml saying so, and a handler that streams one step
    per frame only when continuousBatching is on must agree with the aggregator the frontend runs."""
    return {**config.raw, "continuousBatching": config.continuous_batching,
            "sequenceBatching": config.sequence_batching}


async def _remove_tree(path: Path) -> None:
    """Extracted models can be large: delete them off the event loop."""
    await asyncio.get_running_loop().run_in_executor(None, functools.partial(shutil.rmtree, path, ignore_errors=True))
