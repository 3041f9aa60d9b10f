"""DataParallelAutoRoundModifier: stock AutoRound, each layer's work fanned out.

The stock modifier and auto-round's tuning loop run unchanged. While auto-round
works on a layer (`quantize_block`: reference outputs, SignRound iterations,
quantized-input chain), the layer's forward is a `FanOut` over the worker pool,
so every batch of every pass is split over the replicas. With `grouped_experts`,
linearised MoE experts run grouped there and in the pipeline's input-capture pass.
The pool lives from calibration start: a decoder layer's forward raising in the
pipeline's pass stops it (`worker_guard`); a failure in auto-round's own work on a
layer stops it from `apply_autoround`.
"""

from __future__ import annotations

import contextlib
from typing import Any, ClassVar, ContextManager, Iterator, Literal, Mapping, Sequence

import torch
from compressed_tensors.utils import get_execution_device
from loguru import logger
from pydantic import PrivateAttr, field_validator
from torch import nn
from torch.utils._pytree import tree_map

import llmcompressor.modifiers.autoround.base as stock_autoround
from llmcompressor.core import Event, State
from llmcompressor.modeling.moe.linear_experts import LinearExperts2D
from llmcompressor.modifiers.autoround import AutoRoundModifier

from llmcompressor_parallel.engine import DeviceWorkerPool, FanOut
from llmcompressor_parallel.engine.expert_tokens import TokenMode
from llmcompressor_parallel.engine.exact_weight_grads import ExactWeightGradients
from llmcompressor_parallel.engine.foreach_sign_sgd import use_foreach_sign_sgd
from llmcompressor_parallel.engine.forward_error_hooks import ForwardErrorHooks
from llmcompressor_parallel.engine.gc_scope import young_objects_gc
from llmcompressor_parallel.engine.grouped_autoround import GroupedAutoRoundExperts
from llmcompressor_parallel.engine.uninitialized_fill import skip_fill_while_tuning
from llmcompressor_parallel.modifiers.autoround_capture import GroupedCapture
from llmcompressor_parallel.modifiers.autoround_parallel_capture import (
    PartCapture,
    kept_on,
    kept_on_host,
)
from llmcompressor_parallel.modifiers.data_parallel_options import (
    DataParallelOptions,
    check_allowed,
)
from llmcompressor_parallel.modifiers.layer_safety import restore_layer_on_error
from llmcompressor_parallel.modifiers.pipeline_compat import disable_error_propagation
from llmcompressor_parallel.modifiers.worker_guard import guard_workers

__all__ = ["DataParallelAutoRoundModifier"]


def _log_layer_summary(
    name: str,
    fan_out: FanOut | None,
    grouped: GroupedAutoRoundExperts | None,
    pool: DeviceWorkerPool | None,
) -> None:
    if fan_out is not None:
        logger.info(
            "{}: {} of {} layer calls ran data-parallel on {}",
            name, fan_out.parallel_calls, fan_out.calls, ", ".join(str(d) for d in pool.devices),
        )
    if grouped is not None and grouped.module_names:
        logger.info(
            "{}: experts ran grouped in {} calls, the per-expert loop in {}",
            name, grouped.grouped_calls, grouped.stock_calls,
        )

ParallelBatch = Literal["split", "per_replica"]
_PARALLEL_BATCH_VALUES = ("split", "per_replica")
ExpertTokens = Literal["auto", "all", "routed"]
_EXPERT_TOKENS: dict[str, TokenMode] = {"auto": "auto", "all": True, "routed": False}
# a captured input kept where it is (copied on its device) instead of stock's copy to host
_KEPT_ON_OWN_DEVICE = kept_on(None)


