"""ParallelGPTQExpertModifier's update pool on CPU devices: same bits as stock GPTQ.

Stock GPTQModifier and ours run through `oneshot()` on tiny models built from
config; every saved tensor must be equal. Calibration samples are not shuffled:
stock's shuffle draws from the global torch RNG, and the Hessians are sums in
sample order, so two stock runs in one process differ unless the order is fixed.
"""

from __future__ import annotations

import functools
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from loguru import logger
from transformers import AutoModelForCausalLM

from llmcompressor import oneshot
from llmcompressor.modifiers.gptq import GPTQModifier

import llmcompressor_parallel.engine.update_pool as update_pool
import llmcompressor_parallel.modifiers.gptq as parallel_gptq
from llmcompressor_parallel.engine.update_pool import UpdateJob, run_update_jobs
from llmcompressor_parallel.engine.worker_pool import (
    DeviceWorkerPool,
    ReplicaError,
    live_worker_threads,
)
from llmcompressor_parallel.modifiers.gptq import ParallelGPTQExpertModifier
from llmcompressor_parallel.modifiers.gptq_batches import split_for_devices
from tiny_models import calibration_data, load_saved_tensors

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

MOE_ARGS = dict(targets="Linear", scheme="W4A16", ignore=["lm_head"], batched_quantization=4)
NVFP4_ARGS = dict(targets="Linear", scheme="NVFP4A16", ignore=["lm_head"], batched_quantization=3)
DENSE_ARGS = dict(targets="Linear", scheme="W8A16", ignore=["lm_head"], actorder="weight")


# ---------------------------------------------------------------- helpers


def run_oneshot(model: Any, recipe: Any, output_dir: Path | None = None) -> None:
    oneshot(
        model=model,
        dataset=calibration_data(),
        recipe=recipe,
        num_calibration_samples=16,
        max_seq_length=32,
        shuffle_calibration_samples=False,
        output_dir=None if output_dir is None else str(output_dir),
    )


def quantize(
    model_dir: Path, recipe: Any, out: Path
) -> tuple[dict[str, torch.Tensor], float]:
    start = time.perf_counter()
    run_oneshot(str(model_dir), recipe, out)
    return load_saved_tensors(out), time.perf_counter() - start


_STOCK: dict[str, dict[str, torch.Tensor]] = {}


def stock(model_dirs: dict[str, Path], tmp_path: Path, kind: str, args: dict) -> dict:
    """Stock GPTQ's checkpoint for (kind, args), computed once per test module."""
    key = f"{kind}:{sorted(args.items())}"
    if key not in _STOCK:
        tensors, seconds = quantize(model_dirs[kind], GPTQModifier(**args), tmp_path / "stock")
        print(f"stock GPTQModifier {kind} {args['scheme']}: {seconds:.2f} s")
        _STOCK[key] = tensors
    return _STOCK[key]


def assert_identical(expected: dict[str, torch.Tensor], actual: dict[str, torch.Tensor]) -> None:
    assert expected.keys() == actual.keys()
    different = [name for name in expected if not torch.equal(expected[name], actual[name])]
    print(f"{len(expected)} saved tensors compared, {len(different)} differ")
    assert not different, f"tensors differ from stock: {different}"


# ---------------------------------------------------------------- checkpoints
@pytest.mark.parametrize(
    "kind, args, devices",
    [
        ("moe", MOE_ARGS, ["cpu", "cpu"]),
        ("moe", NVFP4_ARGS, ["cpu", "cpu", "cpu"]),
        ("dense", DENSE_ARGS, ["cpu", "cpu"]),
    ],
    ids=["moe-w4a16-2dev", "moe-nvfp4-3dev", "dense-w8a16-actorder-2dev"],
)
def test_parallel_updates_equal_stock(model_dirs, tmp_path, kind, args, devices):
    expected = stock(model_dirs, tmp_path, kind, args)
    recipe = ParallelGPTQExpertModifier(data_parallel=devices, **args)
    actual, seconds = quantize(model_dirs[kind], recipe, tmp_path / "parallel")
    print(f"ParallelGPTQExpertModifier {kind} on {devices}: {seconds:.2f} s")
    assert_identical(expected, actual)
    assert live_worker_threads() == []


