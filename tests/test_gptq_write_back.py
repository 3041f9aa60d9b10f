"""modifiers/gptq_write_back.py: a layer's GPTQ results written by several copy threads.

The concurrent write-back must give the serial (stock) write-back's bits, in the
offloaded tensors and in the onloaded ones the pipeline keeps; the modifier's records
(metric lines, Hessian drops, counts) stay in the calling thread in stock's order; a
failing write names the module, stops the other threads before their next module and
leaves no thread running; the modifier's records of the layer stay untouched.
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Any, Iterator

import pytest
import torch
from compressed_tensors.offload import disable_offloading
from compressed_tensors.offload.cache.base import OffloadCache
from compressed_tensors.offload.cache.cpu import CPUCache
from compressed_tensors.offload.module import offload_module
from compressed_tensors.quantization import QuantizationArgs
from loguru import logger
from torch import nn
from transformers import AutoModelForCausalLM

import llmcompressor_parallel.modifiers.gptq_write_back as write_back
from llmcompressor_parallel.engine.worker_pool import live_worker_threads
from llmcompressor_parallel.modifiers.gptq import ParallelGPTQExpertModifier
from llmcompressor_parallel.modifiers.gptq_write_back import (
    BatchWrite,
    serial_write_back_reason,
    write_batches,
)
from oneshot_runs import calibrate_in_order, run_oneshot

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

NVFP4_ARGS = dict(targets="Linear", scheme="NVFP4A16", ignore=["lm_head"], batched_quantization=3)
QUANT_ARGS = QuantizationArgs(
    num_bits=4, type="int", symmetric=True, strategy="group", group_size=16
)
QPARAMS = ("weight", "weight_scale", "weight_zero_point", "weight_global_scale")


# ---------------------------------------------------------------- helpers
def _bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().contiguous().view(-1).view(torch.uint8).clone()


def _quantized_linear(rows: int, columns: int, seed: int, onload: str = "cpu") -> nn.Linear:
    """A Linear with GPTQ's qparams, offloaded to CPU as the sequential pipeline does."""
    torch.manual_seed(seed)
    module = nn.Linear(columns, rows, bias=False)  # weight requires grad, as in a model
    groups = columns // QUANT_ARGS.group_size
    module.weight_scale = nn.Parameter(torch.ones(rows, groups), requires_grad=False)
    module.weight_zero_point = nn.Parameter(
        torch.zeros(rows, groups, dtype=torch.int8), requires_grad=False
    )
    module.weight_global_scale = nn.Parameter(torch.ones(1), requires_grad=False)
    offload_module(module, onload_device=onload, offload_device="cpu")
    return module


def _layer(onload: str = "cpu") -> list[list[nn.Linear]]:
    """Three batches as stock forms them: 4 and 3 same-shape modules, and a lone one."""
    shapes = [(32, 64)] * 4 + [(64, 32)] + [(48, 64)] * 3
    modules = [_quantized_linear(*shape, seed, onload) for seed, shape in enumerate(shapes)]
    return [modules[:4], modules[4:5], modules[5:]]


def _results(batch: list[nn.Linear], seed: int, place: str = "cpu") -> BatchWrite:
    """Random results, in host memory ("cpu"), page-locked host memory ("pinned") or
    on a GPU ("cuda:N")."""
    generator = torch.Generator().manual_seed(seed)
    rows, columns = batch[0].weight.shape
    groups = columns // QUANT_ARGS.group_size
    results = BatchWrite(
        names=[f"batch{seed}.module{index}" for index in range(len(batch))],
        modules=batch,
        quantized=torch.randn(len(batch), rows, columns, generator=generator),
        scales=torch.rand(len(batch), rows, groups, generator=generator),
        zero_points=torch.randint(-8, 8, (len(batch), rows, groups), generator=generator),
        global_scales=torch.rand(len(batch), generator=generator),
        quant_args=QUANT_ARGS,
    )
    if place == "cpu":
        return results
    move = (lambda t: t.pin_memory()) if place == "pinned" else (lambda t: t.to(place))
    return results._replace(**{
        field: move(getattr(results, field))
        for field in ("quantized", "scales", "zero_points", "global_scales")
    })


