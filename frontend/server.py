"""The app factory and the server's lifecycle.

``ConveyorServer`` owns the shared state (config, registry, metrics) and builds one aiohttp
application per API. The inference app carries the lifecycle hook (``cleanup_ctx``): background
tasks start when the runners are set up and are cancelled and awaited at shutdown, after which
every model's workers drain and stop.

Shutdown order (SIGTERM, SIGINT or ``conveyor stop``; docs/reliability.md): stop accepting on every
port; let in-flight requests and streams finish (up to ``graceful_shutdown_timeout`` s, worker loops
still serving them); past that, stop every worker at once, which fails what is left with a 503
naming the cause; cancel the background tasks; drain and stop every worker (SHUTDOWN, then kill);
remove the socket and extraction directories and the key file.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import signal
import time
from dataclasses import dataclass
from typing import Protocol
from collections.abc import AsyncIterator, Callable, Sequence

from aiohttp import web

from frontend.api.common import Authorizer, GuardedAppRunner, InFlight, make_app
from frontend.api.fast_path import FastPath
from frontend.api.inference import InferenceApi
from frontend.api.kserve import KServeApi
from frontend.api.management import ManagementApi
from frontend.api.metrics import MetricsApi
from frontend.config import ServerConfig
from frontend.auth import TokenAuthorizer, make_authorizer
from frontend.errors import ConveyorError, InvalidConfig, ServiceUnavailable
from frontend.jobs import JobState
from frontend.metrics import ServerMetrics
from frontend.models import ModelRegistry
from frontend.openai.routes import OpenAIApi
from frontend.sinks import report_failure

log = logging.getLogger(__name__)

WORKER_STOP_GRACE = 5.0  # seconds workers get to drain once no request is in flight any more
FAIL_GRACE = 5.0  # seconds handlers get to write the shutdown error past graceful_shutdown_timeout
TICK_INTERVAL = 0.05  # seconds between time checks of every model (worker loops also check each step)
STARTED_MESSAGE = "Model server started."
_ARCHIVE_SUFFIXES = (".mar", ".tar.gz", ".tgz")


@dataclass(frozen=True, slots=True)
class StartupModel:
    """One ``load_models`` / ``--models`` entry: an optional name and a URL (path in the store)."""

    url: str
    name: str | None = None

    @classmethod
    def parse(cls, entry: str) -> StartupModel:
        name, sep, url = entry.partition("=")
        return cls(url.strip(), name.strip() or None) if sep else cls(entry.strip())


def startup_models(config: ServerConfig) -> list[StartupModel]:
    """Expand ``load_models`` ("all" = every archive or model directory in the model store)."""
    models: list[StartupModel] = []
    for entry in config.load_models:
        if entry.lower() != "all":
            models.append(StartupModel.parse(entry))
            continue
        if config.model_store is None:
            raise InvalidConfig("load_models=all needs a model store (--model-store or model_store)")
        for path in sorted(config.model_store.iterdir()):
            if path.name.endswith(_ARCHIVE_SUFFIXES) or (path.is_dir() and (path / "MAR-INF" / "MANIFEST.json").is_file()):
                models.append(StartupModel(path.name))
    return models


class Service(Protocol):
    """Another listener sharing the server's registry (e.g. the gRPC APIs of issue 8). Started
    after the HTTP APIs listen and before the startup models load; stopped before the workers."""

    name: str

    async def start(self) -> None: ...

    async def stop(self, grace: float) -> None: ...


ServiceFactory = Callable[["ConveyorServer"], Service]


def default_services() -> list[ServiceFactory]:
    """The extra services every `conveyor start` runs: the gRPC inference and management APIs."""
    # Imported here: the generated protobuf modules register TorchServe's message names in the
    # process-wide descriptor pool, which only the server process needs.
    from frontend.grpc_api.service import GrpcService

    return [GrpcService]


class ConveyorServer:
    def __init__(self, config: ServerConfig, authorizer: Authorizer | None = None,
                 clock: Callable[[], float] = time.monotonic, services: Sequence[ServiceFactory] = ()) -> None:
        self.config = config
        self.metrics = ServerMetrics()
        self.registry = ModelRegistry(config, self.metrics, clock)
        self.authorizer = authorizer or make_authorizer(config)
        self.in_flight = InFlight()  # requests being handled over every HTTP API
        self.clock = clock
        self._runners: dict[str, web.AppRunner] = {}  # API name → runner, in start order
        self._service_factories = list(services)
        self._services: list[Service] = []
        self._inference_api: InferenceApi | None = None  # made by create_apps; the fast path serves it too

    # App factory ----------------------------------------------------------------------------------

    def create_apps(self) -> dict[str, web.Application]:
        cfg = self.config
        guards = {"in_flight": self.in_flight, "body_timeout": cfg.request_body_timeout}
        inference = make_app("inference", self.metrics, self.authorizer, client_max_size=cfg.max_request_size, **guards)
        self._inference_api = InferenceApi(self.registry, cfg, self.metrics)
        self._inference_api.add_routes(inference)
        # KServe v1 / Open Inference v2 / /health (issue 11), before the OpenAI routes: it serves the shared
        # GET /v1/models/{m}. Readiness reads the drain flag that stop() sets first.
        KServeApi(self.registry, cfg, self.metrics, lambda: self.in_flight.closing).add_routes(inference)
        OpenAIApi(self.registry, cfg, self.metrics).add_routes(inference)  # /v1/* (OpenAI-compatible)
        inference.cleanup_ctx.append(self._lifecycle)
        # Registration bodies are tiny JSON; archives come by URL, never in the body.
        management = make_app("management", self.metrics, self.authorizer, client_max_size=1024 ** 2, **guards)
        if isinstance(self.authorizer, TokenAuthorizer):
            self.authorizer.add_routes(management)  # GET /token?type=inference|management
        ManagementApi(self.registry, cfg).add_routes(management)
        metrics = make_app("metrics", self.metrics, self.authorizer, **guards)
        MetricsApi(self.metrics).add_routes(metrics)
        return {"inference": inference, "management": management, "metrics": metrics}

    async def _lifecycle(self, app: web.Application) -> AsyncIterator[None]:
        tasks = [asyncio.create_task(self._tick_models(), name="tick-models")]
        yield
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self.registry.close(WORKER_STOP_GRACE)

    async def _tick_models(self) -> None:
        """Enforce time for every model even when no worker loop iterates (all busy, or none):
        queued jobs past clientTimeoutInMills get 408, expired sequences their error."""
        while True:
            await asyncio.sleep(TICK_INTERVAL)
            for model in self.registry.all_versions():
                for job, error in model.batcher.tick():
                    report_failure(job, error)

    # Lifecycle ------------------------------------------------------------------------------------

    async def start(self) -> None:
        """Listen on every API, then load the startup models (synchronously)."""
        cfg = self.config
        apps = self.create_apps()
        addresses = {"inference": cfg.inference_address, "management": cfg.management_address,
                     "metrics": cfg.metrics_address}
        self.authorizer.start()  # writes key_file.json (token auth on) before any port listens
        for name, app in apps.items():
            # handler_cancellation: a client that disconnects cancels its handler, which cancels the job.
            # stop() waits for in-flight requests itself; the runner's own wait is the last resort.
            access_log = log.getChild("access")
            # The inference port's hot routes skip aiohttp's per-request machinery (fast_path.py).
            front = FastPath(self._inference_api, self.authorizer, self.metrics, self.in_flight,
                             cfg.request_body_timeout, cfg.max_request_size, access_log) if name == "inference" else None
            runner = GuardedAppRunner(app, max_connections=cfg.max_connections, handler_cancellation=True,
                                      shutdown_timeout=FAIL_GRACE, access_log=access_log, front=front)
            await runner.setup()
            self._runners[name] = runner
            address = addresses[name]
            try:
                await web.TCPSite(runner, address.host, address.port).start()
            except OSError as exc:
                raise InvalidConfig(f"cannot listen on {address.url} ({name} API): {exc.strerror or exc}") from None
            log.info("%s API listening on %s", name.capitalize(), address.url)
        for factory in self._service_factories:
            service = factory(self)
            await service.start()
            self._services.append(service)
            log.info("%s started", service.name)
        await self.load_startup_models()

    def bound_ports(self) -> dict[str, int]:
        """The port each API listens on (useful with port 0 in configs)."""
        return {name: runner.addresses[0][1] for name, runner in self._runners.items() if runner.addresses}

    async def load_startup_models(self) -> None:
        async def load(model: StartupModel) -> None:
            registered, errors = await self.registry.register(model.url, model_name=model.name, synchronous=True,
                                                              at_startup=True)
            for error in errors:
                log.error("model '%s': %s", registered.name, error)

        results = await asyncio.gather(*(load(m) for m in startup_models(self.config)), return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException):
                raise result

    async def stop(self) -> None:
        """Graceful stop: stop accepting everywhere; in-flight requests and streams (every API and
        extra service) get ``graceful_shutdown_timeout`` s while the workers still serve them; past
        that, ``_fail_unfinished``; then the workers drain and stop (the inference runner's cleanup)."""
        grace = self.config.graceful_shutdown_timeout
        self.in_flight.closing = True  # new work on a keep-alive connection gets 503 (reads are answered)
        for runner in self._runners.values():
            for site in list(runner.sites):
                await site.stop()
            if runner.server is not None:
                runner.server.pre_shutdown()  # idle connections close now, busy ones after their response
        services, self._services = list(reversed(self._services)), []
        stopping = asyncio.gather(*(self._stop_service(s, grace) for s in services))
        if not await self.in_flight.wait_idle(grace):
            log.warning("%d requests still running after graceful_shutdown_timeout=%g s; failing them",
                        self.in_flight.count, grace)
            await self._fail_unfinished(grace)
            await self.in_flight.wait_idle(FAIL_GRACE)
        await stopping
        # The inference runner goes last: its cleanup stops the workers.
        for runner in reversed(list(self._runners.values())):
            await runner.cleanup()
        self._runners.clear()
        await self.registry.close(WORKER_STOP_GRACE)  # no-op when the lifecycle hook already did it
        self.authorizer.stop()  # removes key_file.json

    @staticmethod
    async def _stop_service(service: Service, grace: float) -> None:
        try:
            await service.stop(grace)
        except Exception:
            log.exception("stopping %s failed", service.name)

    async def _fail_unfinished(self, grace: float) -> None:
        """The grace is over: stop every worker at once; jobs in a backend fail with a 503 naming
        the cause (a stream ends with an error chunk), and so do jobs still queued."""
        reason = f"Conveyor is shutting down: the request did not finish within graceful_shutdown_timeout={grace:g} s"
        models = self.registry.all_versions()
        await asyncio.gather(*(w.stop(0.0, reason) for m in models for w in m.pool.all_workers()),
                             return_exceptions=True)
        error = ServiceUnavailable(reason)
        for model in models:
            while (job := model.batcher.queue.pop()) is not None:
                job.transition(JobState.FAILED)
                report_failure(job, error)


def _tune_gc() -> None:
    """Requests allocate many short-lived containers that reference counting frees; the cyclic
    collector's young-generation passes over them are pure cost on the hot path. Objects alive after
    start-up (modules, config, the apps) move to the permanent generation, and a young collection
    runs after 50,000 net allocations instead of 700."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(50_000, 20, 20)


async def serve(config: ServerConfig, on_started: Callable[[], None] | None = None) -> int:
    """Run until SIGTERM/SIGINT. Returns the process exit code."""
    server = ConveyorServer(config, services=default_services())
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        try:
            await server.start()
        except ConveyorError as exc:
            log.error("%s", exc.message)
            return 1
        log.info(STARTED_MESSAGE)
        if on_started is not None:
            on_started()
        _tune_gc()
        await stop.wait()
        log.info("stopping: finishing in-flight requests, then stopping workers")
        return 0
    finally:
        await server.stop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
        log.info("Model server stopped.")

