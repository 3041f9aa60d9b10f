"""Transparent data-parallel fan-out of one layer's forward.

While a `FanOut` is active, calling the layer splits the batch over the pool's
devices, runs each share on its own worker thread (the home share on the home
layer itself, the others on replicas), and returns the gathered outputs on the
caller's device. The calling algorithm sees an ordinary module: same signature
(`inspect.signature` still reports the original forward), same outputs, and a
single backward reaches the home parameters.
"""

from __future__ import annotations

import functools
import inspect
import threading
import weakref
from typing import Any, Callable, Protocol

import torch
from loguru import logger
from torch import nn

from llmcompressor_parallel.engine.hooks import foreign_hooks
from llmcompressor_parallel.engine.replicate import NotReplicable, ReplicaSet
from llmcompressor_parallel.engine.scatter_gather import (
    gather_outputs,
    move_to,
    split_call,
    split_sizes,
)
from llmcompressor_parallel.engine.thread_context import ThreadContext
from llmcompressor_parallel.engine.worker_pool import DeviceWorkerPool

__all__ = ["FanOut", "FanOutParticipant", "register_participant", "unregister_participant"]

_MISSING = object()
_COMPILE_LOCK = threading.Lock()


class Prepared(Protocol):
    """What a participant arranged for one call: `skip`, ids of home trainable tensors
    that the replicas must not receive; `finish()`, called once the call's forward ended."""

    skip: set[int]

    def finish(self) -> None: ...


class FanOutParticipant(Protocol):
    """Work a context over (part of) a layer adds to each fanned-out call of it.

    `prepare_fan_out(replicas, parts, primary)` runs in the caller's thread after the
    replicas are synced and before any copy or worker (`primary`: the call's batched
    first input, whole): it may raise `NotReplicable` (the call then runs serially) or
    return None (nothing to do). Participants registered on one module are prepared in
    the order they registered.
    """

    def prepare_fan_out(
        self, replicas: ReplicaSet, parts: int, primary: torch.Tensor
    ) -> Prepared | None: ...


_PARTICIPANTS: "weakref.WeakKeyDictionary[nn.Module, list[FanOutParticipant]]" = (
    weakref.WeakKeyDictionary()
)
_PARTICIPANTS_LOCK = threading.Lock()


def register_participant(module: nn.Module, participant: FanOutParticipant) -> None:
    """Ask every `FanOut` of a layer that contains `module` to prepare with `participant`."""
    with _PARTICIPANTS_LOCK:
        _PARTICIPANTS.setdefault(module, []).append(participant)


def unregister_participant(module: nn.Module, participant: FanOutParticipant) -> None:
    with _PARTICIPANTS_LOCK:
        entries = _PARTICIPANTS.get(module, [])
        if participant in entries:
            entries.remove(participant)
        if not entries:
            _PARTICIPANTS.pop(module, None)


def _participants(layer: nn.Module) -> list[FanOutParticipant]:
    with _PARTICIPANTS_LOCK:
        if not _PARTICIPANTS:
            return []
        return [p for module in layer.modules() for p in _PARTICIPANTS.get(module, ())]


def _prepare_participants(
    layer: nn.Module, replicas: ReplicaSet, parts: int, primary: torch.Tensor
) -> list[Prepared]:
    """Every participant's preparation for one call; on any failure the ones already
    prepared are finished before it propagates (the call then runs serially or fails)."""
    prepared: list[Prepared] = []
    try:
        for participant in _participants(layer):
            done = participant.prepare_fan_out(replicas, parts, primary)
            if done is not None:
                prepared.append(done)
    except BaseException:
        for done in prepared:
            done.finish()
        raise
    return prepared


