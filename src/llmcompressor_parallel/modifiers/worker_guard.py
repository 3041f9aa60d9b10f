"""Stop a modifier's device workers when a decoder layer's forward raises.

A modifier's worker pool lives from calibration start to calibration end. Under
llm-compressor's stock pipelines ("sequential", "basic", ...) nothing of the modifier
runs when a calibration forward raises, so its worker threads would outlive the
failed run. While a modifier holds a pool outside "parallel_sequential" (whose own
`except` calls `close_workers` of the modifiers taking part in it), `guard_workers`
puts an always-called forward hook (`engine.forward_error_hooks`) on each decoder
layer (the pipeline's sequential targets): when one's forward raises, the modifier's
`close_workers` runs and the error goes on to the caller unchanged. `close_workers`
removes the hooks again (also from inside that failure pass).
"""

from __future__ import annotations

from typing import Callable

from compressed_tensors.utils.match import match_named_modules
from loguru import logger
from torch import nn

from llmcompressor.utils.pytorch.module import ALL_TARGET, infer_sequential_targets

from llmcompressor_parallel.engine.forward_error_hooks import ForwardErrorHooks

__all__ = ["decoder_layers", "guard_workers"]


def decoder_layers(
    model: nn.Module, sequential_targets: str | list[str] | None
) -> dict[nn.Module, str]:
    """The modules the sequential pipelines run one at a time, as they infer them.

    Without such targets (a model with no `_no_split_modules`), the model itself.
    """
    targets = infer_sequential_targets(model, sequential_targets)
    if isinstance(targets, str):
        targets = [targets]
    layers = {}
    if ALL_TARGET not in targets:
        layers = {module: name for name, module in match_named_modules(model, targets)}
    return layers or {model: "<root>"}


def guard_workers(
    owner: str,
    model: nn.Module,
    sequential_targets: str | list[str] | None,
    close_workers: Callable[[], None],
) -> ForwardErrorHooks:
    """Hook the decoder layers of `model`: a raising forward calls `close_workers`.

    The caller removes the hooks (`.remove()`) when it closes its workers otherwise.
    """

    def on_error(module: nn.Module, name: str, error: BaseException) -> None:
        logger.warning(
            "{}: {}: forward raised {}: device workers stop", owner, name, type(error).__name__
        )
        close_workers()

    hooks = ForwardErrorHooks(on_error)
    hooks.add(decoder_layers(model, sequential_targets))
    return hooks
