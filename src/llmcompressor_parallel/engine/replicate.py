"""Replicas of one layer on other devices, kept in step with the home layer.

A replica is a tree of shallow module copies (torch's `_replicate_for_data_parallel`)
whose tensors live on the replica's device:
- frozen tensors (parameters without grad, buffers, plain tensor attributes such as
  auto-round's `weight_min`) are copied once and copied again only when the home
  tensor changes (new object, new storage or in-place write) or the module tree
  changes (auto-round wraps Linears at the start of a layer and unwraps them at
  the end: the replica is then rebuilt);
- trainable parameters are copied differentiably on every call, so one backward
  on the home device sums every replica's gradient into the home parameters.
  All copies of a call are taken before any worker starts, because auto-round
  clamps its scale factors in place inside the forward.
Per-instance attributes that pin a device (`device`, `output_device` strings)
or bind a method to the home module are re-pointed at the replica (DESIGN.md
traps 1 and 4). What cannot be re-pointed raises `NotReplicable`, and the caller
then runs the layer serially, saying why.
"""

from __future__ import annotations

import types
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch
from torch import nn
from torch.nn.parallel import comm

from llmcompressor_parallel.engine.module_walk import walk_modules

__all__ = ["NotReplicable", "ReplicaSet", "copy_detached", "module_device"]

_HOOK_DICTS = (
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_backward_hooks",
    "_backward_pre_hooks",
    "_state_dict_hooks",
    "_state_dict_pre_hooks",
    "_load_state_dict_pre_hooks",
    "_load_state_dict_post_hooks",
)


# types whose instances are never tensors: most values of a module's `__dict__`, where
# isinstance(value, torch.Tensor) takes ~0.1 us each for a non-tensor (torch's metaclass)
_NOT_TENSORS = frozenset(
    {
        bool, int, float, str, type(None), dict, OrderedDict, set, list, tuple,
        types.MethodType, types.FunctionType, torch.dtype, torch.device,
    }
)


class NotReplicable(Exception):
    """The layer holds something a replica cannot safely reproduce."""


def module_device(module: nn.Module) -> torch.device | None:
    for tensor in _own_and_child_tensors(module):
        return tensor.device
    return None


def _own_and_child_tensors(module: nn.Module) -> Iterator[torch.Tensor]:
    for tensor in module.parameters():
        yield tensor
    for tensor in module.buffers():
        yield tensor


def _fingerprint(tensor: torch.Tensor) -> tuple:
    return (id(tensor), tensor.data_ptr(), tensor._version, tensor.shape, tensor.dtype)


def _tensor_attributes(module: nn.Module) -> tuple[str, ...]:
    """The names of `module`'s plain tensor attributes (`__dict__` values that are
    tensors), not asking isinstance about values of the `_NOT_TENSORS` types."""
    return tuple(
        [
            name
            for name, value in module.__dict__.items()
            if type(value) not in _NOT_TENSORS and isinstance(value, torch.Tensor)
        ]
    )


def _is_device_value(value: Any, device: torch.device) -> bool:
    if isinstance(value, torch.device):
        return value == device
    if isinstance(value, str) and value.split(":")[0] in ("cpu", "cuda"):
        try:
            return torch.device(value) == device
        except RuntimeError:
            return False
    return False


@dataclass
class _Slot:
    """One tensor of the home tree: where it sits and how it is copied."""

    module_index: int
    kind: str  # "param", "buffer" or "attr"
    name: str
    trainable: bool


@dataclass
class _Replica:
    device: torch.device
    modules: list[nn.Module] = field(default_factory=list)  # parallel to home modules


