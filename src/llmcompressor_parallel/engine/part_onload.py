"""Each part of a data-parallel pass loads its batches straight onto its own device.

Why: the intermediates cache records, for every tensor, the device stock onloads it
to (the home device). Fetched that way, every part's batches would cross the home
GPU's host link, queue behind the home part's kernels on the home device's stream,
and then be copied again to the part's device; its outputs would come back the same
way before being offloaded. On a dense layer that serialises most of the pass
(Llama-3-8B shape, GPTQ on 2 GPUs: calibration 1.55x, propagation 1.10x). Loading a
part's inputs onto its device, and offloading its outputs from there, keeps each
GPU on its own link.

That is exact only when nothing in the subgraph outside the replicated layers is
tied to the home device: no module there with parameters or buffers (norms,
embeddings, rotary tables), no attribute reads of the model's tensors, no device
constants in the traced code. `direct_onload_reason` says when it is not; such
passes load everything onto the home device as before. The outputs are recorded
with the device stock would have recorded (the batch's home device), so a later
pass, serial or parallel, finds them where stock's code expects them.
"""

from __future__ import annotations

from dataclasses import fields, is_dataclass
from typing import Any, Iterable

import torch
from llmcompressor.pipelines.cache import IntermediatesCache, IntermediateValue
from llmcompressor.pipelines.sequential.helpers import Subgraph
from torch import nn
from torch.utils._pytree import tree_flatten

__all__ = ["direct_onload_reason", "fetch_to", "recorded_device", "offload_outputs"]


def direct_onload_reason(
    subgraph: Subgraph, model: nn.Module, inside: set[nn.Module]
) -> str | None:
    """Why the parts of this subgraph must receive their inputs on the home device
    (None: each part may load them onto its own device)."""
    for module in subgraph.submodules(model, recurse=False):
        if module in inside:
            continue
        if any(True for _ in module.parameters()) or any(True for _ in module.buffers()):
            return f"{type(module).__name__} outside the replicated layers holds tensors"
    for node in subgraph.graph.nodes:
        if node.op == "get_attr":
            return f"the traced code reads the model attribute {node.target}"
        leaves = tree_flatten((node.args, node.kwargs))[0]
        if any(isinstance(leaf, torch.device) for leaf in leaves):
            return "the traced code names a device"
    return None


def recorded_device(cache: IntermediatesCache, batch_index: int, names: Iterable[str]) -> torch.device | None:
    """The device stock's `fetch` would load this batch's first tensor onto."""
    intermediates = cache.batch_intermediates[batch_index]
    for name in names:
        if name in intermediates:
            device = _first_device(intermediates[name])
            if device is not None:
                return torch.device(device)
    return None


def fetch_to(
    cache: IntermediatesCache, batch_index: int, names: Iterable[str], device: torch.device
) -> dict[str, Any]:
    """Stock's `fetch`, every tensor loaded onto `device` instead of its recorded one."""
    intermediates = cache.batch_intermediates[batch_index]
    wanted = set(names)
    return {
        key: IntermediatesCache._onload_value(_retargeted(value, device))
        for key, value in intermediates.items()
        if key in wanted
    }


def offload_outputs(
    cache: IntermediatesCache, batch_index: int, outputs: dict[str, Any], device: torch.device
) -> None:
    """Stock's `update`, the outputs recorded as onloading to `device` (the home's)."""
    cache.batch_intermediates[batch_index].update(
        {
            key: IntermediatesCache._offload_value(value, cache.offload_device, device)
            for key, value in outputs.items()
        }
    )


def _retargeted(intermediate: IntermediateValue, device: torch.device) -> IntermediateValue:
    value = intermediate.value
    if isinstance(value, torch.Tensor):
        return IntermediateValue(value=value, device=device)
    if isinstance(value, (list, tuple)):
        return IntermediateValue(type(value)(_retargeted(v, device) for v in value), None)
    if isinstance(value, dict):
        return IntermediateValue({k: _retargeted(v, device) for k, v in value.items()}, None)
    if is_dataclass(value) and not isinstance(value, type):
        moved = {f.name: _retargeted(getattr(value, f.name), device) for f in fields(value)}
        return IntermediateValue(type(value)(**moved), None)
    return intermediate


def _first_device(intermediate: IntermediateValue) -> torch.device | None:
    value = intermediate.value
    if isinstance(value, torch.Tensor):
        return intermediate.device
    if isinstance(value, (list, tuple)):
        children = list(value)
    elif isinstance(value, dict):
        children = list(value.values())
    elif is_dataclass(value) and not isinstance(value, type):
        children = [getattr(value, f.name) for f in fields(value)]
    else:
        return None
    for child in children:
        if isinstance(child, IntermediateValue):
            device = _first_device(child)
            if device is not None:
                return device
    return None
