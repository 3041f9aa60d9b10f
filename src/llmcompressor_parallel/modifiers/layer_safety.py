"""Leave a layer whole when its work fails.

auto-round wraps a layer's Linears before tuning and writes the quantized weights
only when it unwraps them at the end; if anything fails in between, putting the
original children back leaves the layer exactly as it was before the layer's work.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

from torch import nn

__all__ = ["restore_children_on_error"]


@contextlib.contextmanager
def restore_children_on_error(layers: list[nn.Module]) -> Iterator[None]:
    snapshot = [
        (parent, name, child)
        for layer in layers
        for parent in layer.modules()
        for name, child in parent._modules.items()
    ]
    try:
        yield
    except BaseException:
        for parent, name, child in snapshot:
            parent._modules[name] = child
        raise