def test_only_the_first_layer_warms_up_in_the_caller(model_dirs, tmp_path):
    """Later layers hand every batch to the workers at once; the bits stay stock's."""
    expected = stock(model_dirs, tmp_path, "moe", MOE_ARGS)
    lines: list[str] = []
    sink = logger.add(lambda message: lines.append(str(message)), level="INFO")
    try:
        recipe = ParallelGPTQExpertModifier(data_parallel=["cpu", "cpu"], **MOE_ARGS)
        actual, _ = quantize(model_dirs["moe"], recipe, tmp_path / "parallel")
    finally:
        logger.remove(sink)
    placements = [line for line in lines if "GPTQ updates:" in line]
    print("\n".join(placements))
    assert len(placements) == 2  # two decoder layers
    assert "caller" in placements[0] and "caller" not in placements[1]
    assert_identical(expected, actual)


def test_data_parallel_off_is_stock(model_dirs, tmp_path):
    expected = stock(model_dirs, tmp_path, "moe", MOE_ARGS)
    recipe = ParallelGPTQExpertModifier(data_parallel="off", **MOE_ARGS)
    actual, seconds = quantize(model_dirs["moe"], recipe, tmp_path / "off")
    print(f"ParallelGPTQExpertModifier moe, data_parallel='off': {seconds:.2f} s")
    assert_identical(expected, actual)


# ---------------------------------------------------------------- knobs
@pytest.mark.parametrize(
    "knobs, message",
    [
        ({"data_parallel": "two"}, "allowed values"),
        ({"data_parallel": 1}, "allowed values"),
        ({"data_parallel": ["cpu"]}, "fewer than two devices"),
        ({"data_parallel": ["cpu", "tpu:0"]}, "is not a device|only \"cpu\" and \"cuda\""),
        ({"data_parallel": True}, "allowed values"),
        ({"grouped_experts": "yes"}, "allowed values: True, False"),
        ({"grouped_experts": 1}, "allowed values: True, False"),
        ({"batched_quantization": 0}, "positive integer"),
    ],
)
def test_bad_knobs_fail_at_construction(knobs, message):
    with pytest.raises(ValueError, match=message):
        ParallelGPTQExpertModifier(**MOE_ARGS | knobs)


def test_knobs_and_stock_fields_are_kept():
    modifier = ParallelGPTQExpertModifier(
        data_parallel=["cpu", "cpu"],
        grouped_experts=False,
        block_size=64,
        dampening_frac=0.05,
        **MOE_ARGS,
    )
    assert modifier.data_parallel == ["cpu", "cpu"]
    assert modifier.grouped_experts is False
    assert (modifier.block_size, modifier.dampening_frac) == (64, 0.05)
    assert modifier.batched_quantization == 4
    assert ParallelGPTQExpertModifier(**MOE_ARGS).data_parallel == "off"
    assert ParallelGPTQExpertModifier(**MOE_ARGS).grouped_experts is True


