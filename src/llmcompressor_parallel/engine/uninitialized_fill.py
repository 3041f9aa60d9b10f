"""Skip torch's NaN fill of new tensors while auto-round tunes a layer.

Why: auto-round switches on `torch.use_deterministic_algorithms` for the whole
process, and with it torch fills the memory of every new tensor (`empty`, and the
outputs of the many ops that allocate with it) with NaN, so that a read of
uninitialised memory gives the same NaN on every run
(`torch.utils.deterministic.fill_uninitialized_memory`). A program that reads no
uninitialised memory computes the same values without the fills; they cost one
extra kernel per new tensor (Qwen3-30B-A3B-shape MoE layer, 2 H200s: the tuning loop
7.5-12% faster without them, the same integers; README, session 8). Deterministic
algorithm choice stays as auto-round set it.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch.utils.deterministic

__all__ = ["skipping_uninitialized_fill"]


@contextlib.contextmanager
def skipping_uninitialized_fill(skip: bool = True) -> Iterator[None]:
    """New tensors stay unfilled inside (where `skip`); the setting is restored on exit."""
    if not skip:
        yield
        return
    settings = torch.utils.deterministic
    previous = settings.fill_uninitialized_memory
    settings.fill_uninitialized_memory = False
    try:
        yield
    finally:
        settings.fill_uninitialized_memory = previous