@pytest.fixture
def onload_copies(monkeypatch):
    """CPU caches onload a copy, as device onloading does: writes then copy twice."""

    def onload(self, offloaded: torch.Tensor | None) -> torch.Tensor | None:
        if offloaded is None:
            return None
        with torch.no_grad():
            copy = offloaded.clone()
        return nn.Parameter(copy, requires_grad=offloaded.requires_grad)

    monkeypatch.setattr(CPUCache, "onload", onload)


def _written(batches: list[list[nn.Linear]]) -> dict[str, torch.Tensor]:
    """Offloaded and kept onloaded tensors of every module (inside disable_offloading)."""
    tensors = {}
    for b, batch in enumerate(batches):
        for m, module in enumerate(batch):
            for name in QPARAMS:
                offloaded = module._parameters.offloaded_values[name]
                onloaded = OffloadCache.keep_onloaded_values[offloaded]
                assert onloaded is not offloaded, "onloading should copy in this test"
                tensors[f"{b}.{m}.{name}.offloaded"] = _bits(offloaded)
                tensors[f"{b}.{m}.{name}.onloaded"] = _bits(onloaded)
    return tensors


@contextlib.contextmanager
def _writer_threads(monkeypatch) -> Iterator[list[str]]:
    """Yields the names of the threads that call stock's write-back, one per module."""
    threads: list[str] = []
    real = write_back.update_batch_qparams

    def spy(modules, *args, **kwargs):
        threads.extend(threading.current_thread().name for _ in modules)
        return real(modules, *args, **kwargs)

    monkeypatch.setattr(write_back, "update_batch_qparams", spy)
    yield threads


def _write_layer(concurrent: bool, onload: str = "cpu", results: str = "cpu") -> dict[str, torch.Tensor]:
    batches = _layer(onload)
    with torch.no_grad(), disable_offloading():
        for batch in batches:  # onloaded and kept, as after the calibration forwards
            for module in batch:
                for name in QPARAMS:
                    getattr(module, name)
        before = _written(batches)
        write_batches([_results(batch, seed, results) for seed, batch in enumerate(batches)], concurrent)
        after = _written(batches)
    assert all(not torch.equal(before[name], after[name]) for name in before if "weight." in name)
    return after


# ---------------------------------------------------------------- same bits
def test_threads_write_the_serial_bits_offloaded_and_onloaded(onload_copies, monkeypatch):
    serial = _write_layer(concurrent=False)
    monkeypatch.setattr(write_back, "MAX_WRITE_THREADS", 3)
    monkeypatch.setattr(write_back.os, "cpu_count", lambda: 16)
    with _writer_threads(monkeypatch) as threads:
        concurrent = _write_layer(concurrent=True)
    print(f"{len(serial)} tensors compared; modules written by: {sorted(set(threads))}")
    assert serial.keys() == concurrent.keys()
    differ = [name for name in serial if not torch.equal(serial[name], concurrent[name])]
    assert not differ, f"concurrent write-back differs from the serial one: {differ}"
    assert len(threads) == 8 and all(name.startswith("llmc-parallel-write-back") for name in threads)
    assert len(set(threads)) == 3, "every copy thread should have written modules"
    assert live_worker_threads() == []


@pytest.mark.gpu  # skipped by conftest.py without 2 GPUs
@pytest.mark.parametrize("results", ["pinned", "cuda:0", "cuda:1"])
def test_threads_write_the_serial_bits_into_onloaded_tensors_on_a_gpu(results, monkeypatch):
    """Copy threads write on streams of their own: from page-locked memory (blocking
    copies), and from GPU results (asynchronous, waited for before they return)."""
    serial = _write_layer(concurrent=False, onload="cuda:0", results=results)
    monkeypatch.setattr(write_back, "MAX_WRITE_THREADS", 3)
    monkeypatch.setattr(write_back.os, "cpu_count", lambda: 16)
    with _writer_threads(monkeypatch) as threads:
        concurrent = _write_layer(concurrent=True, onload="cuda:0", results=results)
    differ = [name for name in serial if not torch.equal(serial[name], concurrent[name])]
    assert not differ, f"concurrent write-back differs from the serial one: {differ}"
    assert len(set(threads)) == 3


