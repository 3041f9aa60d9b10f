"""ParallelGPTQExpertModifier: stock GPTQ, each layer's calibration and updates on every device.

Calibration: under the "parallel_sequential" pipeline (`calibration_pipeline`,
named with `oneshot(..., pipeline="parallel_sequential")`), a layer's calibration
batches run on replicas of the layer, one per device of the worker pool; this
modifier's Hessian hook then accumulates per replica (`gptq_calibration`) and the
partial sums are merged into stock's statistics before the update. Under any other
pipeline the calibration forwards run serially, as in stock, and the modifier says
once how to enable them; there a decoder layer's forward raising stops the worker
pool (`worker_guard`), as "parallel_sequential" does from its own `except`.

Updates: at the end of each layer, the modifier forms the same update batches stock forms
(`assign_batches`: same-shape modules such as MoE experts stacked for one call).
Instead of quantizing them in turn on the home device, the batches run on the
per-device worker pool (`engine.update_pool`); each worker calls the stock
`prepare_batch` and `quantize_weight` on copies of the batch's weights, Hessians
and qparams. Only when every batch of the layer has succeeded are the results
written back with the stock `update_batch_qparams` (offloaded modules included),
so a failure leaves the layer's weights and the modifier's Hessians untouched. For
modules offloaded to host memory, each worker first copies its results into
page-locked host memory (`engine.host_staging`), so that the write-back copies host
to host instead of from the device into pageable memory. The write-back itself runs
on copy threads, different modules at once, where compressed-tensors' caches
allow it (`gptq_write_back`); the log lines, RTN-fallback names, Hessian drops and
counts follow in the calling thread, in stock's order.

MoE experts: with `grouped_experts=True` (the default), llm-compressor's linearised
experts run grouped in the calibration and propagation forwards (stacked weights,
batched matmuls, Hessians of all experts in a few batched kernels), serially and in
data-parallel passes alike; `gptq_grouped` says what runs grouped when and when
stock's per-expert loop runs instead.

torch.distributed (torchrun, llm-compressor's DDP mode): stock's `compress_modules`
stays in charge: it reduces each module's Hessian to the rank that bin-packing
assigned it to, calls `compress_module_list` with that rank's modules (here: the
update pool over this rank's `data_parallel` devices, `engine.rank_devices`), and
broadcasts the results. Each rank's calibration forwards run data-parallel over its
devices under "parallel_sequential" as in one process; the partials are merged
inside the rank before stock's reduction. Added to stock: a barrier after each
layer's updates when a module executes on CPU (see `compress_modules`).
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections import Counter
from typing import Any, ClassVar, ContextManager, Mapping, NamedTuple, Sequence

import torch
import torch.distributed as dist
from compressed_tensors.offload import disable_offloading
from compressed_tensors.offload.dist_utils import is_distributed
from compressed_tensors.quantization import QuantizationArgs
from compressed_tensors.utils import get_execution_device, getattr_chain
from loguru import logger
from pydantic import PrivateAttr, field_validator
from torch import nn
from torch.utils.hooks import RemovableHandle

from llmcompressor.core import Event, State
from llmcompressor.modifiers.gptq import GPTQModifier
from llmcompressor.modifiers.gptq.gptq_quantize import quantize_weight
from llmcompressor.modifiers.gptq.helpers import (
    GPTQ_PRECISION,
    assign_batches,
    prepare_batch,
)

from llmcompressor_parallel.calibration_pipeline import PIPELINE_NAME
from llmcompressor_parallel.engine.forward_error_hooks import ForwardErrorHooks
from llmcompressor_parallel.engine.host_staging import offloaded_to_host, staged_on_host
from llmcompressor_parallel.engine.update_pool import (
    UpdateJob,
    UpdateResult,
    run_update_jobs,
)
from llmcompressor_parallel.engine.worker_pool import DeviceWorkerPool
from llmcompressor_parallel.modifiers.data_parallel_options import (
    DataParallelOptions,
    check_allowed,
)
from llmcompressor_parallel.modifiers.gptq_batches import split_for_devices
from llmcompressor_parallel.modifiers.gptq_calibration import HessianPartials
from llmcompressor_parallel.modifiers.gptq_grouped import GroupedExpertsWiring
from llmcompressor_parallel.modifiers.gptq_write_back import BatchWrite, write_batches
from llmcompressor_parallel.modifiers.worker_guard import guard_workers

__all__ = ["ParallelGPTQExpertModifier"]


class ParallelGPTQExpertModifier(GPTQModifier, DataParallelOptions):
    """GPTQModifier whose per-layer calibration and weight updates run on a pool of devices.

    Every stock field works as in `GPTQModifier`. The weight updates use the pool
    under any pipeline; the calibration forwards only under
    `oneshot(..., pipeline="parallel_sequential")` (see `calibration_pipeline`).
    Added:

    :param data_parallel: "off" (default: exactly the stock modifier), "auto" (all
        visible GPUs), an int N >= 2 (cuda:0..N-1) or a list of device strings
        (["cuda:0", "cuda:2"], or ["cpu", "cpu"] for testing without a GPU);
        under torch.distributed, this rank's devices ("auto" and N: the host's GPUs
        dealt out over its ranks; a list is the rank's own; `engine.rank_devices`)
    :param grouped_experts: True (default): llm-compressor's linearised MoE experts
        (`LinearExperts2D`) run grouped in the calibration and propagation forwards:
        each layer's expert weights stacked on the execution device when the layer
        is calibrated (dropped after its propagation), the experts' matmuls and the
        per-expert GPTQ Hessians in a few batched kernels, gate and up sharing one
        Hessian; on every replica under the "parallel_sequential" pipeline, the
        replicas' Hessians merged exactly. Same statistics as stock's per-expert
        hooks up to fp32 summation order. An experts module runs stock's loop,
        with one log line, when the grouped engine does not reproduce it (custom
        expert classes), when another hook sits on its experts or their Linears,
        or when quantization is enabled during the forward. False: experts run as
        in stock, bit for bit.
    """

    grouped_experts: bool = True

    composes_with_torch_distributed: ClassVar[bool] = True
    merged_hook: ClassVar[str] = "calibrate_module"

    _devices: list[torch.device] | None = PrivateAttr(default=None)
    _pool: DeviceWorkerPool | None = PrivateAttr(default=None)
    _in_parallel_pipeline: bool = PrivateAttr(default=False)
    _told_how_to_enable: bool = PrivateAttr(default=False)
    _partials: HessianPartials | None = PrivateAttr(default=None)
    _partial_handles: list[RemovableHandle] = PrivateAttr(default_factory=list)
    _grouped: GroupedExpertsWiring | None = PrivateAttr(default=None)
    _sequential_targets_arg: str | list[str] | None = PrivateAttr(default=None)
    _worker_guard: ForwardErrorHooks | None = PrivateAttr(default=None)
    # update-job kinds whose lazy set-up (Triton JIT) has run on this pool
    _warmed_kinds: set[str] = PrivateAttr(default_factory=set)

    @field_validator("grouped_experts", mode="before")
    @classmethod
    def _check_grouped_experts(cls, value: Any) -> bool:
        return check_allowed("grouped_experts", value, (True, False))

    # ------------------------------------------------------------ lifecycle
    def on_initialize(self, state: State, **kwargs) -> bool:
        self._devices = self.resolve_parallel_devices()
        self._sequential_targets_arg = kwargs.get("sequential_targets")
        return super().on_initialize(state, **kwargs)

    def on_calibration_start(self, state: State, event: Event, **kwargs):
        super().on_calibration_start(state, event, **kwargs)
        if self.grouped_experts and self._grouped is None:
            self._grouped = GroupedExpertsWiring(self)
            self._grouped.install(state.model)
        if self._devices is not None and self._pool is None:
            self._pool = DeviceWorkerPool(self._devices)
            self._warmed_kinds = set()
        if self._pool is not None and not self._in_parallel_pipeline:
            if self._worker_guard is None:
                self._worker_guard = guard_workers(
                    type(self).__name__, state.model, self._sequential_targets_arg,
                    self.close_workers,
                )
        if self._devices is not None and not self._in_parallel_pipeline:
            self._tell_how_to_enable()

    def on_sequential_epoch_end(
        self, state: State, event: Event, modules: list[nn.Module], **kwargs
    ):
        try:
            modules = list(modules)
            if self._grouped is not None:
                self._grouped.epoch_end(modules)
            return super().on_sequential_epoch_end(state, event, modules, **kwargs)
        except BaseException:
            self.close_workers()
            raise

    def on_calibration_end(self, state: State, event: Event, **kwargs):
        self._release_grouped(export_pending=True)
        self.close_workers()
        super().on_calibration_end(state, event, **kwargs)

    def on_finalize(self, state: State, **kwargs) -> bool:
        self.close_workers()
        return super().on_finalize(state, **kwargs)

    def close_workers(self) -> None:
        """Stop the worker threads (idempotent); on a failed run also unpatch the experts.

        Also forgets the pipeline: a modifier reused after a failed run must find out
        again which pipeline it runs under.
        """
        self._release_grouped(export_pending=False)
        self.stop_workers()

    def _release_grouped(self, export_pending: bool) -> None:
        """Give the experts their forwards back; drop (or first export) what is held."""
        grouped, self._grouped = self._grouped, None
        if grouped is not None:
            grouped.close(export_pending)

    def _tell_how_to_enable(self) -> None:
        """Once per modifier: the calibration forwards are serial under this pipeline."""
        if self._told_how_to_enable:
            return
        self._told_how_to_enable = True
        logger.warning(
            "{}: data_parallel={!r}: only the weight updates run on the worker pool; "
            "the calibration forwards (most of GPTQ's time on MoE layers) run serially "
            "under this calibration pipeline. To run them data-parallel as well, call "
            "oneshot(..., pipeline={!r}) after importing llmcompressor_parallel.",
            type(self).__name__,
            self.data_parallel,
            PIPELINE_NAME,
        )

    # ------------------------------------------------------------ calibration
    # (the ParallelCalibrationParticipant protocol of `calibration_pipeline`; its
    # common part is DataParallelOptions')
    def begin_parallel_calibration(
        self, modules: Sequence[nn.Module], parts: Sequence[Mapping[nn.Module, nn.Module]]
    ) -> None:
        """Per-part Hessian hooks on what each part runs; the stock hook pauses meanwhile."""
        if self._partials is not None:
            raise RuntimeError("a parallel calibration pass is already running")
        self._partials = HessianPartials(len(parts))
        for part, module_map in enumerate(parts):
            for home in modules:
                hook = self._partials.hook(part, home)
                self._partial_handles.append(module_map[home].register_forward_hook(hook))

    def end_parallel_calibration(self, merge: bool) -> None:
        """Remove the per-part hooks; with `merge`, add the partial sums to stock's dicts.

        Grouped experts' per-part Hessians are merged and exported last: their
        shared gate/up entries must not be added into by the partials' in-place merge.
        """
        handles, self._partial_handles = self._partial_handles, []
        for handle in handles:
            handle.remove()
        partials, self._partials = self._partials, None
        offset = len(self._hessians)
        if merge and partials is not None:
            merged = partials.merge_into(self._hessians, self._num_samples)
            logger.debug(
                "merged {} replicas' Hessians of {} modules ({} input products shared)",
                partials.parts, merged, sum(partials.shared_products),
            )
        if self._grouped is not None:
            self._grouped.merge_parallel(merge, offset)

    def parallel_pass(
        self,
        parts: Sequence[Mapping[nn.Module, nn.Module]],
        devices: Sequence[torch.device],
        calibrating: bool,
    ) -> ContextManager[None]:
        """Around each data-parallel pass: every part's experts run grouped (if enabled)."""
        if self._grouped is None:
            return contextlib.nullcontext()
        return self._grouped.parallel_pass(parts, devices, calibrating)

    def calibrate_module(
        self, module: nn.Module, args: tuple[torch.Tensor, ...], _output: torch.Tensor
    ) -> None:
        """Stock's hook, paused while a parallel pass accumulates through per-part hooks."""
        if self._partials is not None:
            return None
        return super().calibrate_module(module, args, _output)

    # ------------------------------------------------------------ the updates
    def compress_modules(self) -> None:
        """Stock's (rank assignment, Hessian reduction, broadcast), then a barrier if needed.

        Stock broadcasts a rank's results only for modules that execute on an
        accelerator: CPU-executed modules live in memory shared by the ranks
        (compressed-tensors' `DistributedCPUCache`), which the owning rank writes.
        Nothing then waits for those writes, so a rank can start propagating (or
        the next layer) with another rank's modules of this layer not yet written,
        and runs differ from each other. The barrier makes every rank wait for them;
        it changes no arithmetic. Every rank decides alike (same modules, same
        execution devices), so the collective is matched.
        """
        cpu_executed = is_distributed() and any(
            torch.device(get_execution_device(module)).type == "cpu" for module in self._hessians
        )
        super().compress_modules()
        if cpu_executed:
            dist.barrier()

    def compress_module_list(self, module_list: list[nn.Module]) -> None:
        """Stock batches (large ones in one chunk per device), run on the pool.

        Written back only once every batch has succeeded; the writes on the pool's
        threads where that is safe (`gptq_write_back`), the modifier's own records
        after them, in stock's order, in this thread. A failed write leaves the
        records (Hessians, counts) untouched.
        """
        if self._pool is None:
            return super().compress_module_list(module_list)
        batches = split_for_devices(
            assign_batches(module_list, self.batched_quantization, self.block_size),
            len(self._pool.devices),
        )
        if not batches:
            return None
        update = functools.partial(
            _quantize_batch, blocksize=self.block_size, percdamp=self.dampening_frac
        )
        with torch.no_grad(), disable_offloading():
            jobs = [self._batch_job(batch) for batch in batches]
            start = time.perf_counter()
            results = run_update_jobs(self._pool, jobs, update, self._warmed_kinds)
            self._log_placement(results, time.perf_counter() - start)
            write_batches(
                [self._batch_write(batch, result) for batch, result in zip(batches, results)]
            )
            for batch, result in zip(batches, results):
                self._record(batch, result)
        return None

    def _batch_job(self, batch: list[nn.Module]) -> UpdateJob:
        """Gather a batch's inputs in the calling thread, as stock's loop does.

        `get_qparams` is called in stock's order: it clears observer statistics,
        cooperatively across fused observers (global scales), so the order matters.
        Hessians stay in the modifier's dicts until write-back: a failure leaves
        them, like the layer's weights, as they were.
        """
        names = [self._module_names[module] for module in batch]
        logger.info("Quantizing {} module(s): {}", len(batch), names)
        inputs = _BatchInputs(
            weights=[module.weight for module in batch],
            hessians=[self._hessians[module] for module in batch],
            num_samples=[self._num_samples[module] for module in batch],
            qparams=[module.weight_observer.get_qparams() for module in batch],
            quant_args=getattr_chain(batch[0], "quantization_scheme.weights"),
            stage_on_host=all(offloaded_to_host(module) for module in batch),
        )
        return UpdateJob(
            name=names[0] if len(names) == 1 else f"{names[0]} (+{len(names) - 1})",
            inputs=inputs,
            home=torch.device(get_execution_device(batch[0])),
            bytes_needed=_batch_bytes(inputs, self.block_size),
            # what Triton specialises GPTQ's kernels on, besides shapes
            kind=f"{inputs.weights[0].dtype}|{inputs.quant_args!r}|{self.block_size}",
        )

    def _batch_write(self, batch: list[nn.Module], result: UpdateResult) -> BatchWrite:
        """What stock's `update_batch_qparams` gets for one batch."""
        outputs: _BatchOutputs = result.value
        return BatchWrite(
            names=[self._module_names[module] for module in batch],
            modules=batch,
            quantized=outputs.quantized,
            scales=outputs.scales,
            zero_points=outputs.zero_points,
            global_scales=outputs.global_scales,
            quant_args=getattr_chain(batch[0], "quantization_scheme.weights"),
        )

    def _record(self, batch: list[nn.Module], result: UpdateResult) -> None:
        """Stock's bookkeeping of a written batch: losses logged, fallbacks named, stats dropped."""
        outputs: _BatchOutputs = result.value
        names = [self._module_names[module] for module in batch]
        for name, loss, fallback in zip(names, outputs.losses, outputs.used_rtn_fallback):
            _log_metric(f"{name}: GPTQ error {loss:.2f}, {result.place}")
            if fallback:
                self._rtn_fallback_module_names.append(name)
        for module in batch:
            self._hessians.pop(module)
            self._num_samples.pop(module)
        self._num_compressed_modules += len(batch)

    @staticmethod
    def _log_placement(results: list[UpdateResult], wall_seconds: float) -> None:
        batches = Counter(result.place for result in results)
        logger.info(
            "GPTQ updates: {} batch(es) on {}: {:.2f} s wall, {:.2f} s of job time",
            len(results),
            ", ".join(f"{place} x{count}" for place, count in batches.items()),
            wall_seconds,
            sum(result.seconds for result in results),
        )


