"""Run a traced subgraph's code on several devices at once, one batch per worker.

Why: llm-compressor's sequential pipeline executes a subgraph as generated Python
code, `forward(model, **inputs)`, which reaches the layers as attribute paths of
`model` (`getattr(self.model.layers, "0")(...)`). Each worker gets a stand-in for
`model` (`ModelView`) on which the paths of the subgraph's layers lead to that
worker's replica; everything else (the glue between layers: norms, rotary
embeddings, masks, the disabled lm_head) is the home model's, run where the
pipeline put it. A replica's call moves its inputs to the replica's device and
its outputs back to the caller's, so the glue never sees another device.
The model itself is never patched: other code calling it sees nothing.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from llmcompressor_parallel.engine.replicate import ReplicaSet
from llmcompressor_parallel.engine.scatter_gather import move_to

__all__ = ["ModelView", "LayerOnDevice", "SubgraphReplicas"]


class LayerOnDevice:
    """A replica standing in for its home layer: inputs there, outputs back.

    Attribute reads (other than calling it) go to the home layer, so glue code that
    reads a layer's attribute sees the same value on every worker.
    """

    def __init__(self, home: nn.Module, replica: nn.Module, device: torch.device):
        self._home = home
        self._replica = replica
        self._device = device

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        caller_device = _first_tensor_device((args, kwargs))
        moved_args, moved_kwargs = move_to((args, kwargs), self._device)
        outputs = self._replica(*moved_args, **moved_kwargs)
        return outputs if caller_device is None else move_to(outputs, caller_device)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._home, name)


class ModelView:
    """Stands in for `model` in a subgraph's code; `overrides` maps dotted paths to stand-ins."""

    __slots__ = ("_module", "_path", "_overrides", "_prefixes")

    def __init__(
        self,
        module: nn.Module,
        overrides: Mapping[str, Any],
        path: str = "",
        prefixes: frozenset[str] | None = None,
    ):
        self._module = module
        self._path = path
        self._overrides = overrides
        self._prefixes = prefixes if prefixes is not None else _prefixes(overrides)

    def __getattr__(self, name: str) -> Any:
        path = f"{self._path}.{name}" if self._path else name
        override = self._overrides.get(path)
        if override is not None:
            return override
        value = getattr(self._module, name)
        if path in self._prefixes:
            return ModelView(value, self._overrides, path, self._prefixes)
        return value


class SubgraphReplicas:
    """Replicas of a subgraph's layers, one set per part (worker).

    Part `k` runs on `devices[k]`; a part whose device is the layer's own runs the
    home layer itself (ReplicaSet's rule). Build raises `NotReplicable` when a layer
    holds something a replica cannot reproduce.
    """

    def __init__(
        self, model: nn.Module, layer_names: Sequence[str], devices: Sequence[torch.device]
    ):
        self.model = model
        self.layer_names = list(layer_names)
        self.devices = [torch.device(device) for device in devices]
        self.layers = [model.get_submodule(name) for name in self.layer_names]
        self._sets = [
            ReplicaSet(layer, self.devices, root_forward=layer.__dict__.get("forward"))
            for layer in self.layers
        ]
        for replica_set in self._sets:
            replica_set.sync()
            replica_set.install_trainable_copies(len(self.devices))

    @property
    def parts(self) -> int:
        return len(self.devices)

    def view(self, part: int) -> nn.Module | ModelView:
        """What the subgraph code of part `part` is called with in place of the model."""
        overrides = {}
        for name, layer, replica_set in zip(self.layer_names, self.layers, self._sets):
            root = replica_set.root_for(part)
            if root is not None:
                overrides[name] = LayerOnDevice(layer, root, self.devices[part])
        return ModelView(self.model, overrides) if overrides else self.model

    def module_map(self, part: int) -> dict[nn.Module, nn.Module]:
        """Home module -> the module part `part` runs in its place (itself for home)."""
        mapping: dict[nn.Module, nn.Module] = {}
        for layer, replica_set in zip(self.layers, self._sets):
            root = replica_set.root_for(part)
            if root is None:
                mapping.update({module: module for module in layer.modules()})
                continue
            replicas = dict(root.named_modules())
            mapping.update({module: replicas[name] for name, module in layer.named_modules()})
        return mapping

    def release(self) -> None:
        for replica_set in self._sets:
            replica_set.release()
        self._sets = []


def _prefixes(overrides: Mapping[str, Any]) -> frozenset[str]:
    """Every proper dotted prefix of the override paths: "model", "model.layers"."""
    prefixes = set()
    for path in overrides:
        parts = path.split(".")
        prefixes.update(".".join(parts[:end]) for end in range(1, len(parts)))
    return frozenset(prefixes)


def _first_tensor_device(tree: Any) -> torch.device | None:
    for leaf in tree_leaves(tree):
        if isinstance(leaf, torch.Tensor):
            return leaf.device
    return None
