"""Backend worker processes: spawn, supervise, and the per-worker step loop."""

from frontend.workers.pool import WorkerPool
from frontend.workers.worker import Worker, WorkerSpec, WorkerState

__all__ = ["Worker", "WorkerPool", "WorkerSpec", "WorkerState"]
