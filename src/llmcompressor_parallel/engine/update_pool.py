"""Run a layer's independent update jobs on the per-device worker threads.

Why: after calibration, a layer's weight updates (GPTQ's batches of same-shape
modules, above all the linearised MoE experts) do not depend on each other, so they
can run on every GPU at once. This module only moves tensors and schedules; the
update function is the caller's (stock library code), so a job gives the same bits
on any device of the same kind as it gives on its home device.

Rules, from DESIGN.md:
- one job (the smallest, so the serial part stays short) runs first in the
  caller's thread on its home device, so lazy set-up (Triton JIT, solver handles)
  happens once before the workers start;
- the workers then take the others largest first (the longest job must not start
  last); a worker takes the next job that fits its device's free memory; a device
  without room is skipped with a log line, and a job no device has room for runs
  in the caller's thread on its home device, as stock would run it;
- results stay on the device that computed them, and nothing is written anywhere
  here: the caller writes back only once every job has succeeded;
- a failing worker stops the others from taking new jobs and is re-raised by the
  pool as `ReplicaError` naming the device.
"""

from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Generic, Iterator, Sequence, TypeVar

import torch
from loguru import logger
from torch.utils._pytree import tree_map

from llmcompressor_parallel.engine.thread_context import ThreadContext
from llmcompressor_parallel.engine.worker_pool import DeviceWorkerPool

__all__ = ["UpdateJob", "UpdateResult", "run_update_jobs"]

R = TypeVar("R")

_MIB = 1024**2


@dataclass(frozen=True)
class UpdateJob:
    """One independent unit of work and what it needs.

    :param name: how the job is called in log lines
    :param inputs: a pytree of tensors (and plain values), copied to the device
        that runs the job; the update function must not modify them in place
    :param home: the device the serial (stock) code would run the job on
    :param bytes_needed: estimated peak device memory of the job, inputs included
    """

    name: str
    inputs: Any
    home: torch.device
    bytes_needed: int


@dataclass(frozen=True)
class UpdateResult(Generic[R]):
    """What a job returned, where it ran and how long it took (copies included).

    `worker` is the pool worker's index, or None for the calling thread.
    """

    value: R
    device: torch.device
    worker: int | None
    seconds: float

    @property
    def place(self) -> str:
        """Where the job ran, for log lines."""
        thread = "caller" if self.worker is None else f"worker {self.worker}"
        return f"{thread} ({self.device})"


UpdateFn = Callable[[Any, torch.device], R]


def run_update_jobs(
    pool: DeviceWorkerPool, jobs: Sequence[UpdateJob], update: UpdateFn
) -> list[UpdateResult]:
    """Run `update(inputs_on_device, device)` for every job; results in job order."""
    if not jobs:
        return []
    context = ThreadContext.capture()
    results: list[UpdateResult | None] = [None] * len(jobs)
    warm_up = min(range(len(jobs)), key=lambda index: jobs[index].bytes_needed)
    results[warm_up] = _run_job(jobs[warm_up], jobs[warm_up].home, None, update, context)
    queue = _JobQueue(jobs, taken=warm_up)
    if queue.has_pending():
        pool.run(
            [
                _worker_loop(queue, worker, device, update, context, results)
                for worker, device in enumerate(pool.devices)
            ]
        )
    for index in queue.take_all():
        job = jobs[index]
        logger.info(
            "update pool: no worker device has room for {} (needs ~{}): "
            "running it in the calling thread on {}",
            job.name,
            _size(job.bytes_needed),
            job.home,
        )
        results[index] = _run_job(job, job.home, None, update, context)
    return results  # type: ignore[return-value]


