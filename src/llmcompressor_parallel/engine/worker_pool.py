"""One persistent worker thread per device.

Threads are started once per run and set to their device once: DESIGN.md measured
that starting threads per call made two GPUs slower than one. A failure in any
worker is re-raised in the caller with the device named, after every other worker
has finished its share, so no thread is ever left running behind an exception.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any, Callable, Sequence

import torch
from loguru import logger

__all__ = ["DeviceWorkerPool", "ReplicaError", "live_worker_threads"]


class ReplicaError(RuntimeError):
    """A worker failed; names the device so the user knows which replica broke."""

    def __init__(self, device: torch.device, worker: int, error: BaseException):
        super().__init__(
            f"data-parallel worker {worker} on device {device} failed: "
            f"{type(error).__name__}: {error}"
        )
        self.device = device
        self.worker = worker


def _bind_thread_to_device(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.set_device(device)
        # warm-up: create the context, the default stream and a cuBLAS handle now,
        # not inside the first timed layer
        probe = torch.ones(8, 8, device=device)
        (probe @ probe).sum().item()


class DeviceWorkerPool:
    """Persistent threads, one per entry of `devices` (a device may repeat)."""

    def __init__(self, devices: Sequence[torch.device]):
        if len(devices) < 1:
            raise ValueError("DeviceWorkerPool needs at least one device")
        self.devices = [torch.device(d) for d in devices]
        self._executors: list[ThreadPoolExecutor] = []
        try:
            for index, device in enumerate(self.devices):
                executor = ThreadPoolExecutor(
                    max_workers=1,
                    thread_name_prefix=f"llmc-parallel-{index}-{device}",
                    initializer=_bind_thread_to_device,
                    initargs=(device,),
                )
                self._executors.append(executor)
            # start every thread now (initializers run on first submit)
            self.run([lambda: None for _ in self.devices])
        except BaseException:
            self.close()
            raise
        logger.debug("started {} worker threads on {}", len(self.devices), self.devices)

    @property
    def closed(self) -> bool:
        return not self._executors

    def run(self, jobs: Sequence[Callable[[], Any] | None]) -> list[Any]:
        """Run jobs[i] on worker i (None skips a worker) and return the results.

        Waits for every submitted job even when one fails or the caller is
        interrupted, then raises the first failure (by worker order) as ReplicaError.
        """
        if self.closed:
            raise RuntimeError("DeviceWorkerPool is closed")
        if len(jobs) > len(self._executors):
            raise ValueError(f"{len(jobs)} jobs for {len(self._executors)} workers")
        futures: list[Future | None] = []
        try:
            for executor, job in zip(self._executors, jobs):
                futures.append(None if job is None else executor.submit(job))
        finally:
            # an interrupt while waiting must not leave workers running our jobs
            self._wait_all(futures)
        results = []
        for index, future in enumerate(futures):
            if future is None:
                results.append(None)
                continue
            error = future.exception()
            if error is not None:
                raise ReplicaError(self.devices[index], index, error) from error
            results.append(future.result())
        return results

    @staticmethod
    def _wait_all(futures: Sequence[Future | None]) -> None:
        pending = [future for future in futures if future is not None]
        try:
            wait(pending)
        except KeyboardInterrupt:
            for future in pending:
                future.cancel()
            wait(pending)
            raise

    def close(self) -> None:
        """Stop every thread and wait for them to exit."""
        executors, self._executors = self._executors, []
        for executor in executors:
            executor.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> "DeviceWorkerPool":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def live_worker_threads() -> list[threading.Thread]:
    """Worker threads of any pool still alive (for tests and diagnostics)."""
    return [t for t in threading.enumerate() if t.name.startswith("llmc-parallel-")]