def test_oneshot_concurrent_write_back_equals_serial(model_dirs, tmp_path, monkeypatch):
    """Tiny MoE model, modules offloaded to CPU by the pipeline, NVFP4 (global scales)."""
    runs = {}
    for mode in ("serial", "concurrent"):
        with monkeypatch.context() as patch:
            if mode == "serial":
                patch.setattr(
                    write_back, "serial_write_back_reason", lambda modules: "forced by the test"
                )
            counts = _counts_after_each_layer(patch)
            with _writer_threads(patch) as threads, _metric_lines() as metrics:
                recipe = ParallelGPTQExpertModifier(data_parallel=["cpu", "cpu"], **NVFP4_ARGS)
                tensors = run_oneshot(model_dirs["moe"], recipe, tmp_path / mode)
        runs[mode] = (tensors, threads, metrics, counts)

    (serial, serial_threads, serial_metrics, serial_counts) = runs["serial"]
    (ours, our_threads, our_metrics, our_counts) = runs["concurrent"]
    print(f"{len(serial)} saved tensors; writer threads: {sorted(set(our_threads))}")
    assert set(serial_threads) == {"MainThread"}
    assert len(set(our_threads)) > 1
    assert all(name.startswith("llmc-parallel-write-back") for name in our_threads)
    assert serial.keys() == ours.keys()
    differ = [name for name in serial if not torch.equal(serial[name], ours[name])]
    assert not differ, f"tensors differ from the serial write-back: {differ}"
    # records: in the calling thread, in the same (stock's) order as the serial run
    assert our_metrics and {thread for thread, _ in our_metrics} == {"MainThread"}
    assert [line for _, line in our_metrics] == [line for _, line in serial_metrics]
    assert our_counts == serial_counts and our_counts[-1][0] == len(our_metrics)
    assert live_worker_threads() == []


def _counts_after_each_layer(patch: pytest.MonkeyPatch) -> list[tuple[int, list, int, int]]:
    """After each layer's updates: modules compressed, RTN fallbacks, Hessians and counts left."""
    counts: list[tuple[int, list, int, int]] = []
    real = ParallelGPTQExpertModifier.compress_module_list

    def compress_then_count(self, module_list):
        real(self, module_list)
        counts.append((
            self._num_compressed_modules, list(self._rtn_fallback_module_names),
            len(self._hessians), len(self._num_samples),
        ))

    patch.setattr(ParallelGPTQExpertModifier, "compress_module_list", compress_then_count)
    return counts


@contextlib.contextmanager
def _metric_lines() -> Iterator[list[tuple[str, str]]]:
    """(thread, message without the placement) of each per-module GPTQ metric line."""
    lines: list[tuple[str, str]] = []

    def sink(message: Any) -> None:
        record = message.record
        if record["level"].name == "METRIC" and "GPTQ error" in record["message"]:
            lines.append((record["thread"].name, record["message"].rsplit(", ", 1)[0]))

    handle = logger.add(sink, level=0)
    try:
        yield lines
    finally:
        logger.remove(handle)


# ---------------------------------------------------------------- failures
def test_failing_write_stops_the_other_threads_and_names_the_module(monkeypatch):
    """6 modules of one size on 2 threads: thread 0 writes 0, 2, 4; thread 1 writes 1, 3, 5."""
    modules = [_quantized_linear(16, 32, seed) for seed in range(6)]
    batch = _results(modules, 0)
    events: list[str] = []
    lock = threading.Lock()
    real = write_back.update_batch_qparams

    def slow_or_failing(members, *args, **kwargs):
        index = modules.index(members[0])
        with lock:
            events.append(f"start {index}")
        try:
            if index == 0:
                raise RuntimeError("injected write failure")
            time.sleep(0.2)
            return real(members, *args, **kwargs)
        finally:
            with lock:
                events.append(f"end {index}")

    monkeypatch.setattr(write_back, "update_batch_qparams", slow_or_failing)
    monkeypatch.setattr(write_back, "write_threads", lambda modules: 2)
    message = (r"GPTQ write-back of batch0\.module0 failed: RuntimeError: injected write failure")
    with torch.no_grad(), disable_offloading():
        with pytest.raises(write_back.WriteBackError, match=message):
            write_batches([batch])
        finished = list(events)
    print("write events:", finished)
    started = [event for event in finished if event.startswith("start")]
    assert len(finished) == 2 * len(started), "a write was still running after the error"
    assert "start 2" not in started and "start 4" not in started
    assert len(started) <= 3, "thread 1 kept writing after thread 0 failed"
    assert live_worker_threads() == []


