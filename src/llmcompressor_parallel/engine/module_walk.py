"""A module tree's modules in `modules()` order, without building their dotted names.

Why: the fan-out's per-call checks (replica structure, hooks inside the layer) visit
every module of a layer (about 1,500 with 128 linearised experts, auto-round's
wrappers included) on every tuning call; `named_modules` builds a name string and a
generator per module, several times the cost of the visit itself.
"""

from __future__ import annotations

from torch import nn

__all__ = ["walk_modules"]


def walk_modules(root: nn.Module) -> list[nn.Module]:
    """`list(root.modules())` (pre-order, each module once, None children skipped)
    without the dotted names `named_modules` builds for every module."""
    seen: set[nn.Module] = set()
    order: list[nn.Module] = []
    stack = [root]
    while stack:
        module = stack.pop()
        if module in seen:
            continue
        seen.add(module)
        order.append(module)
        stack.extend(reversed([child for child in module._modules.values() if child is not None]))
    return order
