"""A layer's GPTQ results written into its modules by several copy threads, stock's bits.

Why: once every update batch of a layer has succeeded, stock's `update_batch_qparams`
writes each module's weight and qparams with compressed-tensors'
`update_offload_parameter`, one module after another in the calling thread. For a
module offloaded to host memory that is a host-to-host copy into the offloaded tensor
and a host-to-device copy into the onloaded tensor the pipeline keeps while offloading
is disabled (2x H200, Llama-3-8B layer: 84 ms of a 430 ms update phase). The copies
release the GIL, so up to `MAX_WRITE_THREADS` short-lived threads write different modules
at once (one per GPU left the host's memory bandwidth mostly unused). Each module is
written by stock's `update_batch_qparams` on a one-module slice of its batch's
results: the same per-module calls on the same values as stock's loop.

Why that is safe (compressed-tensors' offload caches, as installed):
- each module's tensors live in its own `_parameters` / `_buffers` cache instances
  (`offloaded_values` is per instance), and each module is written by one thread;
- the state shared by every cache is class-level: `OffloadCache.keep_onloaded_values`
  (a dict keyed by offloaded tensors, hashed by identity) and the
  `offloading_disabled` / `onloading_disabled` flags. The threads only read the flags,
  which the caller's contexts set while it waits for the threads; they look up, and on
  a cache miss insert, their own modules' keys in the dict: single dict operations on
  distinct keys, atomic under the GIL. The dict is iterated and cleared only when the
  caller's `disable_offloading` exits, after every thread has finished;
- `CPUCache` and `DeviceCache` writes are `copy_` into tensors of that module (or, on
  a shape change, a new offload into its own instance): nothing shared.

Each copy thread queues its copies to a GPU on a stream of its own (`_own_stream`), and
waits for it before it finishes.

Written serially in the calling thread, exactly as before: under torch.distributed
(stock's DDP flow stays as it is; the distributed caches' `offload` runs collectives,
which must not be issued from several threads in an order that differs between
ranks), for disk-offloaded modules (`DiskCache` writes safetensors files and its
`offload` mutates a class-level index), for cache classes not read here, and on a
Python without the GIL (the dict argument above rests on it).

A failure while writing stops the other threads before their next module, and reaches
the caller, once every thread has stopped, as `WriteBackError` naming the module; the
modules written by then keep their new values, as they would when stock's serial loop
fails part-way.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from typing import Callable, Iterator, NamedTuple, Sequence

import torch
from compressed_tensors.offload.cache.base import OffloadCache
from compressed_tensors.offload.cache.cpu import CPUCache
from compressed_tensors.offload.cache.device import DeviceCache
from compressed_tensors.offload.dist_utils import is_distributed
from compressed_tensors.quantization import QuantizationArgs
from loguru import logger
from torch import nn

from llmcompressor.modifiers.gptq.helpers import update_batch_qparams

from llmcompressor_parallel.engine.side_streams import side_stream
from llmcompressor_parallel.engine.thread_context import ThreadContext

__all__ = [
    "BatchWrite",
    "WriteBackError",
    "serial_write_back_reason",
    "write_batches",
    "write_threads",
]

# cache classes whose writes from several threads, one module each, were read to be safe
_THREAD_SAFE_CACHES: tuple[type[OffloadCache], ...] = (CPUCache, DeviceCache)


class WriteBackError(RuntimeError):
    """Writing one module's results failed; names the module."""

    def __init__(self, name: str, error: BaseException):
        super().__init__(f"GPTQ write-back of {name} failed: {type(error).__name__}: {error}")
        self.name = name


class BatchWrite(NamedTuple):
    """One update batch's results and the modules they go to (stock's write-back arguments)."""

    names: list[str]
    modules: list[nn.Module]
    quantized: torch.Tensor
    scales: torch.Tensor
    zero_points: torch.Tensor
    global_scales: torch.Tensor | None
    quant_args: QuantizationArgs

    def write_all(self) -> None:
        """Stock's call for the whole batch, in the calling thread."""
        update_batch_qparams(
            self.modules, self.quantized, self.scales, self.zero_points,
            self.global_scales, self.quant_args,
        )

    def write_one(self, index: int) -> None:
        """Stock's call on the batch's `index`-th module alone: the writes its loop makes for it."""
        rows = slice(index, index + 1)
        update_batch_qparams(
            [self.modules[index]],
            self.quantized[rows],
            self.scales[rows],
            self.zero_points[rows],
            None if self.global_scales is None else self.global_scales[rows],
            self.quant_args,
        )

    def module_bytes(self) -> int:
        """Bytes of one module's quantized weight: what its write-back mostly copies."""
        return self.quantized[0].nbytes


_Item = tuple[BatchWrite, int]  # a batch and the index of one of its modules

MAX_WRITE_THREADS = 8
# named like the pools' workers, so that `live_worker_threads` sees them too
WRITE_THREAD_PREFIX = "llmc-parallel-write-back"


