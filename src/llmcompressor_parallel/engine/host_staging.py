"""Results bound for host-offloaded modules, copied to page-locked host memory by the worker.

Why: stock writes each GPTQ result into its module with `update_offload_parameter`,
which for a module offloaded to CPU copies the device tensor into pageable host
memory, one module after another in the calling thread (2x H200, Llama-3-8B layer:
about 0.33 s of a 0.70 s update phase, after the pool's 0.33 s). A worker that has
just computed a batch copies its results into page-locked memory instead, at full
link speed and while the other workers still compute; the caller's stock write-back
then copies host to host (and host to device for the onloaded copy). Copies only:
the values written are the same bits.
"""

from __future__ import annotations

from typing import Any

import torch
from compressed_tensors.offload.cache.base import OffloadCache
from torch import nn
from torch.utils._pytree import tree_map

__all__ = ["offloaded_to_host", "staged_on_host"]


def offloaded_to_host(module: nn.Module) -> bool:
    """Whether compressed-tensors keeps `module`'s parameters in host memory."""
    cache = module._parameters
    # a torch.device for host and device caches, the string "disk" for disk caches
    return isinstance(cache, OffloadCache) and str(cache.offload_device) == "cpu"


def staged_on_host(tree: Any) -> Any:
    """`tree` with every CUDA tensor copied into page-locked host memory.

    The copies are queued on the current stream of each tensor's device and waited
    for before returning, so the result can be read from any thread.
    """
    devices: set[torch.device] = set()

    def stage(value: Any) -> Any:
        if not (isinstance(value, torch.Tensor) and value.device.type == "cuda"):
            return value
        host = torch.empty(value.shape, dtype=value.dtype, pin_memory=True)
        host.copy_(value, non_blocking=True)
        devices.add(value.device)
        return host

    staged = tree_map(stage, tree)
    for device in devices:
        torch.cuda.current_stream(device).synchronize()
    return staged
