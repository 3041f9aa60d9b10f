"""Linearised MoE experts run grouped while auto-round tunes their layer.

auto-round wraps every expert Linear in its own `WrapperLinear` and calls them one by
one through llm-compressor's `LinearExperts2D` loop: per forward, each of e.g. 384
wrappers fake-quantizes its weight and runs a small matmul. That is launch/GIL bound
and threads over GPUs do not scale it (DESIGN.md). Here, while the context is active,
each experts module of the layer runs as:

- wrapped (tuning, and any no-grad pass with wrappers): `QuantizedGroupedExperts`,
  all experts fake-quantized in two batched calls of auto-round's own quantizer and
  run in grouped matmuls, gradients summed in stock's order; the tuning parameters
  stay each wrapper's own, so auto-round's loop, optimizer and unwrapping are
  untouched.
- plain Linears (reference outputs before wrapping, quantized-input chain after
  unwrapping; and the sequential pipeline's calibration pass, where every module
  carries compressed-tensors' offloading wrapper, reproduced here):
  `StockOrderGroupedExperts`, the same grouped forward without qdq.
- anything else, or a call the grouped path cannot reproduce exactly: the stock loop,
  with one log line per module and reason.

The installed forward is a method bound to the experts module, so `FanOut`'s replicas
re-point it to their own experts copy; each device keeps its own stacks.
"""

from __future__ import annotations

import threading
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from loguru import logger
from torch import nn

from auto_round.wrapper import WrapperLinear
from compressed_tensors.quantization import QuantizationStatus
from compressed_tensors.quantization.lifecycle.forward import set_forward_quantized
from llmcompressor.modeling.moe.context import get_calibrate_all_experts_flag
from llmcompressor.modeling.moe.linear_experts import LinearExperts2D
from llmcompressor_parallel.engine.expert_tokens import (
    TokenMode,
    all_tokens_bytes,
    choose_all_tokens,
)
from llmcompressor_parallel.engine.fan_out import register_participant, unregister_participant
from llmcompressor_parallel.engine.grouped_autoround_experts import (
    QuantizedGroupedExperts,
    ShippedGroupedExperts,
    StockOrderGroupedExperts,
    experts_list,
    projections,
    stacks_from_rows,
    wrapped_unsupported_reason,
)
from llmcompressor_parallel.engine.grouped_autoround_qdq import TUNING_PARAMS
from llmcompressor_parallel.engine.grouped_autoround_forward import (
    StackRecorder,
    _compute_dtype,
    stack_recorders,
)
from llmcompressor_parallel.engine.grouped_experts import unsupported_reason
from llmcompressor_parallel.engine.grouped_ops import Backend
from llmcompressor_parallel.engine.hooks import any_hooks, global_hooks
from llmcompressor_parallel.engine.offload_forward import (
    is_offload_wrapper,
    parameter_values,
    same_device,
    send_like_offload,
    wrapper_target,
)
from llmcompressor_parallel.engine.replicate import NotReplicable, ReplicaSet
from llmcompressor_parallel.engine.scatter_gather import split_ranges

__all__ = [
    "GroupedAutoRoundExperts",
    "QuantizedGroupedExperts",
    "wrapped_unsupported_reason",
]

_MISSING = object()
# the code of compressed-tensors' per-instance `quantized_forward` closure
_CT_QUANTIZED_FORWARD_CODES = tuple(
    c for c in set_forward_quantized.__code__.co_consts if isinstance(c, types.CodeType)
)
_PLAN_ATTR = "_llmc_parallel_grouped_plan"


def _ct_quantization_active(module: nn.Module) -> bool:
    """Whether compressed-tensors' `quantized_forward` on `module` would change anything.

    The same test it makes: llm-compressor's pipeline switches quantization off
    (`quantization_enabled=False`) while AutoRound works on a layer.
    """
    scheme = getattr(module, "quantization_scheme", None)
    status = getattr(module, "quantization_status", None)
    if not getattr(module, "quantization_enabled", True) or scheme is None or status is None:
        return False
    weights = scheme.weights is not None and status < QuantizationStatus.COMPRESSED
    return bool(scheme.input_activations or scheme.output_activations or weights)