# ---------------------------------------------------------------- failures
def test_worker_failure_names_device_and_leaves_layer_untouched(model_dirs, monkeypatch):
    real_quantize = parallel_gptq.quantize_weight

    def failing_quantize(**kwargs: Any) -> Any:
        name = threading.current_thread().name
        if name.startswith("llmc-parallel-1-"):
            raise RuntimeError("injected failure")
        if name.startswith("llmc-parallel-0-"):
            time.sleep(0.2)  # let worker 1 take a batch
        return real_quantize(**kwargs)

    snapshots: list[dict[str, torch.Tensor]] = []
    layers_seen: list[list[torch.nn.Module]] = []
    real_compress = ParallelGPTQExpertModifier.compress_module_list

    def snapshot_then_compress(self, module_list):
        layers_seen.append(list(module_list))
        snapshots.append(_parameters_of(module_list))
        return real_compress(self, module_list)

    monkeypatch.setattr(parallel_gptq, "quantize_weight", failing_quantize)
    monkeypatch.setattr(ParallelGPTQExpertModifier, "compress_module_list", snapshot_then_compress)

    model = AutoModelForCausalLM.from_pretrained(model_dirs["moe"], dtype=torch.float32)
    recipe = ParallelGPTQExpertModifier(data_parallel=["cpu", "cpu"], **MOE_ARGS)
    failure = r"worker 1 on device cpu failed: RuntimeError: injected failure"
    with pytest.raises(ReplicaError, match=failure):
        run_oneshot(model, recipe)

    assert live_worker_threads() == []
    failed_layer = [modules for modules in layers_seen if modules]
    assert len(failed_layer) == 1, "the run should stop at the first quantized layer"
    before, after = snapshots[-1], _parameters_of(layers_seen[-1])
    changed = [name for name in before if not _same_bits(before[name], after[name])]
    print(f"{len(after)} parameters of the failed layer compared, {len(changed)} changed")
    assert after and not changed
    assert all(module in recipe._hessians for module in layers_seen[-1])


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality: placeholders not yet written may hold NaN garbage."""
    return a.shape == b.shape and torch.equal(
        a.contiguous().view(-1).view(torch.uint8), b.contiguous().view(-1).view(torch.uint8)
    )


def _parameters_of(modules: list[torch.nn.Module]) -> dict[str, torch.Tensor]:
    return {
        f"{index}.{name}": parameter.detach().clone()
        for index, module in enumerate(modules)
        for name, parameter in module.named_parameters(recurse=False)
    }


# ---------------------------------------------------------------- the pool itself
def _job(name: str, value: float, bytes_needed: int = 0) -> UpdateJob:
    return UpdateJob(name, {"x": torch.tensor(value)}, torch.device("cpu"), bytes_needed)


def _where(inputs: dict, device: torch.device) -> tuple[float, str, bool]:
    return float(inputs["x"] * 2), threading.current_thread().name, torch.is_grad_enabled()


def test_first_job_in_caller_thread_rest_on_workers():
    jobs = [_job(f"job{i}", i) for i in range(6)]
    with DeviceWorkerPool(["cpu", "cpu"]) as pool, torch.no_grad():
        results = run_update_jobs(pool, jobs, _where)
    assert [result.value[0] for result in results] == [0, 2, 4, 6, 8, 10]
    assert results[0].worker is None
    assert results[0].value[1] == threading.current_thread().name
    assert all(result.worker in (0, 1) for result in results[1:])
    assert all(result.value[1].startswith("llmc-parallel-") for result in results[1:])
    assert not any(result.value[2] for result in results), "grad mode not carried"
    assert live_worker_threads() == []


def test_device_without_room_is_skipped_with_a_log_line(monkeypatch):
    monkeypatch.setattr(update_pool, "_free_bytes", lambda device: 100)
    lines: list[str] = []
    sink = logger.add(lambda message: lines.append(str(message)), level="INFO")
    jobs = [_job("first", 0), _job("small", 1, 10), _job("large", 2, 1000)]
    try:
        with DeviceWorkerPool(["cpu", "cpu"]) as pool:
            results = run_update_jobs(pool, jobs, _where)
    finally:
        logger.remove(sink)
    assert [result.value[0] for result in results] == [0, 2, 4]
    assert results[1].worker in (0, 1)
    assert results[2].worker is None, "a job no device has room for runs in the caller"
    assert any("skipping cpu" in line for line in lines)
    assert any("no worker device has room for large" in line for line in lines)


def test_failing_job_stops_the_queue_and_names_the_worker():
    started: list[str] = []

    def update(inputs: dict, device: torch.device) -> float:
        started.append(threading.current_thread().name)
        if float(inputs["x"]) == 1:
            raise ValueError("bad batch")
        time.sleep(0.05)
        return float(inputs["x"])

    jobs = [_job(f"job{i}", i) for i in range(8)]
    with DeviceWorkerPool(["cpu", "cpu"]) as pool:
        with pytest.raises(ReplicaError, match=r"on device cpu failed: ValueError: bad batch"):
            run_update_jobs(pool, jobs, update)
    assert len(started) < len(jobs), "workers kept taking jobs after a failure"
    assert live_worker_threads() == []


def test_a_warmed_kind_starts_the_workers_at_once():
    """The first layer warms each kind of job up in the caller; later layers do not."""
    warmed: set = set()
    with DeviceWorkerPool(["cpu", "cpu"]) as pool:
        first = run_update_jobs(pool, [_job(f"job{i}", i, 10 - i) for i in range(4)], _where, warmed)
        second = run_update_jobs(pool, [_job(f"job{i}", i, 10 - i) for i in range(4)], _where, warmed)
        other_kind = [UpdateJob("other", {"x": torch.tensor(5.0)}, torch.device("cpu"), 1, kind="b")]
        third = run_update_jobs(pool, other_kind + [_job("job", 1, 2)], _where, warmed)
    assert [r.worker for r in first].count(None) == 1 and first[3].worker is None, "smallest first"
    assert all(r.worker in (0, 1) for r in second)
    assert third[0].worker is None and third[1].worker in (0, 1)
    assert warmed == {None, "b"}
    assert [r.value[0] for r in second] == [0, 2, 4, 6]


# ---------------------------------------------------------------- GPUs (device machine)
@pytest.mark.gpu  # skipped by conftest.py without 2 GPUs
@pytest.mark.parametrize("batched", ["auto", 4])
def test_parallel_updates_equal_stock_on_two_gpus(model_dirs, tmp_path, batched):
    args = MOE_ARGS | {"batched_quantization": batched}
    expected = stock(model_dirs, tmp_path, "moe", args)
    recipe = ParallelGPTQExpertModifier(data_parallel=["cuda:0", "cuda:1"], **args)
    actual, seconds = quantize(model_dirs["moe"], recipe, tmp_path / "parallel")
    print(f"ParallelGPTQExpertModifier moe on cuda:0, cuda:1: {seconds:.2f} s")
    assert_identical(expected, actual)
    assert live_worker_threads() == []


def synthetic_batch(
    num_modules: int, rows: int, columns: int, device: torch.device, seed: int = 0
) -> parallel_gptq._BatchInputs:
    """Stacked GPTQ inputs of `num_modules` same-shape modules, as stock's batch gives them."""
    from compressed_tensors.quantization import QuantizationArgs

    generator = torch.Generator().manual_seed(seed)
    quant_args = QuantizationArgs(
        num_bits=4, type="int", symmetric=True, strategy="group", group_size=128,
        actorder="static",
    )
    weights, hessians = [], []
    for _ in range(num_modules):
        weights.append(torch.randn(rows, columns, generator=generator).to(device, torch.bfloat16))
        samples = torch.randn(1024, columns, generator=generator).to(device)
        hessians.append(2 * samples.t() @ samples)
    scales = [
        (weight.float().abs().reshape(rows, -1, 128).amax(-1) / 7).to(torch.bfloat16)
        for weight in weights
    ]
    return parallel_gptq._BatchInputs(
        weights=weights,
        hessians=hessians,
        num_samples=[torch.tensor(1024.0, device=device) for _ in weights],
        qparams=[
            {"scale": scale, "zero_point": torch.zeros_like(scale, dtype=torch.int8),
             "global_scale": None}
            for scale in scales
        ],
        quant_args=quant_args,
    )


