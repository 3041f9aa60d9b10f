"""The pipeline's input-capture pass of a layer, with its MoE experts grouped.

Stock `AutoRoundModifier` captures each decoder layer's inputs with a forward-pre
hook (`input_capture_hook`) while the sequential pipeline runs the layer's
calibration pass; the layer then runs in full (its outputs are the next layer's
inputs), llm-compressor's linearised experts one Linear at a time: about 10 s of a
~30 s Qwen3-30B-A3B layer on an H200. Our modifier's capture hook calls `opened`
here: at a layer's first batch, `GroupedAutoRoundExperts` is entered on that layer,
so the rest of the pass runs its experts grouped (or, per experts module and reason,
the stock loop with a log line). Nothing of llm-compressor is patched; only that
layer's experts' instance forwards change, and they get their own forwards back
(`close`) at the layer's epoch end, before stock's `apply_autoround` sees the layer,
or when the layer's forward raises (`engine.forward_error_hooks`: an always-called
forward hook, removed without breaking torch's iteration over the layer's hooks).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass

from loguru import logger
from torch import nn

from llmcompressor_parallel.engine.forward_error_hooks import ForwardErrorHooks
from llmcompressor_parallel.engine.grouped_autoround import GroupedAutoRoundExperts
from llmcompressor_parallel.engine.grouped_ops import Backend

__all__ = ["GroupedCapture"]


@dataclass
class _OpenLayer:
    name: str
    context: GroupedAutoRoundExperts


class GroupedCapture:
    """The layers whose calibration pass currently runs with grouped experts.

    :param backend: segment-matmul kernel for `GroupedAutoRoundExperts`
    """

    def __init__(self, backend: Backend = "auto") -> None:
        self.backend = backend
        self._open: dict[nn.Module, _OpenLayer] = {}
        self._on_error = ForwardErrorHooks(self._close_on_error)
        # per layer name: (grouped calls, stock-loop calls), kept after close
        self.counts: dict[str, tuple[int, int]] = {}

    def opened(self, layer: nn.Module) -> None:
        """Called at each captured batch of `layer`: group its experts from the first on."""
        if layer in self._open:
            return
        name = f"{getattr(layer, '_tmp_name', type(layer).__name__)}"
        context = GroupedAutoRoundExperts(layer, f"{name} (input capture)", self.backend)
        context.__enter__()
        try:
            self._on_error.add({layer: name})
        except BaseException:
            context.__exit__(*sys.exc_info())
            raise
        self._open[layer] = _OpenLayer(name, context)

    def close(self, layers: Iterable[nn.Module] | None = None) -> None:
        """Give the experts of `layers` (default: all open ones) their forwards back."""
        targets = list(self._open) if layers is None else [m for m in layers if m in self._open]
        for layer in targets:
            entry = self._open.pop(layer)
            self._on_error.remove([layer])
            entry.context.__exit__(None, None, None)
            context = entry.context
            if context.module_names:
                self.counts[entry.name] = (context.grouped_calls, context.stock_calls)
                logger.info(
                    "{}: input capture ran its experts grouped in {} calls, "
                    "the per-expert loop in {}",
                    entry.name, context.grouped_calls, context.stock_calls,
                )

    @contextlib.contextmanager
    def on_parts(
        self, layers: Mapping[nn.Module, str], parts: Sequence[Mapping[nn.Module, nn.Module]]
    ) -> Iterator[None]:
        """A data-parallel capture pass (autoround_parallel_capture.py): the experts of
        every part's copy of `layers` (home layer -> name) run grouped for the pass;
        each layer's counts are the sums over its parts."""
        contexts: dict[str, list[GroupedAutoRoundExperts]] = {}
        with contextlib.ExitStack() as stack:
            for part, module_map in enumerate(parts):
                for home, name in layers.items():
                    context = GroupedAutoRoundExperts(
                        module_map[home], f"{name} (input capture, part {part})", self.backend
                    )
                    contexts.setdefault(name, []).append(stack.enter_context(context))
            yield
        for name, per_part in contexts.items():
            if not any(context.module_names for context in per_part):
                continue
            grouped = sum(context.grouped_calls for context in per_part)
            stock = sum(context.stock_calls for context in per_part)
            self.counts[name] = (grouped, stock)
            logger.info(
                "{}: input capture ran on {} devices, its experts grouped in {} calls, "
                "the per-expert loop in {}", name, len(per_part), grouped, stock,
            )

    def _close_on_error(self, layer: nn.Module, name: str, error: BaseException) -> None:
        """The layer's forward raised: its experts get their forwards back."""
        self.close([layer])