class ReplicaSet:
    """Replicas of `home` on `devices`; a device equal to home's reuses home itself.

    `sync()` must be called in the caller's thread before each fan-out; it rebuilds
    or refreshes what changed and returns which modules run each part.
    """

    def __init__(self, home: nn.Module, devices: list[torch.device], root_forward: Any):
        self.home = home
        self.devices = list(devices)
        self._root_forward = root_forward  # the forward that replicas of the root run
        self._structure: list[tuple] | None = None
        self._home_modules: list[nn.Module] = []
        self._slots: list[_Slot] = []
        self._frozen: list[int] = []  # indices of the slots not trainable
        self._fingerprints: list[tuple] = []
        self._replicas: list[_Replica | None] = []
        self.rebuilds = 0

    # ---------------------------------------------------------------- structure
    def _current_structure(self) -> list[tuple]:
        """What a rebuild depends on, per module of the home tree: its children, its
        parameters (and whether each is trainable), its buffers, the names of its
        tensor attributes. Compared on every fanned-out call, so built flat: names and
        ids as separate tuples made in C, and `walk_modules` instead of `modules()`."""
        entries = []
        for module in walk_modules(self.home):
            children, parameters, buffers = module._modules, module._parameters, module._buffers
            entries.append(
                (
                    id(module),
                    tuple(children),
                    tuple(map(id, children.values())),
                    tuple(parameters),
                    tuple([None if p is None else (id(p), p.requires_grad) for p in parameters.values()]),
                    tuple(buffers),
                    tuple(map(id, buffers.values())),
                    _tensor_attributes(module),
                )
            )
        return entries

    def sync(self) -> None:
        """Bring every replica up to date with the home layer."""
        structure = self._current_structure()
        if structure != self._structure:
            self._build()
            self._structure = structure
            return
        slots, fingerprints = self._slots, self._fingerprints
        changed = [
            index
            for index in self._frozen
            if _fingerprint(self._home_tensor(slots[index])) != fingerprints[index]
        ]
        if changed:
            self._copy_frozen(changed)

    def release(self) -> None:
        self._replicas = []
        self._slots = []
        self._frozen = []
        self._fingerprints = []
        self._home_modules = []
        self._structure = None

    # ---------------------------------------------------------------- building
    def _home_tensor(self, slot: _Slot) -> torch.Tensor:
        module = self._home_modules[slot.module_index]
        if slot.kind == "param":
            return module._parameters[slot.name]
        if slot.kind == "buffer":
            return module._buffers[slot.name]
        return module.__dict__[slot.name]

    def _build(self) -> None:
        self.rebuilds += 1
        self._home_modules = list(self.home.modules())
        home_device = module_device(self.home)
        self._slots = []
        for index, module in enumerate(self._home_modules):
            for name, param in module._parameters.items():
                if param is not None:
                    self._slots.append(_Slot(index, "param", name, param.requires_grad))
            for name, buffer in module._buffers.items():
                if buffer is not None:
                    self._slots.append(_Slot(index, "buffer", name, False))
            for name, value in module.__dict__.items():
                if isinstance(value, torch.Tensor) and not isinstance(value, nn.Parameter):
                    self._slots.append(_Slot(index, "attr", name, False))
        used_home = False
        self._replicas = []
        for device in self.devices:
            if not used_home and device == home_device:
                used_home = True
                self._replicas.append(None)  # the home layer runs this part itself
                continue
            self._replicas.append(self._replicate_structure(device, home_device))
        self._fingerprints = [() for _ in self._slots]
        self._frozen = [i for i, slot in enumerate(self._slots) if not slot.trainable]
        self._copy_frozen(self._frozen)

    def _replicate_structure(self, device: torch.device, home_device: torch.device | None) -> _Replica:
        mapping: dict[int, nn.Module] = {}
        replica = _Replica(device)
        for module in self._home_modules:
            copy = module._replicate_for_data_parallel()
            for hook_dict in _HOOK_DICTS:
                if hasattr(copy, hook_dict):
                    setattr(copy, hook_dict, type(getattr(module, hook_dict))())
            mapping[id(module)] = copy
            replica.modules.append(copy)
        for module, copy in zip(self._home_modules, replica.modules):
            copy._modules = {
                name: None if child is None else mapping[id(child)]
                for name, child in module._modules.items()
            }
            for name, value in list(copy.__dict__.items()):
                if module is self.home and name == "forward":
                    continue  # the root's forward is set below
                copy.__dict__[name] = self._repoint(module, name, value, mapping, device, home_device)
            copy._parameters = {
                name: None for name, value in module._parameters.items() if value is None
            }
        root = replica.modules[0]
        forward = self._root_forward
        if forward is None:
            root.__dict__.pop("forward", None)
        else:
            root.__dict__["forward"] = self._repoint(self.home, "forward", forward, mapping, device, home_device)
        return replica

    def _repoint(
        self,
        module: nn.Module,
        name: str,
        value: Any,
        mapping: dict[int, nn.Module],
        device: torch.device,
        home_device: torch.device | None,
    ) -> Any:
        if isinstance(value, types.MethodType) and isinstance(value.__self__, nn.Module):
            target = mapping.get(id(value.__self__))
            if target is None:
                raise NotReplicable(
                    f"{type(module).__name__}.{name} is a method bound to a module "
                    "outside the layer"
                )
            return types.MethodType(value.__func__, target)
        if name == "forward" and value is not None:
            raise NotReplicable(
                f"{type(module).__name__}.forward was replaced by {value!r} "
                "(an offloading or hook wrapper), which a replica cannot re-point"
            )
        if home_device is not None and _is_device_value(value, home_device):
            return device if isinstance(value, torch.device) else str(device)
        return value

    def _copy_frozen(self, slot_indices: list[int]) -> None:
        """Copy the given frozen home tensors to every replica (coalesced on GPUs)."""
        home = [self._home_tensor(self._slots[i]) for i in slot_indices]
        for replica in self._replicas:
            if replica is None:
                continue
            copies = copy_detached(home, replica.device)
            for index, copy in zip(slot_indices, copies):
                self._install(replica, self._slots[index], copy)
        for index, tensor in zip(slot_indices, home):
            self._fingerprints[index] = _fingerprint(tensor)

    @staticmethod
    def _install(replica: _Replica, slot: _Slot, tensor: torch.Tensor) -> None:
        module = replica.modules[slot.module_index]
        if slot.kind == "param":
            module._parameters[slot.name] = tensor
        elif slot.kind == "buffer":
            module._buffers[slot.name] = tensor
        else:
            module.__dict__[slot.name] = tensor

    @staticmethod
    def _remove(replica: _Replica, slot: _Slot) -> None:
        module = replica.modules[slot.module_index]
        if slot.kind == "param":
            module._parameters.pop(slot.name, None)
        elif slot.kind == "buffer":
            module._buffers.pop(slot.name, None)
        else:
            module.__dict__.pop(slot.name, None)

    # ---------------------------------------------------------------- per call
    def counterparts(self, module: nn.Module, parts: int) -> list[nn.Module] | None:
        """The module that runs `module`'s work in each of the first `parts` parts:
        `module` itself where the home runs the part, else the replica's copy.
        None when `module` is not inside the replicated layer."""
        try:
            index = next(i for i, m in enumerate(self._home_modules) if m is module)
        except StopIteration:
            return None
        return [
            module if replica is None else replica.modules[index]
            for replica in self._replicas[:parts]
        ]

    def install_trainable_copies(self, parts: int, skip: set[int] | frozenset = frozenset()) -> None:
        """Give the first `parts` replicas fresh differentiable copies of the trainables.

        Runs in the caller's thread, before any worker starts.

        :param skip: ids of home trainable tensors not to copy (their users on the
            replicas get what they need otherwise: grouped_autoround's qdq once); the
            replicas' previous copies of them are removed, so that nothing can use a
            stale one
        """
        trainable = [slot for slot in self._slots if slot.trainable]
        if not trainable:
            return
        targets = [r for r in self._replicas[:parts] if r is not None]
        params = [self._home_tensor(slot) for slot in trainable]
        if skip:
            for replica in targets:
                for slot, param in zip(trainable, params):
                    if id(param) in skip:
                        self._remove(replica, slot)
            kept = [(slot, param) for slot, param in zip(trainable, params) if id(param) not in skip]
            if not kept:
                return
            trainable, params = (list(column) for column in zip(*kept))
        for replica, copies in zip(targets, _copy_differentiable(params, [r.device for r in targets])):
            for slot, copy in zip(trainable, copies):
                self._install(replica, slot, copy)

    def root_for(self, part: int) -> nn.Module | None:
        """The replica root that runs part `part`, or None where home runs it."""
        replica = self._replicas[part]
        return None if replica is None else replica.modules[0]


