"""Which hooks inside a subgraph would fire during a calibration or propagation pass.

Why: a pass runs data-parallel only if every hook that fires in it can be
reproduced exactly on replicas. Hooks registered through llm-compressor's
`HooksMixin` are gated: they do nothing while `HooksMixin.disable_hooks()` is on
(the propagation pass), unless their handle was kept enabled. Any other hook, and
any global module hook, always fires. The caller decides which of the firing hooks
it can merge (GPTQ's Hessian hook: yes; an observer's running statistics: no).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Callable, Iterable

from llmcompressor.modifiers.utils.hooks import HooksMixin
from torch import nn

from llmcompressor_parallel.engine.hooks import MODULE_HOOK_DICTS

__all__ = ["ModuleHook", "firing_hooks"]

def _code_objects(function: Callable) -> set[Any]:
    """Code objects of the functions defined inside `function` (HooksMixin's wrapper)."""
    return {const for const in function.__code__.co_consts if inspect.iscode(const)}


_GATED_WRAPPER_CODES = _code_objects(HooksMixin.register_hook)


@dataclass(frozen=True)
class ModuleHook:
    """One hook found on a module of a subgraph."""

    module_name: str
    module: nn.Module
    kind: str  # "forward", "forward_pre", "backward", "backward_pre"
    function: Callable

    @property
    def gated(self) -> bool:
        """Registered through HooksMixin, so `HooksMixin.disable_hooks()` silences it."""
        return getattr(self.function, "__code__", None) in _GATED_WRAPPER_CODES

    @property
    def target(self) -> Callable:
        """The hook the user wrote (HooksMixin wraps it with functools.wraps)."""
        return getattr(self.function, "__wrapped__", self.function)

    def fires_now(self) -> bool:
        """Whether calling the module now would run the hook's body."""
        if not self.gated or not HooksMixin._HOOKS_DISABLED:
            return True
        return _closure_value(self.function, "handle") in HooksMixin._HOOKS_KEEP_ENABLED

    def describe(self) -> str:
        owner = getattr(self.target, "__self__", None)
        owner_name = "" if owner is None else f" of {type(owner).__name__}"
        name = getattr(self.target, "__qualname__", None) or type(self.target).__name__
        return f"{self.kind} hook {name}{owner_name} on {self.module_name or '<root>'}"


def _closure_value(function: Callable, name: str) -> Any:
    """The value of free variable `name` of `function` (None when it has none)."""
    names = function.__code__.co_freevars
    if name not in names or function.__closure__ is None:
        return None
    return function.__closure__[names.index(name)].cell_contents


def firing_hooks(named_modules: Iterable[tuple[str, nn.Module]]) -> list[ModuleHook]:
    """The hooks of the given modules that would run if the modules were called now."""
    found = []
    for name, module in named_modules:
        for hook_dict in MODULE_HOOK_DICTS:
            for function in getattr(module, hook_dict, {}).values():
                hook = ModuleHook(name, module, hook_dict.strip("_")[: -len("_hooks")], function)
                if hook.fires_now():
                    found.append(hook)
    return found