def test_oneshot_write_failure_names_module_and_keeps_records(model_dirs, monkeypatch):
    """A write failing on a worker thread: the module named, no thread left, records kept."""
    model = AutoModelForCausalLM.from_pretrained(model_dirs["moe"], dtype=torch.float32)
    recipe = ParallelGPTQExpertModifier(data_parallel=["cpu", "cpu"], **NVFP4_ARGS)
    target = "model.layers.0.mlp.experts.2.down_proj"
    real = write_back.update_batch_qparams
    layers_seen: list[list[nn.Module]] = []

    def failing(members, *args, **kwargs):
        if threading.current_thread().name.startswith("llmc-parallel-write-back") and (
            recipe._module_names.get(members[0]) == target
        ):
            raise RuntimeError("injected write failure")
        return real(members, *args, **kwargs)

    real_compress = ParallelGPTQExpertModifier.compress_module_list

    def seen_then_compress(self, module_list):
        layers_seen.append(list(module_list))
        return real_compress(self, module_list)

    monkeypatch.setattr(write_back, "update_batch_qparams", failing)
    monkeypatch.setattr(ParallelGPTQExpertModifier, "compress_module_list", seen_then_compress)
    message = (rf"GPTQ write-back of {target.replace('.', '[.]')} failed: "
               rf"RuntimeError: injected write failure")
    with _metric_lines() as metrics, pytest.raises(write_back.WriteBackError, match=message):
        calibrate_in_order(model, recipe, samples=16)

    assert live_worker_threads() == []
    layer = [modules for modules in layers_seen if modules]
    assert len(layer) == 1, "the run should stop at the first quantized layer"
    assert target in {recipe._module_names[module] for module in layer[0]}
    assert all(module in recipe._hessians for module in layer[0]), "Hessians dropped"
    assert all(module in recipe._num_samples for module in layer[0])
    assert recipe._num_compressed_modules == 0 and not metrics


# ---------------------------------------------------------------- where threads may write
def test_serial_where_the_caches_are_not_known_to_be_safe(tmp_path, monkeypatch):
    plain, on_host = nn.Linear(4, 4), nn.Linear(4, 4)
    offload_module(on_host, onload_device="cpu", offload_device="cpu")
    on_disk = nn.Linear(4, 4)
    offload_module(on_disk, onload_device="cpu", offload_device="disk", offload_dir=str(tmp_path))
    assert serial_write_back_reason([plain, on_host]) is None
    assert serial_write_back_reason([plain, on_host, on_disk]) == "DiskCache offloading"

    class CustomCache(CPUCache):
        pass

    custom = nn.Linear(4, 4)
    offload_module(custom, onload_device="cpu", offload_device="cpu")
    custom._parameters.__class__ = CustomCache
    assert serial_write_back_reason([custom]) == "CustomCache offloading"

    monkeypatch.setattr(write_back, "is_distributed", lambda: True)
    assert serial_write_back_reason([plain]) == "torch.distributed is initialized"


def test_serial_paths_write_in_the_calling_thread(monkeypatch):
    batches = _layer()
    with _writer_threads(monkeypatch) as threads:
        monkeypatch.setattr(write_back, "is_distributed", lambda: True)
        with torch.no_grad(), disable_offloading():
            write_batches([_results(batch, seed) for seed, batch in enumerate(batches)])
    assert len(threads) == 8 and set(threads) == {threading.current_thread().name}