def _all_cuda(tensors: list[torch.Tensor], devices: list[torch.device]) -> bool:
    return all(t.is_cuda for t in tensors) and all(d.type == "cuda" for d in devices)


def copy_detached(tensors: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """Plain copies of `tensors` on `device` (coalesced between GPUs)."""
    if not tensors:
        return []
    with torch.no_grad():
        source = tensors[0].device
        if _all_cuda(tensors, [device]) and all(t.device == source for t in tensors) and source != device:
            return list(comm.broadcast_coalesced([t.detach() for t in tensors], [source, device])[1])
        return [t.detach().to(device, copy=True) for t in tensors]


class _BroadcastToReplicas(torch.autograd.Function):
    """Copies of tensors for other devices; backward sums the copies' gradients at the source.

    On GPUs the copies are coalesced (torch.cuda.comm). torch's own `Broadcast` also
    returns the source device's group, whose unused gradients would be materialised
    as zeros and added every iteration; this one returns only the targets' copies.
    """

    @staticmethod
    def forward(ctx, targets: list[torch.device], *tensors: torch.Tensor):
        ctx.source = tensors[0].device
        ctx.count = len(tensors)
        if _all_cuda(list(tensors), targets) and all(t != ctx.source for t in targets):
            groups = comm.broadcast_coalesced(tensors, [ctx.source, *targets])[1:]
        else:
            groups = [[t.to(device, copy=True) for t in tensors] for device in targets]
        return tuple(copy for group in groups for copy in group)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        summed = []
        for index in range(ctx.count):
            total = None
            for grad in grads[index :: ctx.count]:
                if grad is not None:
                    grad = grad.to(ctx.source)
                    total = grad if total is None else total + grad
            summed.append(total)
        return (None, *summed)


def _copy_differentiable(
    params: list[torch.Tensor], devices: list[torch.device]
) -> list[list[torch.Tensor]]:
    """Differentiable copies of `params` (all on one device) for each of `devices`."""
    if not devices:
        return []
    if any(p.device != params[0].device for p in params):
        return [[p.to(device, copy=True) for p in params] for device in devices]
    flat = _BroadcastToReplicas.apply(devices, *params)
    count = len(params)
    return [list(flat[i * count : (i + 1) * count]) for i in range(len(devices))]