def chunk_inputs(inputs: parallel_gptq._BatchInputs, start: int, stop: int) -> parallel_gptq._BatchInputs:
    return parallel_gptq._BatchInputs(
        weights=inputs.weights[start:stop],
        hessians=inputs.hessians[start:stop],
        num_samples=inputs.num_samples[start:stop],
        qparams=inputs.qparams[start:stop],
        quant_args=inputs.quant_args,
    )


def split_batch_matches_whole(inputs: parallel_gptq._BatchInputs, devices: list[str]) -> None:
    """A batch cut by `split_for_devices` and run on the pool gives stock's whole-batch bits."""
    home = inputs.weights[0].device
    update = functools.partial(parallel_gptq._quantize_batch, blocksize=128, percdamp=0.01)
    whole = update(inputs, home)
    members = [torch.nn.Identity() for _ in inputs.weights]
    chunks = split_for_devices([members], len(devices))
    assert len(chunks) == len(devices) and sum(len(c) for c in chunks) == len(members)
    jobs, start = [], 0
    for index, chunk in enumerate(chunks):
        jobs.append(UpdateJob(f"chunk {index}", chunk_inputs(inputs, start, start + len(chunk)), home, 0))
        start += len(chunk)
    with DeviceWorkerPool(devices) as pool:
        results = run_update_jobs(pool, jobs, update)
    print("chunks of", [len(c) for c in chunks], "ran on:", [result.place for result in results])
    quantized = torch.cat([result.value.quantized.to(home) for result in results])
    losses = [loss for result in results for loss in result.value.losses]
    differing = (quantized != whole.quantized).any(dim=(1, 2)).sum().item()
    print(f"{len(members)} modules, {differing} differ from the whole batch")
    assert torch.equal(quantized, whole.quantized)
    assert losses == whole.losses
    for name in ("scales", "zero_points"):
        assert torch.equal(
            torch.cat([getattr(r.value, name).to(home) for r in results]), getattr(whole, name)
        )


