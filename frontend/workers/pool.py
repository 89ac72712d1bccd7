"""The workers of one model version: scale up (spawn), scale down (drain first), stop all."""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
from collections.abc import Callable

from frontend.batching.model_batcher import ModelBatcher
from frontend.metrics import ServerMetrics
from frontend.workers.worker import Worker, WorkerSpec, WorkerState

log = logging.getLogger(__name__)

# Worker ids are unique for the server's lifetime, like TorchServe's (which start at port 9000).
_worker_ids = itertools.count(9000)


class WorkerPool:
    def __init__(self, spec: WorkerSpec, batcher: ModelBatcher, metrics: ServerMetrics, num_gpus: int = 0) -> None:
        self.spec = spec
        # Called when the last worker has stopped: jobs still queued would wait forever otherwise.
        self._on_empty: Callable[[], None] | None = None
        self.batcher = batcher
        self.metrics = metrics
        self.num_gpus = num_gpus
        self.workers: list[Worker] = []  # serving or starting; the newest last (scaled down first)
        self._retiring: set[Worker] = set()  # draining after a scale-down
        self._retire_tasks: set[asyncio.Task[None]] = set()
        self._lock = asyncio.Lock()  # one scale operation at a time per model version
        self._next_gpu = 0
        batcher.add_listener(self.wake_all)

    def set_on_empty(self, callback: Callable[[], None]) -> None:
        self._on_empty = callback

    @property
    def num_workers(self) -> int:
        return len(self.workers)

    def wake_all(self) -> None:
        """The batcher's listener: some worker may have new work. Cheap, synchronous."""
        for worker in self.workers:
            worker.wake()
        for worker in self._retiring:
            worker.wake()

    def all_workers(self) -> list[Worker]:
        return self.workers + sorted(self._retiring, key=lambda w: w.worker_id)

    def count_by_state(self) -> dict[str, int]:
        counts: collections.Counter[str] = collections.Counter({s.name.lower(): 0 for s in WorkerState})
        for worker in self.all_workers():
            counts[worker.state.name.lower()] += 1
        return dict(counts)

    def _gpu_for_new_worker(self) -> int:
        if self.num_gpus <= 0:
            return -1
        gpu = self._next_gpu % self.num_gpus
        self._next_gpu += 1
        return gpu

    async def scale(self, target: int, synchronous: bool) -> list[str]:
        """Run ``target`` workers. Synchronous: wait until new workers loaded (or failed) and retired
        ones drained; returns the load failures (empty when all is well)."""
        async with self._lock:
            added: list[Worker] = []
            while len(self.workers) < target:
                worker = Worker(
                    str(next(_worker_ids)), self.spec, self.batcher, self.metrics,
                    gpu_id=self._gpu_for_new_worker(), wake_pool=self.wake_all,
                )
                self.workers.append(worker)
                worker.start()
                added.append(worker)
            retiring: list[asyncio.Task[None]] = []
            while len(self.workers) > target:
                retiring.append(self._retire(self.workers.pop()))
        if not synchronous:
            return []
        errors = [msg for msg in await asyncio.gather(*(w.first_load() for w in added)) if msg]
        if retiring:
            await asyncio.gather(*retiring, return_exceptions=True)
        return errors

    def _retire(self, worker: Worker) -> asyncio.Task[None]:
        """Drain one worker in the background: in-flight work finishes, queued work goes to others."""
        self._retiring.add(worker)

        async def retire() -> None:
            try:
                await worker.stop()
            finally:
                self._retiring.discard(worker)
                self._check_empty()

        task = asyncio.create_task(retire(), name=f"retire-{worker.worker_id}")
        self._retire_tasks.add(task)
        task.add_done_callback(self._retire_tasks.discard)
        return task

    async def stop(self, timeout: float | None = None) -> None:
        """Stop every worker: each drains, then gets SHUTDOWN; past ``timeout`` it is killed."""
        async with self._lock:
            workers, self.workers = self.workers, []
            for worker in workers:
                self._retiring.add(worker)
            await asyncio.gather(*(w.stop(timeout) for w in workers), return_exceptions=True)
            for worker in workers:
                self._retiring.discard(worker)
            if self._retire_tasks:
                await asyncio.gather(*list(self._retire_tasks), return_exceptions=True)
            self._check_empty()

    def _check_empty(self) -> None:
        if not self.workers and not self._retiring and self._on_empty is not None:
            self._on_empty()
