"""Leave a layer whole when its work fails.

auto-round wraps a layer's Linears, casts the layer to its autocast dtype and only
writes quantized weights when it unwraps them at the end. If anything fails before
that, putting back the original children, parameter objects, their storages and the
buffers leaves the layer exactly as it was. Keeping references to the storages
costs memory only where the algorithm replaced one (a dtype or device change).
"""

from __future__ import annotations

import contextlib
from typing import Iterator

from torch import nn

__all__ = ["restore_layer_on_error"]


def _snapshot(layers: list[nn.Module]) -> list[tuple]:
    entries = []
    for layer in layers:
        for module in layer.modules():
            entries.append(
                (
                    module,
                    dict(module._modules),
                    {name: (p, None if p is None else p.data) for name, p in module._parameters.items()},
                    dict(module._buffers),
                )
            )
    return entries


def _restore(entries: list[tuple]) -> None:
    for module, children, params, buffers in entries:
        module._modules.clear()
        module._modules.update(children)
        module._parameters.clear()
        for name, (param, data) in params.items():
            if param is not None and param.data is not data:
                param.data = data
            module._parameters[name] = param
        module._buffers.clear()
        module._buffers.update(buffers)


@contextlib.contextmanager
def restore_layer_on_error(layers: list[nn.Module]) -> Iterator[None]:
    entries = _snapshot(layers)
    try:
        yield
    except BaseException:
        _restore(entries)
        raise