def _runs_own_forward(module: nn.Module, func: Any) -> bool:
    """Whether calling `func(module, ...)` computes what the class's forward computes."""
    own = type(module).forward
    if func is own:
        return True
    if getattr(func, "__code__", None) in _CT_QUANTIZED_FORWARD_CODES:
        return getattr(func, "__wrapped__", None) is own and not _ct_quantization_active(module)
    return False


def _patched_forward(module: nn.Module) -> bool:
    """Whether calling `module` would run something else than its class's forward.

    Harmless, and not counted: a bound method of the class's forward on the instance
    itself (what removing compressed-tensors' offloading leaves; FanOut re-points it),
    compressed-tensors' `quantized_forward` while quantization is off, and
    compressed-tensors' offloading wrapper around either (the sequential pipeline's
    passes; its input move is reproduced or checked: `_Site.forward`, `_call_reason`).
    """
    return _forward_state(module)[0]


def _forward_state(module: nn.Module) -> tuple[bool, torch.device | str | None]:
    """(`_patched_forward(module)`, `offload_onload_device(module)`) from one look at the
    instance forward: asked for hundreds of modules per call, and both first ask
    whether it is compressed-tensors' offloading wrapper."""
    forward = module.__dict__.get("forward")
    if forward is None:
        return False, None
    inner = None
    if is_offload_wrapper(module, forward):
        inner = module.__dict__.get("_original_forward_func")
    if inner is not None:
        return not _runs_own_forward(module, inner), wrapper_target(module)
    if not isinstance(forward, types.MethodType) or forward.__self__ is not module:
        return True, None
    return not _runs_own_forward(module, forward.__func__), None


def _fingerprint(tensors: list[torch.Tensor]) -> tuple:
    return tuple([(id(t), t.data_ptr(), t._version) for t in tensors])


@dataclass
class _Plan:
    """How one experts module (home or a replica) runs grouped, and its stacks.

    Kept in that module's own `__dict__`: a replica's dict starts as a copy of the
    home's, so a plan built for another module is recognised and replaced, and each
    plan lives exactly as long as its module (replicas rebuilt by `FanOut` take
    their stale stacks with them).
    """

    module: nn.Module
    key: tuple  # ids of the projection modules and the weights' device it was built for
    runner: StockOrderGroupedExperts | None  # None: refused, `reason` says why
    reason: str | None
    backend: str = "bmm"  # the runner's resolved kernel
    hooked: list[nn.Module] = field(default_factory=list)  # whose hooks stock would run
    called: list[nn.Module] = field(default_factory=list)  # whose forwards stock would call
    fingerprint: tuple = ()
    tokens_decided: bool = False  # all_tokens="auto": the runner's all_tokens is chosen

    def frozen_tensors(self) -> list[torch.Tensor]:
        runner = self.runner
        if isinstance(runner, (QuantizedGroupedExperts, ShippedGroupedExperts)):
            return runner.frozen_tensors()
        return parameter_values(projections(runner.experts))

    def refresh_if_changed(self) -> None:
        """Rebuild the stacks when weights were written in place (unwrap) or re-copied."""
        if _fingerprint(self.frozen_tensors()) != self.fingerprint:
            self.runner.refresh()
            self.fingerprint = _fingerprint(self.frozen_tensors())


def _plan_key(modules: list[nn.Module], shipped: bool = False) -> tuple:
    """Which projection modules, on which device, in which mode a plan is valid for."""
    weight = getattr(modules[0], "weight", None)
    device = weight.device if isinstance(weight, torch.Tensor) else None
    return (*map(id, modules), device, shipped)