def write_batches(batches: Sequence[BatchWrite], concurrent: bool = True) -> None:
    """Write every batch's results: on copy threads where `concurrent` and that is safe,
    else serially in the calling thread."""
    start = time.perf_counter()
    modules = [module for batch in batches for module in batch.modules]
    reason = serial_write_back_reason(modules) if concurrent else "asked for"
    if reason is None and len(modules) >= 2:
        threads = _write_concurrently(batches)
        where = f"{threads} threads"
    else:
        for batch in batches:
            batch.write_all()
        where = f"the calling thread ({reason or 'one module'})"
    logger.debug(
        "GPTQ write-back: {} module(s) on {}: {:.3f} s",
        len(modules), where, time.perf_counter() - start,
    )


def serial_write_back_reason(modules: Sequence[nn.Module]) -> str | None:
    """Why `modules` must be written in the calling thread; None if threads may write them."""
    if not getattr(sys, "_is_gil_enabled", lambda: True)():
        return "Python runs without the GIL"
    if is_distributed():
        return "torch.distributed is initialized"
    for module in modules:
        for cache in (module._parameters, module._buffers):
            if isinstance(cache, OffloadCache) and type(cache) not in _THREAD_SAFE_CACHES:
                return f"{type(cache).__name__} offloading"
    return None


def write_threads(modules: int) -> int:
    """How many threads copy a layer's results: host copies are bound by memory
    bandwidth, which one thread per GPU leaves mostly unused (2x H200, Qwen3-235B-A22B
    layer: 4.8 GB written in 0.48 s on 2 threads), so up to `MAX_WRITE_THREADS`, never
    more than the machine's cores or the modules."""
    return max(1, min(MAX_WRITE_THREADS, os.cpu_count() or 1, modules))


def _write_concurrently(batches: Sequence[BatchWrite]) -> int:
    """Modules dealt out over short-lived copy threads, one per share (all joined before
    returning); returns how many threads wrote. The first failure is raised after every
    thread has stopped."""
    items = [(batch, index) for batch in batches for index in range(len(batch.modules))]
    shares = [share for share in _deal(items, write_threads(len(items))) if share]
    context = ThreadContext.capture()
    device = _current_cuda_device()
    failed = threading.Event()
    errors: list[BaseException] = []
    threads = [
        threading.Thread(
            target=_writer(share, context, device, failed, errors),
            name=f"{WRITE_THREAD_PREFIX}_{number}",
        )
        for number, share in enumerate(shares)
    ]
    try:
        for thread in threads:
            thread.start()
    finally:
        _join_all(threads, failed)
    if errors:
        raise errors[0]
    return len(threads)


def _join_all(threads: Sequence[threading.Thread], failed: threading.Event) -> None:
    """Wait for every started thread; an interrupt while waiting stops them before their
    next module, waits for them all the same, and is then re-raised."""
    started = [thread for thread in threads if thread.ident is not None]
    try:
        for thread in started:
            thread.join()
    except BaseException:
        failed.set()
        for thread in started:
            thread.join()
        raise


def _deal(items: list[_Item], threads: int) -> list[list[_Item]]:
    """Largest first to the least loaded thread; each share then in stock's order."""
    shares: list[list[int]] = [[] for _ in range(threads)]
    loads = [0] * threads
    for position in sorted(range(len(items)), key=lambda p: -items[p][0].module_bytes()):
        lightest = loads.index(min(loads))
        shares[lightest].append(position)
        loads[lightest] += items[position][0].module_bytes()
    return [[items[position] for position in sorted(share)] for share in shares]


def _writer(
    share: list[_Item],
    context: ThreadContext,
    device: int | None,
    failed: threading.Event,
    errors: list[BaseException],
) -> Callable[[], None]:
    """One thread's job: its modules in stock's order, until any thread has failed; its
    failure goes to `errors` (in the order the threads failed) and stops the others."""

    def write() -> None:
        try:
            with context.applied(), _cuda_device(device), _own_stream(device):
                for batch, index in share:
                    if failed.is_set():
                        return
                    try:
                        batch.write_one(index)
                    except BaseException as error:
                        raise WriteBackError(batch.names[index], error) from error
        except BaseException as error:
            failed.set()
            errors.append(error)

    return write


def _current_cuda_device() -> int | None:
    """The caller's current CUDA device, if CUDA is in use.

    A fresh thread has device 0 current; the write-back makes the caller's current
    instead, so that anything resolved without a device index (an offload
    cache's `"cuda"`, an allocation) resolves as in the calling thread. The copies
    themselves run on their tensors' devices either way.
    """
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.cuda.current_device()
    return None


@contextlib.contextmanager
def _own_stream(device: int | None) -> Iterator[None]:
    """The copy thread's writes on a stream of its own on `device`, waited for at the end.

    Why: stock copies each result into the onloaded tensor with a blocking copy on
    the device's current stream. On the default stream, which every copy thread
    shares, each thread's blocking copy waits for all the copies the other threads
    queued before it; on its own stream it waits for its own. The stream first waits
    for the work the default stream holds, and the thread waits for its stream before
    it finishes: writes from device results are asynchronous, and the results may be
    freed, and the weights read on the default stream, once the write-back returns.
    """
    if device is None:
        yield
        return
    stream = side_stream(torch.device("cuda", device))
    stream.wait_stream(torch.cuda.current_stream(device))
    try:
        with torch.cuda.stream(stream):
            yield
    finally:
        stream.synchronize()


@contextlib.contextmanager
def _cuda_device(device: int | None) -> Iterator[None]:
    if device is None:
        yield
        return
    with torch.cuda.device(device):
        yield
