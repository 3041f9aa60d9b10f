"""Run a layer's independent update jobs on the per-device worker threads.

Why: after calibration, a layer's weight updates (GPTQ's batches of same-shape
modules, above all the linearised MoE experts) do not depend on each other, so they
can run on every GPU at once. This module only moves tensors and schedules; the
update function is the caller's (stock library code), so a job gives the same bits
on any device of the same kind as it gives on its home device.

Rules, from DESIGN.md:
- the first time the pool meets a kind of job (`UpdateJob.kind`, e.g. GPTQ's scheme
  and dtype), one job of that kind (the smallest, so the serial part stays short)
  runs first in the caller's thread on its home device, so lazy set-up (Triton JIT,
  solver handles) happens once before the workers start; later layers start the
  workers at once;
- the workers then take the others largest first (the longest job must not start
  last); a worker takes the next job that fits its device's free memory; a device
  without room is skipped with a log line, and a job no device has room for runs
  in the caller's thread on its home device, as stock would run it;
- a job's inputs on another GPU are copied on a stream of their own on that GPU,
  after the work that produced them (an event the caller records before the
  workers start): a copy issued on that GPU's default stream would wait behind
  the other worker's job queued there (2 H200s, Qwen3-235B-A22B layer: the second
  GPU's gate/up chunk took 1.81 s instead of 1.56 s, most of it waiting);
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
from typing import Any, Callable, Generic, Hashable, Iterator, Sequence, TypeVar

import torch
from loguru import logger
from torch.utils._pytree import tree_flatten, tree_map

from llmcompressor_parallel.engine.side_streams import side_stream
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
    :param kind: jobs of one kind share lazy set-up (see the module docstring)
    """

    name: str
    inputs: Any
    home: torch.device
    bytes_needed: int
    kind: Hashable = None


@dataclass(frozen=True)
class UpdateResult(Generic[R]):
    """What a job returned, where it ran, when it started (`time.perf_counter()`) and
    how long it took (copies included).

    `worker` is the pool worker's index, or None for the calling thread.
    """

    value: R
    device: torch.device
    worker: int | None
    seconds: float
    started: float = 0.0

    @property
    def place(self) -> str:
        """Where the job ran, for log lines."""
        thread = "caller" if self.worker is None else f"worker {self.worker}"
        return f"{thread} ({self.device})"


UpdateFn = Callable[[Any, torch.device], R]


def run_update_jobs(
    pool: DeviceWorkerPool,
    jobs: Sequence[UpdateJob],
    update: UpdateFn,
    warmed: set[Hashable] | None = None,
) -> list[UpdateResult]:
    """Run `update(inputs_on_device, device)` for every job; results in job order.

    `warmed`: the kinds of job whose lazy set-up has run on this pool (updated here);
    None: one job warms up in the caller every time.
    """
    if not jobs:
        return []
    context = _CallerState.capture(jobs)
    results: list[UpdateResult | None] = [None] * len(jobs)
    warm_ups = _warm_ups(jobs, warmed)
    for index in warm_ups:
        results[index] = _run_job(jobs[index], jobs[index].home, None, update, context)
    if warmed is not None:
        warmed.update(jobs[index].kind for index in warm_ups)
    queue = _JobQueue(jobs, taken=warm_ups)
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


def _warm_ups(jobs: Sequence[UpdateJob], warmed: set[Hashable] | None) -> list[int]:
    """The smallest job of each kind not yet warmed up (one job of all when `warmed`
    is None), in job order."""
    smallest: dict[Hashable, int] = {}
    for index, job in enumerate(jobs):
        kind = None if warmed is None else job.kind
        if warmed is not None and kind in warmed:
            continue
        if kind not in smallest or job.bytes_needed < jobs[smallest[kind]].bytes_needed:
            smallest[kind] = index
    return sorted(smallest.values())


class _JobQueue:
    """Jobs not yet taken, shared by the workers: largest first, first fit by memory."""

    def __init__(self, jobs: Sequence[UpdateJob], taken: Sequence[int]):
        self.jobs = jobs
        self._pending = sorted(
            (index for index in range(len(jobs)) if index not in taken),
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
    context: "_CallerState",
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


@dataclass(frozen=True)
class _CallerState:
    """What jobs take from the calling thread: its grad/autocast state, and per GPU that
    holds inputs an event recorded on its current stream once they are there (only
    those GPUs: asking for another's stream would create a CUDA context on it)."""

    thread: ThreadContext
    inputs_ready: dict[int, torch.cuda.Event]

    @classmethod
    def capture(cls, jobs: Sequence[UpdateJob]) -> "_CallerState":
        ready = {}
        for tensor in tree_flatten([job.inputs for job in jobs])[0]:
            if isinstance(tensor, torch.Tensor) and tensor.is_cuda and tensor.device.index not in ready:
                ready[tensor.device.index] = torch.cuda.Event()
                ready[tensor.device.index].record(torch.cuda.current_stream(tensor.device))
        return cls(ThreadContext.capture(), ready)


def _run_job(
    job: UpdateJob,
    device: torch.device,
    worker: int | None,
    update: UpdateFn,
    context: _CallerState,
) -> UpdateResult:
    start = time.perf_counter()
    with context.thread.applied(), _on_device(device):
        value = update(_copy_to(job.inputs, device, context), device)
        if device.type == "cuda":
            # surface asynchronous errors here, in the thread that names the device
            torch.cuda.synchronize(device)
    return UpdateResult(value, device, worker, time.perf_counter() - start, start)


def _copy_to(tree: Any, device: torch.device, context: _CallerState) -> Any:
    """Blocking copy of every tensor of `tree` to `device` (no-op where it already is).

    Blocking, because a non-blocking device-to-host copy may be read before it lands.
    From another GPU, the copy runs on a stream of this thread's own there, after the
    caller's inputs-ready event (module docstring).
    """

    def copy(value: Any) -> Any:
        if not isinstance(value, torch.Tensor) or value.device == device:
            return value
        source = value.device
        if source.type != "cuda" or device.type != "cuda" or source.index not in context.inputs_ready:
            return value.to(device)
        stream = side_stream(source)
        stream.wait_event(context.inputs_ready[source.index])
        with torch.cuda.stream(stream):
            copied = value.to(device)
        return copied

    return tree_map(copy, tree)


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
