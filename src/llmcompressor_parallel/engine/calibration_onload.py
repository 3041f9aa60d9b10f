"""Hold a layer onloaded as plain modules while its replicas exist.

Why: the sequential pipeline puts compressed-tensors' offloading on every module
(`set_onload_device`): `_parameters` becomes an `OffloadCache` and `forward` a
per-instance wrapper that sends inputs to the onload device. A replica cannot be
made of that (the wrapper would send a replica's inputs to the home device, and
the cache is no dict). Inside `onloaded_as_plain_modules` each offloaded module of
the layer holds plain dicts of its onloaded tensors and its unwrapped forward.

Unlike removing the offloading and applying it again (what llm-compressor's
AutoRoundModifier does), nothing is copied: the tensors are the ones the cache
keeps onloaded while `disable_offloading()` is active (the pipeline is inside it),
and on exit the module gets its own cache and wrapper back, also when an exception
passes (compressed-tensors' `unwrap_offload_forward` re-wraps only on a normal exit,
so a failed parallel pass would leave plain forwards behind). A tensor replaced or
written in place meanwhile is written through the cache, as
`update_offload_parameter` would.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterable, Iterator

import torch
from compressed_tensors.offload.cache import OffloadCache
from loguru import logger
from torch import nn

__all__ = ["onloaded_as_plain_modules"]


@dataclass
class _Held:
    """One module's caches and the onloaded tensors handed out in their place."""

    module: nn.Module
    parameters: OffloadCache
    buffers: OffloadCache
    handed_out: dict[tuple[str, str], tuple[torch.Tensor | None, int]]


def _hand_out(cache: OffloadCache, kind: str, held: dict) -> dict[str, torch.Tensor | None]:
    plain = {}
    for name in cache:
        tensor = cache[name]  # onloaded; kept by the cache while offloading is disabled
        plain[name] = tensor
        held[(kind, name)] = (tensor, -1 if tensor is None else tensor._version)
    return plain


def _hold(module: nn.Module) -> _Held:
    held = _Held(module, module._parameters, module._buffers, {})
    parameters = _hand_out(held.parameters, "param", held.handed_out)
    buffers = _hand_out(held.buffers, "buffer", held.handed_out)
    module._parameters, module._buffers = parameters, buffers
    return held


def _give_back(held: _Held) -> None:
    """Restore the caches; write through whatever changed while the module was plain."""
    module = held.module
    for kind, plain, cache in (
        ("param", module._parameters, held.parameters),
        ("buffer", module._buffers, held.buffers),
    ):
        for name, tensor in plain.items():
            original = held.handed_out.get((kind, name))
            unchanged = original is not None and original[0] is tensor and (
                tensor is None or tensor._version == original[1]
            )
            if not unchanged:
                cache[name] = tensor
        for name in [name for name in cache if name not in plain]:
            del cache[name]
    module._parameters = held.parameters
    module._buffers = held.buffers


@contextlib.contextmanager
def _unwrapped_forward(module: nn.Module) -> Iterator[None]:
    """compressed-tensors' `unwrap_offload_forward`, whose wrapper also comes back on error.

    Inside, the module's forward is the one its offloading wrapper calls. On exit
    the wrapper is put back, and a forward method set meanwhile becomes the one the
    wrapper calls (as `unwrap_offload_forward` does); on an exception, a forward
    that is no method of the module is dropped instead of masking the error.
    """
    if not hasattr(module, "_original_forward_func"):
        yield
        return
    offload_forward = module.forward
    module.forward = module._original_forward_func.__get__(module)
    try:
        yield
    except BaseException:
        inner = getattr(module.forward, "__func__", None)
        if inner is not None:
            module._original_forward_func = inner
        else:
            logger.debug("{}: a non-method forward set meanwhile dropped", type(module).__name__)
        module.forward = offload_forward
        raise
    module._original_forward_func = module.forward.__func__
    module.forward = offload_forward


@contextlib.contextmanager
def onloaded_as_plain_modules(layers: Iterable[nn.Module]) -> Iterator[None]:
    """Inside: every offloaded module of `layers` is a plain module on its onload device.

    Must be entered inside compressed-tensors' `disable_offloading()`.
    """
    if not OffloadCache.offloading_disabled:
        raise RuntimeError("onloaded_as_plain_modules needs disable_offloading() around it")
    with contextlib.ExitStack() as stack:
        seen: set[int] = set()
        for layer in layers:
            for module in layer.modules():
                if id(module) in seen or not isinstance(module._parameters, OffloadCache):
                    continue
                seen.add(id(module))
                stack.enter_context(_unwrapped_forward(module))
                stack.callback(_give_back, _hold(module))
        yield