class FanOut:
    """Context manager that fans `layer.forward` out over `pool` while active.

    :param layer: the module whose calls are split (a decoder layer)
    :param pool: persistent per-device workers; its devices define the replicas
    :param name: how the layer is called in log lines
    :param compile_replicas: wrap each share's forward in `torch.compile`; the first
        call of each compiled share runs under a lock, since compiling is not
        thread-safe
    """

    def __init__(
        self,
        layer: nn.Module,
        pool: DeviceWorkerPool,
        name: str = "",
        compile_replicas: bool = False,
    ):
        self.layer = layer
        self.pool = pool
        self.name = name or type(layer).__name__
        self.compile_replicas = compile_replicas
        self.calls = 0
        self.parallel_calls = 0
        self._logged: set[str] = set()
        self._saved_forward: Any = _MISSING
        self._replicas: ReplicaSet | None = None
        self._compiled: dict[tuple[int, int], Callable] = {}

    # ------------------------------------------------------------ lifecycle
    def __enter__(self) -> "FanOut":
        layer = self.layer
        self._saved_forward = layer.__dict__.get("forward", _MISSING)
        original = layer.forward
        self._first_arg = next(iter(inspect.signature(original).parameters), None)
        self._replicas = ReplicaSet(
            layer,
            self.pool.devices,
            root_forward=None if self._saved_forward is _MISSING else self._saved_forward,
        )

        @functools.wraps(original)
        def fanned_forward(*args: Any, **kwargs: Any) -> Any:
            return self._call(original, args, kwargs)

        layer.forward = fanned_forward
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self._saved_forward is _MISSING:
            self.layer.__dict__.pop("forward", None)
        else:
            self.layer.forward = self._saved_forward
        if self._replicas is not None:
            self._replicas.release()
        self._compiled.clear()

    # ------------------------------------------------------------ the call
    def _serial(self, original: Callable, args: tuple, kwargs: dict, reason: str) -> Any:
        if reason not in self._logged:
            self._logged.add(reason)
            logger.info("{}: running serially: {}", self.name, reason)
        return original(*args, **kwargs)

    def _primary_input(self, args: tuple, kwargs: dict) -> Any:
        if args:
            return args[0]
        return kwargs.get(self._first_arg)

    def _call(self, original: Callable, args: tuple, kwargs: dict) -> Any:
        self.calls += 1
        primary = self._primary_input(args, kwargs)
        if not isinstance(primary, torch.Tensor) or primary.ndim < 2:
            return self._serial(original, args, kwargs, "first input is not a batched tensor")
        batch = primary.shape[0]
        if batch < 2:
            return original(*args, **kwargs)  # nothing to split: not worth a log line
        hooks = foreign_hooks(self.layer)
        if hooks:
            return self._serial(
                original, args, kwargs,
                "hooks inside the layer whose effect cannot be merged across replicas: "
                + "; ".join(hooks),
            )
        replicas = self._replicas
        try:
            replicas.sync()
        except NotReplicable as reason:
            return self._serial(original, args, kwargs, str(reason))

        parts = min(len(self.pool.devices), batch)
        try:
            prepared = _prepare_participants(self.layer, replicas, parts, primary)
        except NotReplicable as reason:
            return self._serial(original, args, kwargs, str(reason))
        try:
            return self._fanned(original, args, kwargs, batch, parts, primary, prepared)
        finally:
            for done in prepared:
                done.finish()

    def _fanned(
        self,
        original: Callable,
        args: tuple,
        kwargs: dict,
        batch: int,
        parts: int,
        primary: torch.Tensor,
        prepared: list[Prepared],
    ) -> Any:
        replicas = self._replicas
        sizes = split_sizes(batch, parts)
        shares = split_call(args, kwargs, batch, sizes)
        home_device = primary.device
        skip = set().union(*(done.skip for done in prepared))
        replicas.install_trainable_copies(parts, skip)  # before any worker starts
        context = ThreadContext.capture()

        def job(part: int) -> Callable[[], Any]:
            root = replicas.root_for(part)
            device = self.pool.devices[part]
            forward = original if root is None else root.forward
            forward = self._maybe_compiled(part, replicas.rebuilds, forward)
            share_args, share_kwargs = shares[part]

            def run() -> Any:
                with context.applied():
                    if root is not None:
                        moved_args, moved_kwargs = move_to((share_args, share_kwargs), device)
                    else:
                        moved_args, moved_kwargs = share_args, share_kwargs
                    output = forward(*moved_args, **moved_kwargs)
                    return move_to(output, home_device)

            return run

        outputs = self.pool.run([job(part) for part in range(parts)])
        self.parallel_calls += 1
        return gather_outputs(outputs, sizes)

    def _maybe_compiled(self, part: int, build: int, forward: Callable) -> Callable:
        if not self.compile_replicas:
            return forward
        key = (part, build)
        compiled = self._compiled.get(key)
        if compiled is not None:
            return compiled
        inner = torch.compile(forward)
        warmed = threading.Event()

        def first_call_locked(*args: Any, **kwargs: Any) -> Any:
            if warmed.is_set():
                return inner(*args, **kwargs)
            with _COMPILE_LOCK:
                result = inner(*args, **kwargs)
            warmed.set()
            return result

        self._compiled[key] = first_call_locked
        return first_call_locked
