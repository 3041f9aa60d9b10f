"""Weight gradients of auto-round's wrapped Linears summed as stock sums them.

While a fanned-out call runs with gradients, the home computes each wrapped Linear's
fake-quantized weight once, with auto-round's own `_qdq_weight` (its in-place scale
clamps included), and hands every part a detached copy (in autocast's dtype where
autocast would cast it); each part runs the Linear on its own rows, and the weight
gradient is computed once over the whole batch (gathered_weight.py), then auto-round's
qdq backward runs once on it. The tuning parameters are then not copied to the
replicas. The result is stock's gradient bit for bit wherever a row-split forward is
(CPU: tests/test_exact_weight_grads.py; 2 H200s at the Llama-3-8B shape: stock's
checkpoint); the price is that the weight-gradient matmuls (a third of a Linear's
tuning FLOPs) run on the home only.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from loguru import logger
from torch import nn

from auto_round.wrapper import WrapperLinear
from llmcompressor_parallel.engine.fan_out import register_participant, unregister_participant
from llmcompressor_parallel.engine.gathered_weight import GatheredWeight
from llmcompressor_parallel.engine.replicate import ReplicaSet, copy_detached

__all__ = ["ExactWeightGradients", "exact_unsupported_reason"]


def exact_unsupported_reason(wrapper: WrapperLinear) -> str | None:
    """Why `wrapper`'s weight gradient cannot be gathered as above (None: it can).

    Anything beyond a plain Linear whose only tuned tensors feed its weight's qdq
    (activation quantization, bias tuning, Conv1D, a replaced forward) is refused:
    those tensors' gradients would still be summed per replica.
    """
    layer = wrapper.orig_layer
    if type(layer) is not nn.Linear:
        return f"the wrapped layer is a {type(layer).__name__}, not a Linear"
    if wrapper.enable_act_quant:
        return "activations are quantized too (act_bits <= 8)"
    if wrapper.enable_norm_bias_tuning:
        return "the bias is tuned too"
    forward = wrapper.__dict__.get("orig_forward")
    if getattr(forward, "__func__", None) is not WrapperLinear.linear_forward:
        return f"its orig_forward is {forward!r}, not auto-round's linear_forward"
    if layer.weight.device.type == "meta":
        return "its weight is on the meta device"
    return None


def _tuned(wrapper: WrapperLinear) -> dict[str, torch.Tensor]:
    return {
        name: param
        for name, param in wrapper._parameters.items()
        if param is not None and param.requires_grad
    }


@dataclass
class _Shipment:
    """What one call's parts use: each part's weight copy, and the gathered gradient."""

    weights: list[torch.Tensor]
    gathered: GatheredWeight


class _Site:
    """One wrapped Linear of the layer and the modules that run it in each part."""

    def __init__(self, name: str, home: WrapperLinear, modules: list[WrapperLinear]) -> None:
        self.name = name
        self.home = home
        self.modules = modules
        self.shipment: _Shipment | None = None
        # stable per part, so that a compiled share sees the same functions every call
        self.qdq_functions = [functools.partial(self._shipped_weight, p) for p in range(len(modules))]
        self.linear_functions = [functools.partial(self._linear, p) for p in range(len(modules))]

    def _shipped_weight(self, part: int, *_tuning: Any) -> tuple:
        return self.shipment.weights[part], None, None

    def _linear(self, part: int, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
        output = F.linear(x, weight, bias)
        shipment = self.shipment
        if not torch.is_grad_enabled() or shipment is None:
            return output
        return shipment.gathered.record(part, x.to(output.dtype), output)


@dataclass
class _Call:
    """One fanned-out call's patches: `skip` for the fan-out; `finish()` undoes them."""

    skip: set[int] = field(default_factory=set)
    restores: list[Callable[[], None]] = field(default_factory=list)
    sites: list[_Site] = field(default_factory=list)

    def finish(self) -> None:
        for restore in reversed(self.restores):
            restore()
        for site in self.sites:
            site.shipment = None
        self.restores, self.sites = [], []


def _set_attr(module: nn.Module, name: str, value: Any) -> Callable[[], None]:
    """Set an instance attribute; return what puts the previous state back."""
    missing = object()
    previous = module.__dict__.get(name, missing)
    module.__dict__[name] = value

    def restore() -> None:
        if previous is missing:
            module.__dict__.pop(name, None)
        else:
            module.__dict__[name] = previous

    return restore


