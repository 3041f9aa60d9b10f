"""What compressed-tensors' per-instance offloading wrapper does to a module's call.

During llm-compressor's sequential pipeline every module is offloaded
(`set_onload_device`), and `offload_module` replaces each instance's `forward` by a
wrapper that moves the call's tensor arguments to the module's onload device and
then calls the forward it wrapped. A grouped execution that skips the experts'
modules must know that wrapper to reproduce it (the input move) or refuse to run.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Iterable
from typing import Any

import torch
from compressed_tensors.offload.cache.base import OffloadCache
from compressed_tensors.offload.module import offload_module
from compressed_tensors.offload.utils import send_tensors
from torch import nn

__all__ = [
    "is_offload_wrapper",
    "offload_inner_forward",
    "offload_onload_device",
    "parameter_values",
    "same_device",
    "send_like_offload",
    "wrapper_target",
]

# the code of `offload_module`'s per-instance `forward` closure
_OFFLOAD_FORWARD_CODES = tuple(
    c for c in offload_module.__code__.co_consts if isinstance(c, types.CodeType)
)


def is_offload_wrapper(module: nn.Module, forward: Any) -> bool:
    """Whether `forward` (an instance forward of `module`) is the offloading wrapper."""
    return (
        isinstance(forward, types.MethodType)
        and forward.__self__ is module
        and getattr(forward.__func__, "__code__", None) in _OFFLOAD_FORWARD_CODES
    )


def offload_inner_forward(module: nn.Module) -> Callable[..., Any] | None:
    """The function the offloading wrapper on `module` calls (None: no such wrapper)."""
    if not is_offload_wrapper(module, module.__dict__.get("forward")):
        return None
    return module.__dict__.get("_original_forward_func")


def offload_onload_device(module: nn.Module) -> torch.device | str | None:
    """Where the offloading wrapper on `module` moves tensor arguments now (None: nowhere)."""
    if offload_inner_forward(module) is None:
        return None
    return wrapper_target(module)


def wrapper_target(module: nn.Module) -> torch.device | str | None:
    """Where an offloading wrapper of `module` would move arguments now: the wrapper's
    own test (onloading not disabled, parameters still offloaded); None: nowhere."""
    parameters = module._parameters
    if OffloadCache.onloading_disabled or not isinstance(parameters, OffloadCache):
        return None
    return parameters.onload_device


def send_like_offload(module: nn.Module, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """`tensors` as an offloading wrapper of `module` would pass them on."""
    device = wrapper_target(module)
    if device is None:
        return tensors
    return tuple(send_tensors(list(tensors), device=device))


def same_device(a: torch.device | str, b: torch.device | str) -> bool:
    """Equal devices, an accelerator without index meaning the current one."""
    return _normalized(a) == _normalized(b)


def _normalized(device: torch.device | str) -> torch.device:
    device = torch.device(device)
    if device.type != "cpu" and device.index is None and torch.accelerator.is_available():
        return torch.device(device.type, torch.accelerator.current_device_index())
    return device


def parameter_values(modules: Iterable[nn.Module]) -> list[torch.Tensor]:
    """`modules`' parameters as `module._parameters.values()` reads them, Nones left out.

    Asked for hundreds of expert Linears on every grouped call (grouped_autoround's
    change check), so one call for all of them. Through an `OffloadCache` each read is
    a Python `__getitem__` that, while offloading is disabled (the pipeline's passes),
    hashes the offloaded tensor twice to find the onloaded one kept for it; here that
    kept tensor is taken with one look-up, and any other case (nothing kept yet,
    onloading disabled, a subclass's own `__getitem__`) reads through the cache
    itself, so the tensors are the same.
    """
    values: list[torch.Tensor] = []
    for module in modules:
        parameters = module._parameters
        if type(parameters) is not dict and isinstance(parameters, OffloadCache):
            values += _cache_values(parameters)
            continue
        for value in parameters.values():  # a plain loop: no comprehension call per module
            if value is not None:
                values.append(value)
    return values


def _cache_values(cache: OffloadCache) -> list[torch.Tensor]:
    """`cache.values()` without Nones; the kept onloaded tensors read directly."""
    cls = type(cache)
    if (
        cls.__getitem__ is not OffloadCache.__getitem__
        or cls.__iter__ is not OffloadCache.__iter__
        or cls.values is not OffloadCache.values
        or cache.onloading_disabled
        or not cache.offloading_disabled
    ):
        return [p for p in cache.values() if p is not None]
    kept = cache.keep_onloaded_values
    values = []
    for name, offloaded in cache.offloaded_values.items():
        if offloaded is None:
            continue
        onloaded = kept.get(offloaded)
        values.append(cache[name] if onloaded is None else onloaded)
    return values