def test_split_batches_keep_order_and_small_batches():
    modules = [torch.nn.Identity() for _ in range(70)]
    assert split_for_devices([modules[:31]], 4) == [modules[:31]]  # < 2 x 16: whole
    assert split_for_devices([modules], 1) == [modules]
    chunks = split_for_devices([modules[:40], modules[40:]], 4)
    assert [len(c) for c in chunks] == [20, 20, 30]  # 30 < 32: one chunk
    assert [m for c in chunks for m in c] == modules
    assert [len(c) for c in split_for_devices([modules[:64]], 3)] == [22, 21, 21]


def test_split_batch_equals_whole_batch_on_cpu():
    split_batch_matches_whole(synthetic_batch(40, 64, 256, torch.device("cpu")), ["cpu", "cpu"])


@pytest.mark.gpu  # skipped by conftest.py without 2 GPUs
@pytest.mark.parametrize("shape", [(40, 256, 512), (256, 768, 2048), (128, 2048, 768)],
                         ids=["small", "qwen3-30b-gate-up", "qwen3-30b-down"])
def test_split_batch_on_two_gpus_equals_whole_batch(shape):
    split_batch_matches_whole(synthetic_batch(*shape, torch.device("cuda", 0)), ["cuda:0", "cuda:1"])


@pytest.mark.gpu  # skipped by conftest.py without 2 GPUs
def test_batch_on_second_gpu_equals_home_gpu():
    """A stacked batch large enough for the batched Cholesky path, home vs cuda:1."""
    home = torch.device("cuda", 0)
    inputs = synthetic_batch(20, 256, 512, home)
    update = functools.partial(parallel_gptq._quantize_batch, blocksize=128, percdamp=0.01)
    expected = update(inputs, home)
    jobs = [UpdateJob("warm-up", inputs, home, 0), UpdateJob("batch", inputs, home, 0)]
    with DeviceWorkerPool(["cuda:1"]) as pool:
        results = run_update_jobs(pool, jobs, update)
    print("ran on:", [result.place for result in results])
    assert results[1].device == torch.device("cuda", 1)
    for result in results:
        assert torch.equal(result.value.quantized.cpu(), expected.quantized.cpu())
        assert result.value.losses == expected.losses


@pytest.mark.gpu  # skipped by conftest.py without 2 GPUs
def test_inputs_from_another_gpu_are_read_after_the_caller_wrote_them():
    """A worker copies its inputs from cuda:0 on a stream of its own: the copy must still
    come after what the caller queued on cuda:0's stream before the pool started (here a
    long sleep, then the write of the value), not read the tensor before it is written."""
    home = torch.device("cuda", 0)
    value = torch.zeros(1 << 20, device=home)
    torch.cuda.synchronize(home)
    torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time queued ahead of the write
    value.fill_(3.0)
    jobs = [UpdateJob("from cuda:0", {"x": value}, home, 1)]
    with DeviceWorkerPool(["cuda:1"]) as pool:  # warmed: no job in the caller, which would sync
        results = run_update_jobs(pool, jobs, lambda inputs, device: inputs["x"].sum().item(), {None})
    assert results[0].device == torch.device("cuda", 1)
    assert results[0].value == 3.0 * (1 << 20)