class _JobQueue:
    """Jobs not yet taken, shared by the workers: largest first, first fit by memory."""

    def __init__(self, jobs: Sequence[UpdateJob], taken: int):
        self.jobs = jobs
        self._pending = sorted(
            (index for index in range(len(jobs)) if index != taken),
            key=lambda index: -jobs[index].bytes_needed,
        )
        self._reserved: dict[torch.device, int] = {}
        self._stopped = False
        self._lock = threading.Lock()

    def has_pending(self) -> bool:
        with self._lock:
            return bool(self._pending)

    def take(self, device: torch.device, free: int | None) -> int | None:
        """The next job that fits `free` bytes (None: no limit), reserved for `device`.

        Returns None when the queue is empty or stopped, or nothing fits; in the
        last case the device is skipped with a log line.
        """
        with self._lock:
            if self._stopped or not self._pending:
                return None
            room = None if free is None else free - self._reserved.get(device, 0)
            for position, index in enumerate(self._pending):
                need = self.jobs[index].bytes_needed
                if room is None or need <= room:
                    del self._pending[position]
                    self._reserved[device] = self._reserved.get(device, 0) + need
                    return index
            smallest = min(self.jobs[index].bytes_needed for index in self._pending)
            remaining = len(self._pending)
        logger.info(
            "update pool: skipping {} for the remaining {} job(s) of this layer: "
            "~{} free, the smallest needs ~{}",
            device,
            remaining,
            _size(room),
            _size(smallest),
        )
        return None

    def release(self, device: torch.device, index: int) -> None:
        with self._lock:
            self._reserved[device] -= self.jobs[index].bytes_needed

    def stop(self) -> None:
        """A worker failed: no one takes further jobs."""
        with self._lock:
            self._stopped = True

    def take_all(self) -> list[int]:
        with self._lock:
            if self._stopped:
                return []
            taken, self._pending = self._pending, []
            return taken


def _worker_loop(
    queue: _JobQueue,
    worker: int,
    device: torch.device,
    update: UpdateFn,
    context: ThreadContext,
    results: list[UpdateResult | None],
) -> Callable[[], None]:
    """The job one worker runs: take jobs that fit its device until none is left."""

    def loop() -> None:
        while True:
            index = queue.take(device, _free_bytes(device))
            if index is None:
                return
            try:
                job = queue.jobs[index]
                results[index] = _run_job(job, device, worker, update, context)
            except BaseException:
                queue.stop()
                raise
            finally:
                queue.release(device, index)

    return loop


def _run_job(
    job: UpdateJob,
    device: torch.device,
    worker: int | None,
    update: UpdateFn,
    context: ThreadContext,
) -> UpdateResult:
    start = time.perf_counter()
    with context.applied(), _on_device(device):
        value = update(_copy_to(job.inputs, device), device)
        if device.type == "cuda":
            # surface asynchronous errors here, in the thread that names the device
            torch.cuda.synchronize(device)
    return UpdateResult(value, device, worker, time.perf_counter() - start)


def _copy_to(tree: Any, device: torch.device) -> Any:
    """Blocking copy of every tensor of `tree` to `device` (no-op where it already is).

    Blocking, because a non-blocking device-to-host copy may be read before it lands.
    """
    return tree_map(
        lambda value: value.to(device) if isinstance(value, torch.Tensor) else value,
        tree,
    )


@contextlib.contextmanager
def _on_device(device: torch.device) -> Iterator[None]:
    """Make `device` current: kernels launched by index (Triton) follow it."""
    if device.type != "cuda":
        yield
        return
    with torch.cuda.device(device):
        yield


def _free_bytes(device: torch.device) -> int | None:
    """Memory a job may use on `device`: free plus cached-but-unused; None for CPU."""
    if device.type != "cuda":
        return None
    free, _total = torch.cuda.mem_get_info(device)
    cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return free + cached


def _size(num_bytes: int) -> str:
    """Bytes for log lines: GiB with two decimals, MiB below 1 GiB."""
    if abs(num_bytes) >= 1024 * _MIB:
        return f"{num_bytes / (1024 * _MIB):.2f} GiB"
    return f"{num_bytes / _MIB:.1f} MiB"
