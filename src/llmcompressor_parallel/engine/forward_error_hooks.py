"""On a module's failing forward, call X: always-called forward hooks, removed safely.

Under llm-compressor's stock pipelines nothing of a modifier sees an exception leave a
layer's forward, so what the modifier holds (a worker pool, patched forwards, grouped
stacks) would outlive the failed run. `ForwardErrorHooks` registers a torch forward
hook with `always_call=True` on each given module: torch calls it also when the
forward raises, and it then calls `on_error(module, name, error)` (once per raising
forward; the error goes on unchanged, as torch re-raises it after its hooks).

Removal is safe also from inside that always-called pass, where torch is iterating
the module's `_forward_hooks`: deleting an entry there, unless it is the last one and
already visited, replaces the forward's error by "OrderedDict mutated during
iteration" once torch moves to the next hook. Such an entry is instead replaced in
place (a value change, which the iteration allows) by an inert hook that deletes its
entry the next time torch calls it outside a failure pass. The module keeps its own
hook dicts, so every other hook's handle still removes that hook.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from typing import Any, Callable, Iterable, Iterator, Mapping

from torch import nn
from torch.utils.hooks import RemovableHandle

__all__ = ["ForwardErrorHooks", "remove_forward_hook"]

OnError = Callable[[nn.Module, str, BaseException], None]

# per thread: (module, hook id) of each always-called hook of ours now running in a
# failure pass, innermost last; their modules' `_forward_hooks` are being iterated
_failing = threading.local()


def _running() -> list[tuple[nn.Module, int]]:
    if not hasattr(_failing, "stack"):
        _failing.stack = []
    return _failing.stack


def _iterated(module: nn.Module) -> tuple[bool, int | None]:
    """Whether torch iterates `module`'s forward hooks now, and the id it is at."""
    for running, hook_id in reversed(_running()):
        if running is module:
            return True, hook_id
    return False, None


def _in_failure_pass(output: Any) -> bool:
    """torch's always-called pass after a raising forward gets no output, an error set."""
    return output is None and sys.exc_info()[1] is not None


class _Spent:
    """An inert hook in place of a removed one; deletes its entry when that is safe."""

    def __init__(self, module: nn.Module, handle: RemovableHandle) -> None:
        self.module, self.handle = module, handle

    def __call__(self, module: nn.Module, args: Any, output: Any) -> None:
        if not _in_failure_pass(output) and not _iterated(module)[0]:
            # torch's normal pass iterates a copy of the hooks: deleting is safe
            self.handle.remove()


def remove_forward_hook(module: nn.Module, handle: RemovableHandle) -> None:
    """Remove a forward hook of `module`, also while a failure pass iterates its hooks."""
    hooks = module._forward_hooks
    iterating, current = _iterated(module)
    if not iterating or handle.id not in hooks:
        handle.remove()
        return
    if handle.id == current and next(reversed(hooks)) == handle.id:
        handle.remove()  # the iteration is at the last entry: it ends without a next
        return
    hooks[handle.id] = _Spent(module, handle)  # same key: the iteration goes on


class ForwardErrorHooks:
    """Always-called forward hooks on modules: `on_error` when one's forward raises.

    :param on_error: called as `on_error(module, name, error)` in the thread that ran
        the forward, before the error goes on; what it raises is dropped by torch
        (with a warning), so the caller still sees the forward's own error
    """

    def __init__(self, on_error: OnError) -> None:
        self.on_error = on_error
        self._hooks: dict[nn.Module, tuple[str, RemovableHandle]] = {}
        self._paused = 0

    def add(self, modules: Mapping[nn.Module, str]) -> None:
        """Hook each module (`{module: name}`; a module already hooked keeps its hook)."""
        for module, name in modules.items():
            if module not in self._hooks:
                handle = module.register_forward_hook(self._fire, always_call=True)
                self._hooks[module] = (name, handle)

    def remove(self, modules: Iterable[nn.Module] | None = None) -> None:
        """Remove the hooks of `modules` (None: all); safe inside a failure pass."""
        targets = list(self._hooks) if modules is None else [m for m in modules if m in self._hooks]
        for module in targets:
            _name, handle = self._hooks.pop(module)
            remove_forward_hook(module, handle)

    def __contains__(self, module: nn.Module) -> bool:
        return module in self._hooks

    def __len__(self) -> int:
        return len(self._hooks)

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Inside, a raising forward calls nothing (whoever runs it handles its errors)."""
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1

    def _fire(self, module: nn.Module, args: Any, output: Any) -> None:
        if not _in_failure_pass(output) or self._paused or module not in self._hooks:
            return
        name, handle = self._hooks[module]
        running = _running()
        running.append((module, handle.id))
        try:
            self.on_error(module, name, sys.exc_info()[1])
        finally:
            running.pop()