class DataParallelAutoRoundModifier(AutoRoundModifier, DataParallelOptions):
    """AutoRoundModifier whose per-layer work runs data-parallel over replicas.

    Every stock field works as in `AutoRoundModifier`. Added:

    :param data_parallel: "off" (default: exactly the stock modifier), "auto" (all
        visible GPUs), an int N >= 2 (cuda:0..N-1) or a list of device strings
        (["cuda:0", "cuda:2"], or ["cpu", "cpu"] for testing without a GPU)
    :param parallel_batch: "split" (default: `batch_size` stays the global batch of
        an iteration and is split over the replicas) or "per_replica" (each replica
        gets `batch_size` samples; the global batch is N x `batch_size`)
    :param keep_cache_on_gpu: keep auto-round's per-layer caches (captured inputs,
        reference outputs, best parameters) on the layer's GPU instead of in host
        memory, where stock keeps them (`low_gpu_mem_usage=True`); the pipeline's
        input capture then keeps each batch's layer inputs on their device too (a
        device copy instead of stock's copy to host). Same numbers;
        removes the host copies that every tuning iteration otherwise makes in
        turn, which bound the speed-up of the fan-out and of grouped experts. None
        (default): on when the layer runs data-parallel or has linearised MoE experts
        that run grouped, off otherwise (stock).
    :param grouped_experts: while a layer is tuned, run llm-compressor's linearised MoE
        experts grouped (stacked weights, all experts fake-quantized in a few batched
        calls of auto-round's own quantizer, grouped matmuls) instead of one wrapped
        Linear at a time; each expert keeps its own tuning parameters, so auto-round's
        loop and the saved layout are stock's. The pipeline's input-capture pass of the
        layer (its calibration forwards) runs the experts grouped too. Unsupported
        schemes or hooks fall back to the per-expert loop with a log line. False: the
        per-expert loop everywhere (stock).
    :param grouped_expert_tokens: with grouped experts, in llm-compressor's all-experts
        mode (oneshot's default), which tokens each expert is tuned on. "all": every
        token, as stock (stock's gradient sums; transients of experts x tokens x
        hidden, e.g. 2 x 8.6 GB input gradients at the Qwen3-30B-A3B shape and 16K
        tokens a call). "routed": the tokens routed to it (the same math up to
        floating-point order, top_k/experts of the FLOPs and memory). "auto"
        (default): "routed" when data-parallel with `exact_gradients=False` (the split
        batch then sums gradients in another order than stock anyway); otherwise "all"
        where its estimated transients fit the device's free memory (serially at the
        layer's first tuning call; with exact gradients before it, for the whole
        batch), else "routed" with a log line.
    :param grouped_qdq_once: with grouped experts and data-parallel replicas: in each
        fanned-out tuning call the layer's device fake-quantizes the experts' weights
        once and sends the two quantized stacks to the replicas (one differentiable
        copy each), instead of sending every expert's tuning parameters and letting
        each replica repeat the whole qdq (default True; the forward is the same bit
        for bit, gradients are summed before the one qdq backward). Where a replica's
        experts could not run grouped, that call runs serially, with a log line.
        False: each replica receives the parameters and computes its own qdq.
    :param exact_gradients: data-parallel tuning sums each wrapped Linear's weight
        gradient as stock does: the layer's device fake-quantizes the weight once, the
        replicas run the Linear on their rows, and the weight gradient is one matmul
        over the whole batch's gathered rows on the layer's device (default True:
        stock's integers on CPU, exact_weight_grads.py). False: each replica sums its
        own rows' weight gradient and the partials are added; the weight-gradient
        matmuls then run in parallel too, and the integers differ from stock's in
        about a quarter of places after tens of iterations (SignSGD amplifies the
        different summation order; quality within stock's seed noise band,
        docs/quality.md). Experts that run grouped gather their stacks' gradients the
        same way when tuned on all tokens with `grouped_qdq_once` (with
        `grouped_expert_tokens="auto"` the tokens are then chosen by memory, not
        "routed"); on routed tokens or without qdq once they keep per-replica sums.
    :param nan_fill_new_tensors: auto-round switches on torch's deterministic
        algorithms, under which torch fills every new tensor with NaN
        (`torch.utils.deterministic.fill_uninitialized_memory`). False (default):
        while auto-round's tuning loop runs (its block quantizer's `quantize_block`)
        the fills are skipped; they change no value (stock's integers, tests) and
        cost one kernel per new tensor (2 H200s, Qwen3-30B-A3B shape: tuning 7.5-12%
        faster without them). True: filled, as stock.
    """

    merged_hook: ClassVar[str] = "input_capture_hook"

    parallel_batch: ParallelBatch = "split"
    keep_cache_on_gpu: bool | None = None
    grouped_experts: bool = True
    grouped_expert_tokens: ExpertTokens = "auto"
    grouped_qdq_once: bool = True
    exact_gradients: bool = True
    nan_fill_new_tensors: bool = False

    _devices: list[torch.device] | None = PrivateAttr(default=None)
    _pool: DeviceWorkerPool | None = PrivateAttr(default=None)
    _capture: GroupedCapture | None = PrivateAttr(default=None)
    _worker_guard: ForwardErrorHooks | None = PrivateAttr(default=None)
    _in_parallel_pipeline: bool = PrivateAttr(default=False)
    _part_capture: PartCapture | None = PrivateAttr(default=None)

    @field_validator("parallel_batch", mode="before")
    @classmethod
    def _check_parallel_batch(cls, value: Any) -> str:
        return check_allowed("parallel_batch", value, _PARALLEL_BATCH_VALUES)

    @field_validator(
        "grouped_experts", "grouped_qdq_once", "exact_gradients", "nan_fill_new_tensors",
        mode="before",
    )
    @classmethod
    def _check_flags(cls, value: Any, info: Any) -> bool:
        return check_allowed(info.field_name, value, (True, False))

    @field_validator("grouped_expert_tokens", mode="before")
    @classmethod
    def _check_grouped_expert_tokens(cls, value: Any) -> str:
        return check_allowed("grouped_expert_tokens", value, _EXPERT_TOKENS)

    @field_validator("keep_cache_on_gpu", mode="before")
    @classmethod
    def _check_keep_cache_on_gpu(cls, value: Any) -> bool | None:
        return check_allowed("keep_cache_on_gpu", value, (None, True, False))

    # ------------------------------------------------------------ lifecycle
    def on_initialize(self, state: State, **kwargs) -> bool:
        self._devices = self.resolve_parallel_devices()
        if self._devices is not None and self.parallel_batch == "per_replica":
            logger.info(
                "parallel_batch='per_replica': global batch is {} x {} = {} samples",
                len(self._devices),
                self.batch_size,
                len(self._devices) * self.batch_size,
            )
        return super().on_initialize(state, **kwargs)

    def on_calibration_start(self, state: State, event: Event, **kwargs):
        super().on_calibration_start(state, event, **kwargs)
        disable_error_propagation()
        if self.grouped_experts and self._capture is None:
            self._capture = GroupedCapture()
        if self._devices is not None and self._pool is None:
            self._pool = DeviceWorkerPool(self._devices)
        if self._pool is not None and self._worker_guard is None and not self._in_parallel_pipeline:
            # "parallel_sequential" stops the workers itself when a pass raises
            self._worker_guard = guard_workers(
                type(self).__name__, state.model, self._sequential_targets, self.close_workers
            )

    def input_capture_hook(self, module: nn.Module, args: Any, kwargs: Any) -> None:
        """Stock's capture; then the rest of the layer's calibration pass runs its
        experts grouped (autoround_capture.py).

        Where the layer's caches stay on the GPU, the inputs are kept where they are
        (copied on their device) instead of copied to host memory, from where
        auto-round would copy them back before tuning: stock's copies to host are
        synchronous and cost about 0.4 s of a 3.6 s capture pass (Qwen3-30B-A3B
        shape, 128 samples, one H200).
        """
        if self._part_capture is not None:
            return  # a data-parallel capture pass records per part (autoround_parallel_capture.py)
        if self._keeps_cache_on_gpu(module):
            keep = _KEPT_ON_OWN_DEVICE
            inputs = self._all_module_input.setdefault(module._tmp_name, [])
            inputs.append((tree_map(keep, args), tree_map(keep, kwargs)))
        else:
            super().input_capture_hook(module, args, kwargs)
        if self._capture is not None:
            self._capture.opened(module)

    # ------------------------------------------------------------ data-parallel capture
    # (the ParallelCalibrationParticipant protocol of `calibration_pipeline`; its
    # common part is DataParallelOptions')
    def begin_parallel_calibration(
        self, modules: Sequence[nn.Module], parts: Sequence[Mapping[nn.Module, nn.Module]]
    ) -> None:
        """Per-part capture hooks on what each part runs; the stock hook pauses meanwhile."""
        if self._part_capture is not None:
            raise RuntimeError("a parallel capture pass is already running")
        layers = {}
        for layer in modules:
            keep = kept_on(get_execution_device(layer)) if self._keeps_cache_on_gpu(layer) else kept_on_host
            layers[layer] = (layer._tmp_name, keep)
        self._part_capture = PartCapture(layers, parts)

    def end_parallel_calibration(self, merge: bool) -> None:
        """Remove the per-part hooks; with `merge`, the parts' records join stock's list."""
        capture, self._part_capture = self._part_capture, None
        if capture is None:
            return
        capture.remove()
        if merge:
            capture.merge_into(self._all_module_input)

    def parallel_pass(
        self,
        parts: Sequence[Mapping[nn.Module, nn.Module]],
        devices: Sequence[torch.device],
        calibrating: bool,
    ) -> ContextManager[None]:
        """Around each data-parallel capture pass: every part's experts run grouped."""
        if not calibrating or self._capture is None or not parts:
            return contextlib.nullcontext()
        layers = {m: m._tmp_name for m in parts[0] if self._is_decoding_layer(m)}
        return self._capture.on_parts(layers, parts)

    def on_sequential_epoch_end(
        self, state: State, event: Event, modules: list[nn.Module], **kwargs
    ):
        modules = list(modules or [])
        self._close_capture(modules)  # stock's apply_autoround gets the layer as stock has it
        return super().on_sequential_epoch_end(state, event, modules, **kwargs)

    def _keeps_cache_on_gpu(self, model: nn.Module | None = None) -> bool:
        """The knob, or by default: on where the host copies bound the speed-up.

        That is when the layer runs data-parallel, and when `model` (the layer
        auto-round is given) has linearised MoE experts that run grouped: there the
        copies cost about as much as the grouped tuning itself (Qwen3-30B-A3B shape,
        one H200: 27.2 -> 18.1 s a layer, same integers).
        """
        if self.keep_cache_on_gpu is not None:
            return self.keep_cache_on_gpu
        if self._pool is not None:
            return True
        return (
            self.grouped_experts
            and model is not None
            and any(isinstance(module, LinearExperts2D) for module in model.modules())
        )

    def _expert_token_mode(self) -> TokenMode:
        """`grouped_expert_tokens` as the grouped experts take it.

        "auto" under data-parallel with `exact_gradients=False` is "routed": splitting
        the batch then sums the experts' gradients in another order than stock anyway,
        so all-tokens mode would cost experts/top_k times the expert FLOPs for no
        agreement with stock (Qwen3-30B-A3B shape, 2 H200s: 17.6 -> 13.7 s a layer,
        same integer agreement with stock). With exact gradients "auto" stays the
        memory-based choice, since all tokens then give stock's sums.
        """
        if self.grouped_expert_tokens == "auto" and self._pool is not None and not self.exact_gradients:
            return False
        return _EXPERT_TOKENS[self.grouped_expert_tokens]

    def _wraps_quantize_block(self) -> bool:
        """Whether auto-round's per-layer call runs inside a fan-out or grouped experts."""
        return self._pool is not None or self.grouped_experts

    def apply_autoround(self, state: State, modules: list[nn.Module]):
        # auto-round runs ~6 full garbage collections a layer (gc_scope.py)
        with young_objects_gc():
            return self._apply_autoround(state, modules)

    def _apply_autoround(self, state: State, modules: list[nn.Module]):
        if not self._wraps_quantize_block() and not self._keeps_cache_on_gpu():
            return super().apply_autoround(state, modules)
        layers = [m for m in (modules or []) if self._is_decoding_layer(m)]
        guard = self._worker_guard
        # auto-round runs the layer itself here; its errors are handled below
        paused = guard.paused() if guard is not None else contextlib.nullcontext()
        try:
            with paused, restore_layer_on_error(layers), self._adapted_autoround():
                return super().apply_autoround(state, modules)
        except BaseException:
            self.close_workers()
            raise

    def on_calibration_end(self, state: State, event: Event, **kwargs):
        self.close_workers()
        super().on_calibration_end(state, event, **kwargs)

    def on_finalize(self, state: State, **kwargs) -> bool:
        self.close_workers()
        return super().on_finalize(state, **kwargs)

    def close_workers(self) -> None:
        """Stop the worker threads and end every grouped capture (idempotent).

        Also forgets the pipeline: a modifier reused in another oneshot must find out
        again which pipeline it runs under (its worker guard depends on it).
        """
        self._close_capture(None)
        self.stop_workers()

    def _close_capture(self, layers: list[nn.Module] | None) -> None:
        """Give the experts of `layers` (None: all) back their forwards."""
        if self._capture is not None:
            self._capture.close(layers)

    # ------------------------------------------------------------ the fan-out
    @contextlib.contextmanager
    def _adapted_autoround(self) -> Iterator[None]:
        """Within the stock `apply_autoround`, adapt the `AutoRound` it builds.

        Sets the cache placement, hands auto-round's quantizer the multi-tensor
        SignSGD step (foreach_sign_sgd.py), and fans out each `quantize_block` call: the stock
        method builds its `AutoRound` and suspends compressed-tensors' offloading
        (which resets instance forwards) before calling quantize_block, so the
        fan-out is installed around that call (DESIGN.md trap 1).
        """
        real_factory = stock_autoround.AutoRound
        modifier = self

        def adapted_autoround(*args: Any, **kwargs: Any) -> Any:
            if modifier._keeps_cache_on_gpu(kwargs.get("model")):
                kwargs["low_gpu_mem_usage"] = False
            pool = modifier._pool
            compile_replicas = pool is not None and bool(kwargs.get("enable_torch_compile"))
            if pool is not None:
                kwargs["enable_torch_compile"] = False  # never compile the fan-out itself
                if modifier.parallel_batch == "per_replica":
                    kwargs["batch_size"] = modifier.batch_size * len(pool.devices)
            autoround = real_factory(*args, **kwargs)
            quantize_block = autoround.quantize_block

            # without a pool or grouped experts only the SignSGD step is adapted
            def adapted_quantize_block(block: nn.Module, *q_args: Any, **q_kwargs: Any):
                name = getattr(block, "_tmp_name", type(block).__name__)
                use_foreach_sign_sgd(autoround)
                if not modifier.nan_fill_new_tensors:
                    skip_fill_while_tuning(autoround)
                with contextlib.ExitStack() as stack:
                    # grouped experts first, so that replicas copy the grouped forward
                    grouped = (
                        stack.enter_context(GroupedAutoRoundExperts(
                            block, name,
                            all_tokens=modifier._expert_token_mode(),
                            qdq_once=modifier.grouped_qdq_once,
                            exact=modifier.exact_gradients,
                        ))
                        if modifier.grouped_experts
                        else None
                    )
                    fan_out = (
                        stack.enter_context(FanOut(block, pool, name, compile_replicas))
                        if pool is not None
                        else None
                    )
                    if pool is not None and modifier.exact_gradients:
                        # registered after the grouped experts: prepared after them
                        leave_to = grouped.grouped_modules if grouped is not None else tuple
                        stack.enter_context(ExactWeightGradients(block, name, leave_to))
                    result = quantize_block(block, *q_args, **q_kwargs)
                _log_layer_summary(name, fan_out, grouped, pool)
                return result

            autoround.quantize_block = adapted_quantize_block
            return autoround

        stock_autoround.AutoRound = adapted_autoround
        try:
            yield
        finally:
            stock_autoround.AutoRound = real_factory