def _build_plan(
    experts: LinearExperts2D,
    key: tuple,
    backend: Backend,
    all_tokens: TokenMode,
    shipped: bool = False,
) -> _Plan:
    projs = projections(experts)
    mlps = experts_list(experts)
    if shipped:  # a replica's experts in a qdq-once fan-out: stacks come from the home
        if not all(type(p) is WrapperLinear for p in projs):
            return _Plan(experts, key, None, "projections are not all auto-round WrapperLinears")
        reason = wrapped_unsupported_reason(experts, shipped=True)
        if reason is not None:
            return _Plan(experts, key, None, reason)
        runner = ShippedGroupedExperts(experts, backend=backend, all_tokens=all_tokens is not False)
        called = mlps + projs
        hooked = called + [p.orig_layer for p in projs]
    elif all(type(p) is WrapperLinear for p in projs):
        reason = wrapped_unsupported_reason(experts)
        if reason is not None:
            return _Plan(experts, key, None, reason)
        runner: StockOrderGroupedExperts = QuantizedGroupedExperts(
            experts, backend=backend, all_tokens=all_tokens is not False
        )
        # WrapperLinear runs its Linear's hooks itself, but never the Linear's forward
        called = mlps + projs
        hooked = called + [p.orig_layer for p in projs]
    elif all(type(p) is nn.Linear for p in projs):
        reason = unsupported_reason(experts)
        if reason is not None:
            return _Plan(experts, key, None, reason)
        runner = StockOrderGroupedExperts(
            experts, backend=backend, all_tokens=all_tokens is not False
        )
        called = hooked = mlps + projs
    else:
        reason = "projections are neither all plain Linears nor all auto-round WrapperLinears"
        return _Plan(experts, key, None, reason)
    plan = _Plan(experts, key, runner, None, runner.backend, hooked, called)
    plan.fingerprint = _fingerprint(plan.frozen_tensors())
    return plan


def _call_reason(plan: _Plan, hidden_states: torch.Tensor) -> str | None:
    """Why this call must take the stock loop although the module can run grouped."""
    return _input_reason(hidden_states) or _module_reason(plan, hidden_states.device.type)


def _input_reason(hidden_states: torch.Tensor) -> str | None:
    """The part of `_call_reason` that depends on the input alone."""
    if hidden_states.dim() != 2:
        return f"hidden_states has {hidden_states.dim()} dims, not [tokens, hidden]"
    return None


def _module_reason(plan: _Plan, device_type: str) -> str | None:
    """`_call_reason` without the input: what can be told before the call (the
    qdq-once fan-out asks it for every replica before shipping)."""
    runner = plan.runner
    if runner._trainable and torch.is_grad_enabled():
        return "plain experts with trainable weights inside a backward pass"
    if runner.gate_up_bias is not None and torch.is_autocast_enabled(device_type):
        # stock's biased linear stays in the autocast dtype; the grouped bias add would promote
        return "biased projections under autocast"
    if any_hooks(plan.hooked):
        return "a hook is registered on an expert or one of its projections"
    states = list(map(_forward_state, plan.called))
    if any(patched for patched, _ in states):
        return "an expert's or projection's forward is replaced (active quantization, a patch)"
    elsewhere = _onload_elsewhere({target for _, target in states}, runner.device)
    if elsewhere:
        return (
            f"expert modules onload their inputs to {', '.join(sorted(elsewhere))}, "
            f"the stacks are on {runner.device}"
        )
    if global_hooks():
        return "global module hooks are registered"
    return None


def _onload_elsewhere(targets: set[torch.device | str | None], device: torch.device) -> set[str]:
    """Which of `targets` (where offloading wrappers move inputs; None: nowhere) are
    other devices than `device`. `same_device` builds torch.devices: asked once per
    distinct target, not once per module (hundreds, on every call)."""
    return {str(t) for t in targets if t is not None and not same_device(t, device)}