class ExactWeightGradients:
    """Context manager: fanned-out tuning calls of `layer` gather every supported wrapped
    Linear's weight gradient on the home (see the module docstring).

    :param leave_to: called at each call's preparation (after the other participants'):
        the modules whose wrapped Linears are someone else's this call (experts modules
        that run grouped; those that fall back to stock's per-expert loop are covered
        here)

    Any other wrapped Linear that cannot be handled keeps per-replica sums, with a log
    line naming it and why.
    """

    def __init__(
        self,
        layer: nn.Module,
        name: str = "",
        leave_to: Callable[[], Sequence[nn.Module]] = tuple,
    ) -> None:
        self.layer = layer
        self.name = name or type(layer).__name__
        self.leave_to = leave_to
        self.exact_calls = 0
        self._sites: list[_Site] = []
        self._key: tuple | None = None
        self._logged: set[str] = set()  # all of this runs in the caller's thread

    def __enter__(self) -> "ExactWeightGradients":
        register_participant(self.layer, self)
        return self

    def __exit__(self, *exc_info: object) -> None:
        unregister_participant(self.layer, self)
        self._sites, self._key = [], None

    # ------------------------------------------------------------ the call
    def prepare_fan_out(
        self, replicas: ReplicaSet, parts: int, primary: torch.Tensor
    ) -> _Call | None:
        """Before a fanned-out call with gradients (caller's thread, no worker running):
        the qdq once per wrapped Linear, copies to the parts, the parts' wrappers
        patched to use them. Returns None when there is nothing to do."""
        if not torch.is_grad_enabled():
            return None
        sites = self._sites_for(replicas, parts)
        if not sites:
            return None
        devices = replicas.devices[:parts]
        call = _Call()
        try:
            weights = [self._qdq(site) for site in sites]
            copies = self._ship(weights, devices)
            for index, (site, weight_q) in enumerate(zip(sites, weights)):
                gathered = GatheredWeight(weight_q, devices, site.name)
                site.shipment = _Shipment([copies[p][index] for p in range(parts)], gathered)
                call.sites.append(site)
                self._patch(site, call)
        except BaseException:
            call.finish()
            raise
        self.exact_calls += 1
        return call

    @staticmethod
    def _qdq(site: _Site) -> torch.Tensor:
        wrapper = site.home
        weight_q, _, _ = wrapper._qdq_weight(wrapper.value, wrapper.min_scale, wrapper.max_scale)
        return weight_q

    @staticmethod
    def _ship(weights: list[torch.Tensor], devices: list[torch.device]) -> list[list[torch.Tensor]]:
        """Detached copies of `weights` per part, cast first to autocast's dtype where
        autocast would cast them inside the Linear (same values, fewer bytes)."""
        home = weights[0].device
        if torch.is_autocast_enabled(home.type):
            dtype = torch.get_autocast_dtype(home.type)
            weights = [w.detach().to(dtype) if w.dtype == torch.float32 else w.detach() for w in weights]
        else:
            weights = [w.detach() for w in weights]
        return [weights if device == home else copy_detached(weights, device) for device in devices]

    @staticmethod
    def _patch(site: _Site, call: _Call) -> None:
        tuned = _tuned(site.home)
        call.skip.update(id(param) for param in tuned.values())
        for part, module in enumerate(site.modules):
            call.restores.append(_set_attr(module, "_qdq_weight", site.qdq_functions[part]))
            call.restores.append(_set_attr(module, "orig_forward", site.linear_functions[part]))
            if module is not site.home:  # the replica gets no copies of the tuned tensors
                for name in tuned:
                    call.restores.append(_set_attr(module, name, None))

    # ------------------------------------------------------------ which Linears
    def _sites_for(self, replicas: ReplicaSet, parts: int) -> list[_Site]:
        left = self.leave_to()
        key = (replicas.rebuilds, parts, frozenset(map(id, left)))
        if key == self._key:
            return self._sites
        sites = []
        for module_name, module in self._wrappers(left):
            name = f"{self.name}.{module_name}"
            if not _tuned(module):
                continue
            reason = exact_unsupported_reason(module)
            if reason is not None:
                self._log_once(f"{name}: weight gradients summed per replica: {reason}")
                continue
            modules = replicas.counterparts(module, parts)
            if modules is None or not any(m is module for m in modules):
                continue  # not replicated, or the home runs no part
            sites.append(_Site(name, module, modules))
        self._sites, self._key = sites, key
        return sites

    def _wrappers(self, leave_to: Sequence[nn.Module]) -> list[tuple[str, WrapperLinear]]:
        left = {id(m) for owner in leave_to for m in owner.modules()}
        return [
            (name, module)
            for name, module in self.layer.named_modules()
            if type(module) is WrapperLinear and id(module) not in left
        ]

    def _log_once(self, message: str) -> None:
        if message not in self._logged:
            self._logged.add(message)
            logger.info(message)
