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
