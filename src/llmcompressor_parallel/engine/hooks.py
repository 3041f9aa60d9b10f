"""Find hooks that other code registered inside a layer.

A hook on a submodule runs once per replica, on that replica's share of the batch,
possibly in parallel: statistics it gathers would be split or raced. Until a hook's
effect can be merged exactly, its presence makes the layer run serially.
Hooks on the layer itself are fine: they run once, on the whole batch, in the
caller, before the fan-out.
"""

from __future__ import annotations

from collections.abc import Iterable

from torch import nn
from torch.nn.modules import module as torch_module

from llmcompressor_parallel.engine.module_walk import walk_modules

__all__ = [
    "GLOBAL_HOOK_DICTS",
    "MODULE_HOOK_DICTS",
    "any_hooks",
    "foreign_hooks",
    "global_hooks",
    "has_hooks",
]

MODULE_HOOK_DICTS = (
    "_forward_hooks",
    "_forward_pre_hooks",
    "_backward_hooks",
    "_backward_pre_hooks",
)
GLOBAL_HOOK_DICTS = (
    "_global_forward_hooks",
    "_global_forward_pre_hooks",
    "_global_backward_hooks",
    "_global_backward_pre_hooks",
)


def _describe(hook: object) -> str:
    return getattr(hook, "__qualname__", None) or type(hook).__name__


def has_hooks(module: nn.Module) -> bool:
    """Whether calling `module` would run a hook registered on it."""
    return any(getattr(module, hook_dict, None) for hook_dict in MODULE_HOOK_DICTS)


def any_hooks(modules: Iterable[nn.Module]) -> bool:
    """`any(has_hooks(m) for m in modules)` in one flat loop over the instance dicts,
    where `nn.Module.__init__` puts the hook dicts: asked for every expert module on
    every grouped call (grouped_autoround), at about a third of the cost."""
    return any(
        d.get("_forward_hooks") or d.get("_forward_pre_hooks")
        or d.get("_backward_hooks") or d.get("_backward_pre_hooks")
        for d in (m.__dict__ for m in modules)
    )


def global_hooks() -> list[str]:
    """Descriptions of global module hooks (torch.nn.modules.module.register_module_*)."""
    return [
        f"{hook_dict.strip('_')} {_describe(hook)}"
        for hook_dict in GLOBAL_HOOK_DICTS
        for hook in getattr(torch_module, hook_dict, {}).values()
    ]


def foreign_hooks(layer: nn.Module) -> list[str]:
    """Human-readable descriptions of hooks inside `layer` (its submodules) or global ones.

    Asked before every fanned-out call: a flat look first, names only when one is found.
    """
    if not any_hooks(m for m in walk_modules(layer) if m is not layer):
        return global_hooks()
    found = []
    for name, module in layer.named_modules():
        if module is layer:
            continue
        for hook_dict in MODULE_HOOK_DICTS:
            for hook in getattr(module, hook_dict, {}).values():
                found.append(f"{hook_dict.strip('_')} {_describe(hook)} on {name}")
    return found + global_hooks()
