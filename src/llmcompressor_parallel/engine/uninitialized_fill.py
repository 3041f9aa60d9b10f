"""Skip torch's NaN fill of new tensors while auto-round's tuning loop runs.

Why: auto-round switches on `torch.use_deterministic_algorithms` for the whole
process, and with it torch fills the memory of every new tensor (`empty`, and the
outputs of the many ops that allocate with it) with NaN, so that a read of
uninitialised memory gives the same NaN on every run
(`torch.utils.deterministic.fill_uninitialized_memory`). A program that reads no
uninitialised memory computes the same values without the fills; they cost one
extra kernel per new tensor (Qwen3-30B-A3B-shape MoE layer, 2 H200s: the tuning loop
7.5-12% faster without them, the same integers; README, session 8). Deterministic
algorithm choice stays as auto-round set it.

Only the block quantizer's `quantize_block` (the SignRound loop, with its wrapping and
unwrapping) runs without the fills: skipped around auto-round's whole per-layer call,
the rest of that call ran about 1 s longer (same runs), probably in its move of the
layer to host memory at the end, whose copies then land in pages nothing has touched.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Iterator

import torch.utils.deterministic

from llmcompressor_parallel.engine.foreach_sign_sgd import block_quantizers

__all__ = ["skip_fill_while_tuning", "skipping_uninitialized_fill"]


@contextlib.contextmanager
def skipping_uninitialized_fill() -> Iterator[None]:
    """New tensors stay unfilled inside; the setting is restored on exit. It is
    process-wide: tensors other threads allocate meanwhile stay unfilled too."""
    settings = torch.utils.deterministic
    previous = settings.fill_uninitialized_memory
    settings.fill_uninitialized_memory = False
    try:
        yield
    finally:
        settings.fill_uninitialized_memory = previous


def skip_fill_while_tuning(autoround: Any) -> int:
    """Make each block quantizer of an `AutoRound` compressor run its `quantize_block`
    without the fills (an attribute of that quantizer instance, which lives for one
    layer); returns how many quantizers were set. Call right before `quantize_block`."""
    quantizers = block_quantizers(autoround)
    for quantizer in quantizers:
        quantizer.quantize_block = _without_fill(quantizer.quantize_block)
    return len(quantizers)


def _without_fill(quantize_block: Any) -> Any:
    @functools.wraps(quantize_block)
    def unfilled(*args: Any, **kwargs: Any) -> Any:
        with skipping_uninitialized_fill():
            return quantize_block(*args, **kwargs)

    return unfilled
