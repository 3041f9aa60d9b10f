"""Whether grouped experts tune on every token or on routed tokens only.

In llm-compressor's all-experts calibration mode (oneshot's default) stock runs
every expert on every token and keeps the routed rows. The grouped tuning forward
reproduces stock's weight-gradient reductions (`all_tokens=True`: bit-identical on
CPU) by computing each expert stack's weight gradient over every token, its routed
rows' output gradients among zeros, at the price of [experts, tokens, .] buffers
in the backward (forward and input gradients run on the routed rows only): at the
Qwen3-30B-A3B shape and 16K tokens a call, 11.8 GB in bf16 for the down stack.
Routed tokens only (`all_tokens=False`) is the same math up to floating-point order
with no such buffers. "auto" picks the first where its estimated peak fits the
device's free memory.
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
    experts: int,
    tokens: int,
    hidden: int,
    intermediate: int,
    gated: bool,
    itemsize: int,
    top_k: int,
) -> int:
    """Estimated peak memory of one all-tokens tuning call (forward + backward).

    The down stack's weight-gradient buffers ([E, T, intermediate] inputs and
    [E, T, hidden] output gradients, the largest of the call), plus what is kept of
    the routed rows (N = T x top_k) until then: the forward's activations and the
    rows recorded for the weight gradients ([N, 2 x hidden + (2 x first + 2) x
    intermediate] in all), plus the stacks' gradients. The padded per-expert rows of
    the bmm kernel ([E, longest segment, .], at most [E, T, .]) live only in phases
    where the weight-gradient buffers do not, so this bounds them too. Errs high: on
    CPU at E=8, T=8192, hidden 256, intermediate 128, top_k 2, bf16, it says 89.5 MiB
    where the call peaks at 81.9 MiB (tests/test_grouped_autoround.py measures it).
    """
    first = 2 if gated else 1
    weight_gradient_buffers = experts * tokens * (hidden + intermediate)
    routed_rows = tokens * top_k * (2 * hidden + (2 * first + 2) * intermediate)
    stack_gradients = (first + 1) * experts * hidden * intermediate
    return (weight_gradient_buffers + routed_rows + stack_gradients) * itemsize


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