class _BatchInputs(NamedTuple):
    """What one batch's `quantize_weight` needs; a pytree the pool copies to a device."""

    weights: list[torch.Tensor]
    hessians: list[torch.Tensor]
    num_samples: list[torch.Tensor]
    qparams: list[dict[str, torch.Tensor | None]]
    quant_args: QuantizationArgs
    stage_on_host: bool = False  # the modules live in host memory (engine.host_staging)


class _BatchOutputs(NamedTuple):
    """One batch's results, on the device that computed them."""

    quantized: torch.Tensor
    scales: torch.Tensor
    zero_points: torch.Tensor
    global_scales: torch.Tensor | None
    losses: list[float]
    used_rtn_fallback: list[bool]


class _Member:
    """Stands in for a module in stock `prepare_batch`, which reads only `.weight`."""

    __slots__ = ("weight",)

    def __init__(self, weight: torch.Tensor):
        self.weight = weight


def _quantize_batch(
    inputs: _BatchInputs, device: torch.device, *, blocksize: int, percdamp: float
) -> _BatchOutputs:
    """Stock `prepare_batch` + `quantize_weight` on tensors already on `device`."""
    members = [_Member(weight) for weight in inputs.weights]
    weights, hessians, scales, zero_points, global_scales = prepare_batch(
        members,
        inputs.qparams,
        dict(zip(members, inputs.hessians)),
        dict(zip(members, inputs.num_samples)),
    )
    quantized, losses, used_rtn_fallback = quantize_weight(
        weights=weights,
        hessians=hessians,
        scale=scales,
        zero_point=zero_points,
        global_scale=global_scales,
        quant_args=inputs.quant_args,
        blocksize=blocksize,
        percdamp=percdamp,
    )
    outputs = _BatchOutputs(
        # stock casts each row to the module's dtype at write-back; the same cast
        # here halves what the worker holds until then
        quantized=quantized.to(dtype=inputs.weights[0].dtype),
        scales=scales,
        zero_points=zero_points,
        global_scales=global_scales,
        losses=losses.tolist(),
        used_rtn_fallback=used_rtn_fallback.tolist(),
    )
    return staged_on_host(outputs) if inputs.stage_on_host else outputs


def _batch_bytes(inputs: _BatchInputs, block_size: int) -> int:
    """Estimated peak device memory of one batch on a worker.

    Stock's own per-module estimate of `quantize_weight` (`max_batch_size`), plus
    what a worker holds besides: the received weight and Hessian copies, the
    normalised Hessians before stacking, and the result until write-back.
    """
    weight, hessian = inputs.weights[0], inputs.hessians[0]
    weight_size, hessian_size = weight.numel(), hessian.numel()
    quantization_peak = hessian_size + 3 * weight_size + 4 * weight.shape[0] * block_size
    actorder_peak = 3 * hessian_size + 2 * weight_size
    fp32 = torch.finfo(GPTQ_PRECISION).bits // 8
    working = max(quantization_peak, actorder_peak) * fp32
    held = 2 * hessian_size * fp32 + 2 * weight_size * weight.element_size()
    return len(inputs.weights) * (working + held)


def _log_metric(message: str) -> None:
    """Per-module loss at llm-compressor's METRIC level (absent when metrics are off)."""
    try:
        logger.level("METRIC")
    except ValueError:
        return
    logger.log("METRIC", message)
