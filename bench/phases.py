"""Per-phase wall times of a oneshot() run, measured by wrapping library functions.

Phases of each decoder layer: `capture` (the pipeline's calibration forwards that
record the layer inputs), `reference` (auto-round's no-grad pass for the float
outputs), `tuning` (the SignRound loop), `quantized_input` (the no-grad pass through
the quantized layer), and around those `block` (auto-round's whole `quantize_block`:
its set-up, wrapping and unwrapping included; the rest of `layer_work` is
llm-compressor's and the data-parallel modifier's own work around it); for GPTQ:
`calibration`, `updates`, `propagation`.
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from typing import Callable, Iterator

import torch

from oneshot_runs import block_losses


def sync_gpus() -> None:
    """Wait for every GPU: timings at phase edges then include the work launched before."""
    if torch.cuda.is_available():
        for index in range(torch.cuda.device_count()):
            torch.cuda.synchronize(index)


class PhaseTimer:
    def __init__(self) -> None:
        self.layers: list[dict[str, float]] = []
        self.losses: list[tuple[float, float]] = []
        self._current: dict[str, float] = defaultdict(float)
        self._mark = time.perf_counter()

    def add(self, phase: str, seconds: float) -> None:
        self._current[phase] += seconds

    def close_layer(self) -> None:
        self.layers.append(dict(self._current))
        self._current = defaultdict(float)

    @contextlib.contextmanager
    def timed(self, phase: str) -> Iterator[None]:
        sync_gpus()
        start = time.perf_counter()
        try:
            yield
        finally:
            sync_gpus()
            self.add(phase, time.perf_counter() - start)


@contextlib.contextmanager
def patched(owner: object, name: str, make: Callable[[Callable], Callable]) -> Iterator[None]:
    """`owner.name` replaced by `make(original)` while active, then the original restored."""
    raw = vars(owner).get(name, getattr(owner, name))  # the descriptor itself, for restoring
    setattr(owner, name, make(getattr(owner, name)))
    try:
        yield
    finally:
        setattr(owner, name, raw)


@contextlib.contextmanager
def autoround_phases(timer: PhaseTimer, fine: bool = False) -> Iterator[None]:
    """Time an AutoRound run's phases (module docstring); `fine` adds the tuning loop's
    parts (`tuning.forward`, `.backward`, `.step`, `.best_params`).

    Every timed phase synchronises the GPUs at both edges. The coarse phases do so a
    few times a layer; the fine ones three times an iteration, which stops the host
    from queueing the next part while the GPUs finish the last: the layer then runs
    slower than it does unmeasured. Read per-layer times from a coarse run.
    """
    from auto_round.algorithms.block_runner import BlockForwardRunner
    from auto_round.algorithms.quantization.sign_round import quantizer as quantizer_module
    from auto_round.algorithms.quantization.sign_round.quantizer import SignRoundQuantizer
    from auto_round.compressors.orchestrator import CompressionOrchestrator
    from llmcompressor.modifiers.autoround import AutoRoundModifier

    full_passes = {"count": 0}

    def forward(original):
        def wrapper(self, block, inputs, input_others, indices=None, cache_device=None):
            if indices is not None:
                if not fine:
                    return original(self, block, inputs, input_others, indices, cache_device)
                with timer.timed("tuning.forward"):
                    return original(self, block, inputs, input_others, indices, cache_device)
            phase = "reference" if full_passes["count"] % 2 == 0 else "quantized_input"
            full_passes["count"] += 1
            with timer.timed(phase):
                return original(self, block, inputs, input_others, indices, cache_device)
        return wrapper

    def timed_as(phase: str):
        def make(original):
            def wrapper(*args, **kwargs):
                with timer.timed(phase):
                    return original(*args, **kwargs)
            return wrapper
        return make

    def epoch_end(original):
        def wrapper(self, *args, **kwargs):
            sync_gpus()
            timer.add("capture", time.perf_counter() - timer._mark)
            with timer.timed("layer_work"):
                result = original(self, *args, **kwargs)
            timer.close_layer()
            timer._mark = time.perf_counter()
            return result
        return wrapper

    with contextlib.ExitStack() as stack:
        timer.losses = stack.enter_context(block_losses())
        stack.enter_context(patched(BlockForwardRunner, "forward", forward))
        stack.enter_context(patched(SignRoundQuantizer, "quantize_block", timed_as("tuning")))
        stack.enter_context(patched(CompressionOrchestrator, "quantize_block", timed_as("block")))
        if fine:
            stack.enter_context(
                patched(SignRoundQuantizer, "_scale_loss_and_backward", timed_as("tuning.backward"))
            )
            stack.enter_context(patched(SignRoundQuantizer, "_step", timed_as("tuning.step")))
            stack.enter_context(
                patched(quantizer_module, "collect_best_params", timed_as("tuning.best_params"))
            )
        stack.enter_context(patched(AutoRoundModifier, "on_sequential_epoch_end", epoch_end))
        timer._mark = time.perf_counter()
        yield


@contextlib.contextmanager
def gptq_phases(timer: PhaseTimer) -> Iterator[None]:
    """calibration (hooked forwards), updates (the layer's GPTQ solves), propagation.

    Per subgraph the pipelines run: calibration pass, `on_sequential_epoch_end`
    (the updates), then the propagation pass inside `HooksMixin.disable_hooks()`;
    the propagation time is credited to the layer that was just updated.
    """
    from llmcompressor.modifiers.gptq import GPTQModifier
    from llmcompressor.modifiers.utils.hooks import HooksMixin

    def epoch_end(original):
        def wrapper(self, *args, **kwargs):
            sync_gpus()
            timer.add("calibration", time.perf_counter() - timer._mark)
            with timer.timed("updates"):
                result = original(self, *args, **kwargs)
            timer.close_layer()
            timer._mark = time.perf_counter()
            return result
        return wrapper

    original_disable = HooksMixin.disable_hooks.__func__

    @contextlib.contextmanager
    def disable_hooks(cls, *args, **kwargs):
        sync_gpus()
        start = time.perf_counter()
        with original_disable(cls, *args, **kwargs):
            yield
        sync_gpus()
        if timer.layers:
            layer = timer.layers[-1]
            layer["propagation"] = layer.get("propagation", 0.0) + time.perf_counter() - start
        timer._mark = time.perf_counter()

    with contextlib.ExitStack() as stack:
        stack.enter_context(patched(GPTQModifier, "on_sequential_epoch_end", epoch_end))
        stack.enter_context(patched(HooksMixin, "disable_hooks", lambda _: classmethod(disable_hooks)))
        timer._mark = time.perf_counter()
        yield