def _call_backend(plan: _Plan, hidden_states: torch.Tensor) -> str:
    """The kernel for this call: `_grouped_mm` is no autocast op, `bmm` is.

    Under autocast, stock's Linears compute in the autocast dtype; `_grouped_mm` would
    compute in the operands' dtype (or fail on mixed dtypes), so it is used only where
    the operands already have the autocast dtype (bf16 models on GPU).
    """
    device_type = hidden_states.device.type
    if plan.backend == "grouped_mm" and torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
        if hidden_states.dtype != dtype or plan.runner.dtype != dtype:
            return "bmm"
    return plan.backend


class _Site:
    """One experts module of the layer: its stock forward, and the grouped call."""

    def __init__(self, owner: "GroupedAutoRoundExperts", home: LinearExperts2D, name: str):
        self.owner = owner
        self.home = home
        self.name = name
        self.saved_forward = home.__dict__.get("forward", _MISSING)
        # the sequential pipeline's passes: compressed-tensors' offloading wrapper, whose
        # input move the grouped call makes itself
        self.offload_wrapped = is_offload_wrapper(home, self.saved_forward)
        # during a qdq-once fan-out: each running experts module (home, replicas) ->
        # this call's qdq rows on its device; None otherwise
        self.shipped: dict[nn.Module, _ShippedRows] | None = None
        # experts routed per token at the latest call (the memory estimate's routed rows)
        self.top_k: int | None = None

    def stock_forward(self, experts: nn.Module) -> Callable[..., torch.Tensor]:
        if experts is self.home and self.saved_forward is not _MISSING:
            return self.saved_forward
        return types.MethodType(type(experts).forward, experts)

    def plan_for(self, experts: LinearExperts2D, shipped: bool = False) -> _Plan:
        """`experts`' plan; `shipped`: a replica's that runs qdq rows shipped from the home.

        Checked once per fanned-out call (`GroupedAutoRoundExperts.call_plans`): between
        the call's preparation and its end nothing rewires or rewrites the experts, and
        the plan is asked for up to five times a call (host time on the iteration's
        critical path)."""
        checked = self.owner.call_plans
        if checked is not None:
            plan = checked.get((id(experts), shipped))
            if plan is not None:
                return plan
        key = _plan_key(projections(experts), shipped)
        plan = experts.__dict__.get(_PLAN_ATTR)
        if plan is None or plan.module is not experts or plan.key != key:
            experts.__dict__.pop(_PLAN_ATTR, None)  # free the old stacks before building new ones
            plan = _build_plan(experts, key, self.owner.backend, self.owner.all_tokens, shipped)
            experts.__dict__[_PLAN_ATTR] = plan
        elif plan.runner is not None:
            plan.refresh_if_changed()
        if checked is not None:
            checked[(id(experts), shipped)] = plan
        return plan

    def choose_tokens(self, plan: _Plan, hidden_states: torch.Tensor) -> None:
        """all_tokens="auto", at the first call that would run all tokens: decide by memory."""
        if not (torch.is_grad_enabled() and get_calibrate_all_experts_flag()):
            return  # no-grad passes and routed mode run routed tokens anyway
        self.decide_tokens(plan, hidden_states.shape[0], _compute_dtype(hidden_states).itemsize)

    def decide_tokens(self, plan: _Plan, tokens: int, itemsize: int) -> None:
        """Set `plan`'s runner to all tokens where their estimated peak for `tokens`
        tokens fits its device's free memory, else to routed tokens with a log line.
        The routed rows count with the latest call's top_k (every expert if none came
        yet: an upper bound)."""
        runner = plan.runner
        top_k = runner.num_experts if self.top_k is None else self.top_k
        needed = all_tokens_bytes(
            runner.num_experts, tokens, runner.hidden_size, runner.intermediate_size,
            runner.has_gate, itemsize, top_k,
        )
        runner.all_tokens, why = choose_all_tokens(needed, runner.device)
        plan.tokens_decided = True
        if runner.all_tokens:
            logger.debug("{}: experts tuned on every token: {}", self.name, why)
        else:
            self.owner._log_once(self.name, f"experts tuned on routed tokens only: {why}")

    def release(self) -> None:
        """Give the home its forward back and drop its stacks."""
        if self.saved_forward is _MISSING:
            self.home.__dict__.pop("forward", None)
        else:
            self.home.forward = self.saved_forward
        self.home.__dict__.pop(_PLAN_ATTR, None)

    def forward(
        self,
        experts: LinearExperts2D,
        hidden_states: torch.Tensor,
        top_k_index: torch.Tensor,
        top_k_weights: torch.Tensor,
    ) -> torch.Tensor:
        shipped = self.shipped
        rows = None if shipped is None else shipped.get(experts)
        if shipped is not None and rows is None:
            raise RuntimeError(
                f"{self.name}: an experts module the qdq-once fan-out did not prepare was "
                "called during it; its tuning parameters were not copied"
            )
        self.top_k = top_k_index.shape[-1]
        plan = self.plan_for(experts, shipped=rows is not None and experts is not self.home)
        if plan.runner is None:
            reason = plan.reason
        elif rows is not None:  # the call's preparation checked this module just before
            reason = _input_reason(hidden_states)
        else:
            reason = _call_reason(plan, hidden_states)
        if reason is not None and rows is not None and experts is not self.home:
            # never the stock loop here: a replica holds no tuning parameters (the home
            # does, and takes the stock loop as usual)
            raise RuntimeError(
                f"{self.name}: in a qdq-once fan-out the experts on {hidden_states.device} "
                f"cannot run grouped ({reason}) and have no tuning parameters for the "
                "stock loop"
            )
        if reason is not None:
            self.owner._count(stock=True, name=self.name, reason=reason)
            return self.stock_forward(experts)(hidden_states, top_k_index, top_k_weights)
        self.owner._count(stock=False)
        if experts is self.home and self.offload_wrapped:
            hidden_states, top_k_index, top_k_weights = send_like_offload(
                experts, hidden_states, top_k_index, top_k_weights
            )
        runner = plan.runner
        if self.owner.all_tokens == "auto" and not plan.tokens_decided:
            self.choose_tokens(plan, hidden_states)
        runner.backend = _call_backend(plan, hidden_states)
        device = runner.device
        stacks = None
        if rows is not None:
            stacks = stacks_from_rows(rows.gate_up, rows.down, runner)
            stacks.recorder = rows.recorder
        output = runner.forward(
            hidden_states.to(device), top_k_index.to(device), top_k_weights.to(device),
            stacks=stacks,
        )
        return output.to(hidden_states.device)


