"""Server health over the default version of every model, TorchServe's rule: Healthy when every
model has its wanted workers ready, Partial Healthy when some are, Unhealthy when none are."""

from __future__ import annotations

from frontend.models.registry import ModelRegistry
from frontend.workers import WorkerState


def health_status(registry: ModelRegistry) -> str:
    wanted = ready = 0
    for entry in registry.models.values():
        model = entry.default
        wanted += model.min_workers
        ready += sum(1 for w in model.pool.all_workers() if w.state == WorkerState.READY)
    if 0 < ready < wanted:
        return "Partial Healthy"
    if ready == 0 and wanted > 0:
        return "Unhealthy"
    return "Healthy"


def unhealthy_models(registry: ModelRegistry) -> dict[str, dict[str, object]]:
    """The default versions with fewer ready workers than wanted, for ``/ping``'s body: their
    ready / wanted counts and the last error of a failing worker (e.g. the exit status and stderr
    of a worker that keeps dying in ``initialize``)."""
    out: dict[str, dict[str, object]] = {}
    for name, entry in sorted(registry.models.items()):
        model = entry.default
        workers = model.pool.all_workers()
        ready = sum(1 for w in workers if w.state == WorkerState.READY)
        if ready >= model.min_workers:
            continue
        report: dict[str, object] = {"version": model.version, "readyWorkers": ready, "minWorkers": model.min_workers}
        errors = [w for w in workers if w.last_error]
        if errors:
            report["lastError"] = errors[-1].last_error
        out[name] = report
    return out
