"""Carry the caller's thread-local torch state into worker threads.

Grad mode and autocast are thread-local: a worker thread starts with grad enabled
and autocast off, whatever the caller (auto-round runs its block under bf16
autocast and toggles grad between tuning and reference passes). DESIGN.md trap 3.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator

import torch

__all__ = ["ThreadContext"]

_AUTOCAST_DEVICE_TYPES = ("cpu", "cuda")


@dataclass(frozen=True)
class ThreadContext:
    grad_enabled: bool
    autocast: tuple[tuple[str, bool, torch.dtype], ...]
    autocast_cache: bool

    @classmethod
    def capture(cls) -> "ThreadContext":
        """Read the calling thread's grad and autocast state."""
        autocast = tuple(
            (kind, torch.is_autocast_enabled(kind), torch.get_autocast_dtype(kind))
            for kind in _AUTOCAST_DEVICE_TYPES
        )
        return cls(torch.is_grad_enabled(), autocast, torch.is_autocast_cache_enabled())

    @contextlib.contextmanager
    def applied(self) -> Iterator[None]:
        """Enter the captured state in the current (worker) thread."""
        with contextlib.ExitStack() as stack:
            stack.enter_context(torch.set_grad_enabled(self.grad_enabled))
            for kind, enabled, dtype in self.autocast:
                if not enabled:  # a fresh thread starts with autocast off
                    continue
                stack.enter_context(
                    torch.autocast(
                        device_type=kind,
                        dtype=dtype,
                        cache_enabled=self.autocast_cache,
                    )
                )
            yield