class GroupedAutoRoundExperts:
    """Context manager: the linearised MoE experts inside `layer` run grouped while active.

    Enter it around auto-round's per-layer work (`quantize_block`), before any `FanOut`
    of the same layer is entered, so that replicas copy the grouped forward. On exit the
    experts' own forwards are restored and the stacks freed.

    :param layer: the decoder layer (or any module) holding `LinearExperts2D` modules
    :param name: how the layer is called in log lines
    :param backend: segment-matmul kernel, "auto", "grouped_mm" or "bmm" (grouped_ops.py)
    :param all_tokens: in llm-compressor's all-experts mode (oneshot's default), when
        gradients are needed: True sums the experts' weight gradients over every
        token as stock does (bit-identical on CPU; the forward and input gradients
        run on the routed rows, the weight gradients on [experts, tokens, .]
        buffers, the routed rows' output gradients among zeros); False over routed
        tokens only, same math up to floating-point order, no such buffers; "auto"
        True where the estimated peak fits the device's free memory at each experts
        module's first such call (expert_tokens.py), else False with a log line
    :param qdq_once: when a `FanOut` of a layer holding these experts splits a call
        over replicas, the home computes the experts' qdq once (both stacks, with the
        home's tuning parameters), each replica receives the two stacks through one
        differentiable copy each and runs its grouped forward over them; the experts'
        tuning parameters are then not copied to the replicas. Where a replica's
        experts could not run grouped, the call runs serially (`prepare_fan_out`).
        False: every replica gets the tuning parameters and computes its own qdq.
    :param exact: with `qdq_once`, in fanned-out calls with gradients where every
        part runs all tokens, the stacks' gradients are computed on the home over
        the whole batch's rows, as the serial grouped backward computes them
        (gathered_weight.py); "auto" `all_tokens` is then decided for all parts at
        once, before the call
    """

    def __init__(
        self,
        layer: nn.Module,
        name: str = "",
        backend: Backend = "auto",
        all_tokens: TokenMode = True,
        qdq_once: bool = True,
        exact: bool = False,
    ) -> None:
        if not (isinstance(all_tokens, bool) or all_tokens == "auto"):
            raise ValueError(f"all_tokens={all_tokens!r}; allowed: True, False, 'auto'")
        self.layer = layer
        self.name = name or type(layer).__name__
        self.backend = backend
        self.all_tokens = all_tokens
        self.qdq_once = qdq_once
        self.exact = exact
        self.shipped_calls = 0  # experts modules whose qdq a fan-out computed once and shipped
        self.grouped_calls = 0
        self.stock_calls = 0
        self.module_names: list[str] = []  # the experts modules routed (kept after exit)
        self._sites: list[_Site] = []
        self._logged: set[tuple[str, str]] = set()
        self._lock = threading.Lock()
        # during a fanned-out call that ships qdq rows (from `prepare_fan_out` to its
        # shipment's `finish`): the plans checked in it, by (id(module), shipped)
        self.call_plans: dict[tuple[int, bool], _Plan] | None = None

    def __enter__(self) -> "GroupedAutoRoundExperts":
        for module_name, module in self.layer.named_modules():
            if not isinstance(module, LinearExperts2D):
                continue
            name = f"{self.name}.{module_name}" if module_name else self.name
            if _patched_forward(module):  # someone else's forward: keep what it does
                logger.info("{}: experts run the stock per-expert loop: its forward is "
                            "replaced by {!r}", name, module.__dict__["forward"])
                continue
            site = _Site(self, module, name)
            module.forward = types.MethodType(_bound_forward(site), module)
            self._sites.append(site)
            self.module_names.append(name)
        if self.qdq_once and self._sites:
            register_participant(self.layer, self)
        return self

    def grouped_modules(self) -> list[LinearExperts2D]:
        """The experts modules that run grouped in the call being prepared (their qdq is
        shipped, or the home's plan can run grouped): their wrapped Linears are this
        context's; those of experts that take stock's per-expert loop are not."""
        modules = []
        for site in self._sites:
            if site.shipped is None:
                plan = site.plan_for(site.home)
                if plan.runner is None or _module_reason(plan, plan.runner.device.type):
                    continue
            modules.append(site.home)
        return modules

    def __exit__(self, *exc_info: object) -> None:
        unregister_participant(self.layer, self)
        for site in self._sites:
            site.shipped = None
            site.release()
        self._sites = []

    def prepare_fan_out(
        self, replicas: ReplicaSet, parts: int, primary: torch.Tensor
    ) -> "_Shipment | None":
        """Before a fanned-out call (caller's thread, before any worker starts): qdq once.

        For every experts module that the home runs grouped with qdq and that runs on
        a replica in this call: checks that each replica's copy can run grouped over
        shipped stacks (else raises `NotReplicable`: the caller runs the call serially,
        since those replicas get no tuning parameters), computes the qdq rows on the
        home (auto-round's in-place scale clamps included) and hands each replica a
        differentiable copy of both. With `exact`, where every part runs all tokens,
        the parts get detached copies instead and the stacks' gradients are computed
        from all parts' rows (gathered_weight.py), the experts cut into one range per
        part's device for the qdq and those gradients (`_split_by_experts`). Returns
        which home tensors the fan-out must not copy to the replicas, or None when
        nothing is shipped.
        """
        self.call_plans = {}
        try:
            shipment = self._prepare(replicas, parts, primary)
        except BaseException:
            self.call_plans = None
            raise
        if shipment is None:
            self.call_plans = None
        return shipment

    def _prepare(
        self, replicas: ReplicaSet, parts: int, primary: torch.Tensor
    ) -> "_Shipment | None":
        work = []
        for site in self._sites:
            modules = replicas.counterparts(site.home, parts)
            if modules is None or all(m is site.home for m in modules):
                continue  # not inside the fanned-out layer, or only the home runs
            if not any(m is site.home for m in modules):
                continue  # the home runs no part (it sits elsewhere): each replica its own qdq
            home_plan = site.plan_for(site.home)
            runner = home_plan.runner
            if not isinstance(runner, QuantizedGroupedExperts):
                continue  # stock loop or plain Linears: replicas get the parameters, as before
            if _module_reason(home_plan, runner.device.type) is not None:
                continue
            plans = {}
            for module in modules:
                if module is site.home:
                    continue
                plan = site.plan_for(module, shipped=True)
                reason = plan.reason
                if plan.runner is not None:
                    reason = _module_reason(plan, plan.runner.device.type)
                if reason is not None:
                    raise NotReplicable(
                        f"{site.name}: a replica's experts would run the stock per-expert "
                        f"loop ({reason}); with qdq once they hold no tuning parameters"
                    )
                plans[module] = plan
            work.append((site, runner, modules, plans))
        if not work:
            return None
        shipment = _Shipment(self)
        try:
            for site, runner, modules, plans in work:
                if self._gathers_exactly(site, runner, plans, primary):
                    shipped = self._split_by_experts(site, runner, modules, plans, replicas, parts)
                else:
                    shipped = self._copied_to_parts(site, runner, modules, plans)
                site.shipped = shipped
                shipment.sites.append(site)
                wrappers = runner.gate_up_qdq.wrappers + runner.down_qdq.wrappers
                shipment.skip.update(
                    id(w._parameters[name]) for w in wrappers for name in TUNING_PARAMS
                )
        except BaseException:
            shipment.finish()
            raise
        with self._lock:
            self.shipped_calls += len(shipment.sites)
        return shipment

    def _gathers_exactly(
        self, site: "_Site", runner: StockOrderGroupedExperts, plans: dict, primary: torch.Tensor
    ) -> bool:
        """Whether this call's experts gradients are gathered on the home: `exact`, with
        gradients, in llm-compressor's all-experts mode, and every part on all tokens
        (decided here for all parts where `all_tokens` is "auto", by the home's memory
        for the whole batch's tokens, since the home then holds the whole batch's rows)."""
        if not (self.exact and torch.is_grad_enabled() and get_calibrate_all_experts_flag()):
            return False
        home_plan = site.plan_for(site.home)
        if self.all_tokens == "auto" and not home_plan.tokens_decided:
            tokens = primary.shape[0] * (primary.shape[1] if primary.dim() == 3 else 1)
            site.decide_tokens(home_plan, tokens, _compute_dtype(primary).itemsize)
        if not runner.all_tokens:
            self._log_once(site.name, "experts' weight gradients summed per replica: they "
                                      "are tuned on routed tokens")
            return False
        for plan in plans.values():  # the replicas follow the home's choice
            plan.runner.all_tokens, plan.tokens_decided = True, True
        return True

    @staticmethod
    def _copied_to_parts(
        site: "_Site", runner: "QuantizedGroupedExperts", modules: list[nn.Module], plans: dict
    ) -> "dict[nn.Module, _ShippedRows]":
        """The home's qdq rows, and a differentiable copy of them on each replica (in the
        replica's dtype: half the bytes both ways, same values, since the replica would
        cast first thing; the gradient still turns fp32 on the home before the partials
        are added)."""
        gate_up, down = runner.qdq_rows()
        shipped = {}
        for module in modules:
            if module is site.home:
                shipped[module] = _ShippedRows(gate_up, down)
                continue
            replica = plans[module].runner
            shipped[module] = _ShippedRows(
                *(rows.to(replica.dtype).to(replica.device) for rows in (gate_up, down))
            )
        return shipped

    @staticmethod
    def _split_by_experts(
        site: "_Site", runner: "QuantizedGroupedExperts", modules: list[nn.Module],
        plans: dict, replicas: ReplicaSet, parts: int,
    ) -> "dict[nn.Module, _ShippedRows]":
        """The exact fan-out, its per-weight work cut by experts over the parts' devices.

        What the home alone did for all experts (their qdq, its backward, and the
        weight-gradient matmuls over the whole batch's rows) grows with the weights,
        not with the batch, so it left the second GPU idle for most of an iteration.
        Here the experts are cut into one contiguous range per part: range i's qdq
        runs on part i's device (its tuning parameters copied there differentiably),
        and so does its stacks' gradient, from every part's rows (`GatheredWeight`
        with `first_expert`). Each part runs the forward over the whole qdq, the
        ranges assembled in its dtype. Every range's qdq and weight gradient equals
        the whole call's bit for bit (groups and experts are independent; measured on
        H200s: bench/probe.py expert-split-bits), so the gradients are the home-only
        path's.
        """
        runners = [runner if module is site.home else plans[module].runner for module in modules]
        bounds = split_ranges(runner.num_experts, min(parts, runner.num_experts))
        rows = runner.qdq_rows_by_range(bounds, [part.device for part in runners])
        ranges = [
            stacks_from_rows(gate_up, down, runner, experts=stop - first)
            for (gate_up, down), (first, stop) in zip(rows, bounds)
        ]
        recorders = stack_recorders(
            ranges, replicas.devices[:parts], site.name, [first for first, _ in bounds]
        )
        return {
            module: _ShippedRows(
                _assembled([r[0] for r in rows], target.dtype, target.device),
                _assembled([r[1] for r in rows], target.dtype, target.device),
                recorder,
            )
            for module, target, recorder in zip(modules, runners, recorders)
        }

    def _count(self, stock: bool, name: str = "", reason: str = "") -> None:
        with self._lock:
            if not stock:
                self.grouped_calls += 1
                return
            self.stock_calls += 1
        self._log_once(name, f"experts run the stock per-expert loop: {reason}")

    def _log_once(self, name: str, message: str) -> None:
        with self._lock:
            first = (name, message) not in self._logged
            self._logged.add((name, message))
        if first:
            logger.info("{}: {}", name, message)


