"""Whether grouped experts tune on every token or on routed tokens only.

In llm-compressor's all-experts calibration mode (oneshot's default) stock runs
every expert on every token and keeps the routed rows. The grouped tuning forward
can do the same (`all_tokens=True`: stock's reduction order, bit-identical on small
CPU shapes) at the price of [experts, tokens, ...] transients: at the
Qwen3-30B-A3B shape and 16K tokens a call, each projection's input gradient alone
is 8.6 GB in bf16. Routed tokens only (`all_tokens=False`) is the same math up to
floating-point order with top_k/experts of the FLOPs and memory. "auto" picks the
first where its estimated transient fits the device's free memory.
"""

from __future__ import annotations

from typing import Literal

import psutil
import torch

__all__ = ["HEADROOM", "TokenMode", "all_tokens_bytes", "choose_all_tokens", "free_bytes"]

TokenMode = bool | Literal["auto"]

# the estimate is of the largest transients only; ask for this much more free memory
HEADROOM = 1.25


def all_tokens_bytes(
    experts: int, tokens: int, hidden: int, intermediate: int, gated: bool, itemsize: int
) -> int:
    """Estimated peak memory of one all-tokens tuning call (forward + backward).

    The sum of the call's [experts, tokens, .] tensors: one [E, T, hidden] input
    gradient per gate/up projection, the [E, T, hidden] output (and its gradient),
    gate/up activations, their concatenation and gradients ([E, T, intermediate]
    each). Not all are alive at once, so this errs high: on CPU at E=8, T=8192,
    hidden 256, intermediate 128, bf16, it says 176 MiB where the call peaks at
    137 MiB (tests/test_grouped_autoround.py measures it).
    """
    first = 2 if gated else 1
    per_token = first * hidden + hidden + (2 * first + 1) * intermediate
    return experts * tokens * per_token * itemsize


def free_bytes(device: torch.device) -> int | None:
    """Memory that allocations on `device` can still get (None: unknown for this kind).

    CUDA: free device memory plus what PyTorch's caching allocator holds unused.
    CPU: the host's available memory.
    """
    if device.type == "cpu":
        return int(psutil.virtual_memory().available)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return int(free + cached)
    return None


def choose_all_tokens(needed: int, device: torch.device) -> tuple[bool, str]:
    """("auto") all tokens when `needed` x HEADROOM fits the free memory; with the why."""
    free = free_bytes(device)
    if free is None:
        return True, f"free memory on {device} unknown; ~{_size(needed)} assumed to fit"
    fits = needed * HEADROOM <= free
    return fits, (
        f"every expert on every token needs ~{_size(needed)} (x{HEADROOM} headroom), "
        f"{_size(free)} free on {device}"
    )


def _size(count: int) -> str:
    return f"{count / 2**30:.1f} GiB" if count >= 2**30 else f"{count / 2**20:.1f} MiB"