@dataclass
class _Shipment:
    """One fanned-out call's shipped qdq: `skip` (ids of the home tensors the fan-out
    must not copy to the replicas); `finish()` after the call's forward."""

    owner: GroupedAutoRoundExperts
    sites: list[_Site] = field(default_factory=list)
    skip: set[int] = field(default_factory=set)

    def finish(self) -> None:
        for site in self.sites:
            site.shipped = None
        self.sites = []
        self.owner.call_plans = None


def _assembled(pieces: list[torch.Tensor], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The pieces' rows, detached, in one [rows, columns] tensor of `dtype` on `device`
    (each piece cast and copied straight into its place: no intermediate concatenation)."""
    whole = torch.empty(
        sum(piece.shape[0] for piece in pieces), pieces[0].shape[1], dtype=dtype, device=device
    )
    start = 0
    for piece in pieces:
        whole[start : start + piece.shape[0]].copy_(piece.detach())
        start += piece.shape[0]
    return whole


@dataclass
class _ShippedRows:
    """One running experts module's qdq rows for a call, and its part's recorder
    where the stacks' gradients are gathered on the home."""

    gate_up: torch.Tensor
    down: torch.Tensor
    recorder: StackRecorder | None = None


def _bound_forward(site: _Site) -> Callable[..., Any]:
    """A plain function for `types.MethodType`: FanOut re-binds it to each replica."""

    def forward(experts: LinearExperts2D, hidden_states, top_k_index, top_k_weights):
        return site.forward(experts, hidden_states, top_k_index, top_k_weights)

    return forward
