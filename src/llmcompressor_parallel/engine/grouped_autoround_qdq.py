"""auto-round's weight fake quantization (qdq) for many wrapped Linears in one call.

auto-round's `WrapperLinear` fake-quantizes its own weight on every forward with its
own tuning parameters (`value`, `min_scale`, `max_scale`): for a MoE layer with 128
experts that is 384 separate qdq's of a dozen small kernels each, per forward. The int
quantizers (`quant_tensor_sym`, `quant_tensor_asym`) work group by group along the rows
of the weight reshaped to [groups, group_size] (rows padded first where needed), and
every group's result depends only on its own weights and parameters. So the weights
of same-shaped Linears stacked along the output dimension, with their parameters
concatenated in the same order, go through the very same auto-round function in one
call and give, element for element, what each wrapper computes alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from auto_round.wrapper import WrapperLinear
from llmcompressor_parallel.engine.hooks import has_hooks
from llmcompressor_parallel.engine.offload_forward import parameter_values

__all__ = [
    "ROW_SEPARABLE_DATA_TYPES",
    "StackedQdq",
    "group_unsupported_reason",
    "wrapper_unsupported_reason",
]

# auto-round data types whose quantizer only mixes values within one row of the
# reshaped weight (one group): stacking rows of several weights cannot change a group
ROW_SEPARABLE_DATA_TYPES = frozenset({"int_sym", "int_asym"})
TUNING_PARAMS = ("value", "min_scale", "max_scale")


def wrapper_unsupported_reason(wrapper: nn.Module, shipped: bool = False) -> str | None:
    """Why `wrapper`'s qdq cannot be batched with the exact stock math (None: it can).

    Anything that adds inputs to auto-round's quant call, or work to the wrapper's
    forward, beyond the plain int weight qdq is refused here, so that the caller
    keeps the stock per-expert forward for it.

    :param shipped: the wrapper is a replica's whose qdq the home computes and ships
        (grouped_autoround's qdq-once fan-out): its tuning parameters are not copied
        to the replica, so their presence is not checked here (the home's are)
    """
    if type(wrapper) is not WrapperLinear:
        return f"{type(wrapper).__name__} is not auto-round's WrapperLinear"
    layer = wrapper.orig_layer
    if type(layer) is not nn.Linear:
        return f"the wrapped layer is a {type(layer).__name__}, not a Linear"
    if layer.bits >= 16:
        return f"the wrapped layer is not quantized (bits={layer.bits})"
    if wrapper.data_type not in ROW_SEPARABLE_DATA_TYPES:
        allowed = ", ".join(sorted(ROW_SEPARABLE_DATA_TYPES))
        return f"data type {wrapper.data_type!r} is not one of {allowed}"
    group_size = layer.group_size
    if isinstance(group_size, tuple) or group_size == 0:
        return f"group_size={group_size!r}: block or per-tensor scales span several rows"
    if wrapper.enable_act_quant:
        return f"activations are quantized too (act_bits={layer.act_bits})"
    if wrapper.enable_norm_bias_tuning:
        return "bias tuning (enable_norm_bias_tuning) is on"
    if getattr(wrapper, "weight_global_scale", None) is not None:
        return "the wrapper has a global weight scale"
    if getattr(wrapper, "init_scale", None) is not None:
        return "the wrapper has an init_scale (SignRound v2 / enable_alg_ext)"
    if getattr(layer, "super_bits", None) is not None:
        return "double quantization (super_bits) is on"
    if hasattr(wrapper, "_extra_quant_kwargs"):
        return "the wrapper adds its own quantization arguments"
    if layer.weight.device.type == "meta":
        return "the wrapped weight is on the meta device"
    if layer.weight.requires_grad or (layer.bias is not None and layer.bias.requires_grad):
        return "the wrapped weight or bias is trainable (the stacks are detached)"
    for name in () if shipped else TUNING_PARAMS:
        # a tuned one is registered (on a replica: its differentiable copy of the home
        # Parameter); an untuned one is a plain 0-dim attribute
        if wrapper._parameters.get(name) is None:
            return f"{name} is not tuned (round or min-max tuning is off)"
    if (wrapper.weight_min is None) != (wrapper.weight_max is None):
        return "only one of weight_min / weight_max is set"
    if has_hooks(wrapper) or has_hooks(layer):
        return "a hook is registered on the wrapper or its Linear"
    device = layer.weight.device
    if torch.device(wrapper.device) != device or torch.device(wrapper.output_device) != device:
        return "the wrapper computes or outputs on another device than its weight"
    return None


def _settings(wrapper: WrapperLinear) -> tuple:
    """Everything of a wrapper that enters its qdq, other than its own tensors."""
    layer = wrapper.orig_layer
    return (
        wrapper.weight_quant_func,
        wrapper.data_type,
        wrapper.q_scale_thresh,
        type(wrapper).minmax_scale_bound,
        wrapper.weight_min is None,
        layer.bits,
        layer.group_size,
        layer.scale_dtype,
        layer.weight.shape[1],
        layer.weight.dtype,
        layer.weight.device,
        hasattr(layer, "super_bits"),
        getattr(layer, "super_group_size", None),
    )


def group_unsupported_reason(wrappers: Sequence[nn.Module], shipped: bool = False) -> str | None:
    """Why `wrappers` cannot share one batched qdq (None: they can); `shipped`: as
    `wrapper_unsupported_reason`."""
    if not wrappers:
        return "no wrappers to group"
    first_settings = None
    for wrapper in wrappers:
        reason = wrapper_unsupported_reason(wrapper, shipped)
        if reason is not None:
            return reason
        settings = _settings(wrapper)
        if first_settings is None:
            first_settings = settings
        elif settings != first_settings:
            return "the wrappers differ in quantization settings, input size, dtype or device"
    return None


def _fp32_exact(weight_dtype: torch.dtype, scale_dtype: torch.dtype) -> bool:
    """Whether the int quantizers compute `weight / scale` in fp32 or wider anyway.

    Then handing them the weight in fp32 changes no value: every other op meets the
    fp32 `value` / scale factors, and only the final cast (to the input's dtype) moves.
    """
    if not (weight_dtype.is_floating_point and isinstance(scale_dtype, torch.dtype)):
        return False
    return torch.promote_types(weight_dtype, scale_dtype).itemsize >= 4


@dataclass
class StackedQdq:
    """One batched auto-round qdq for the weights of `wrappers`, stacked along rows.

    `weight` [sum of out_features, in_features] holds the wrappers' original weights
    in the order of `wrappers` (a detached stack, built once per layer); the tuning
    parameters are read from the wrappers on every call, so auto-round's optimizer,
    best-parameter copies and unwrapping keep working on each wrapper's own ones.
    """

    wrappers: list[WrapperLinear]
    weight: torch.Tensor
    weight_min: torch.Tensor | None
    weight_max: torch.Tensor | None
    # rows of `weight` copied to other devices for `raw_range`, by (device, start, stop);
    # dropped with the stack when the stacks are rebuilt
    _weight_copies: dict[tuple, torch.Tensor] = field(default_factory=dict)

    @classmethod
    @torch.no_grad()
    def build(cls, wrappers: Sequence[WrapperLinear], weight: torch.Tensor) -> "StackedQdq":
        """Group `wrappers` over `weight`, the stack of their `orig_layer.weight`s."""
        reason = group_unsupported_reason(wrappers)
        if reason is not None:
            raise ValueError(f"cannot batch these wrappers' qdq: {reason}")
        rows = sum(w.orig_layer.weight.shape[0] for w in wrappers)
        if weight.shape != (rows, wrappers[0].orig_layer.weight.shape[1]):
            raise ValueError(f"weight stack {tuple(weight.shape)} does not match the wrappers")
        weight_min = weight_max = None
        if wrappers[0].weight_min is not None:
            weight_min = torch.cat([w.weight_min.to(weight.device) for w in wrappers])
            weight_max = torch.cat([w.weight_max.to(weight.device) for w in wrappers])
        return cls(list(wrappers), weight, weight_min, weight_max)

    def frozen_tensors(self) -> list[torch.Tensor]:
        """The tensors the stacks were built from (weights, biases, weight_min/max).

        Read through the module dicts: this runs on every call to detect changes.
        """
        tensors = parameter_values([w._modules["orig_layer"] for w in self.wrappers])
        if self.weight_min is not None:
            tensors += [w.__dict__["weight_min"] for w in self.wrappers]
            tensors += [w.__dict__["weight_max"] for w in self.wrappers]
        return tensors

    def clamp_scales(self) -> None:
        """auto-round's in-place clamp of min/max scale, for all wrappers in two kernels.

        Stock `_qdq_weight` clamps `min_scale.data` and `max_scale.data` in place on
        every forward; `.data` keeps autograd's version counters untouched, as stock.
        """
        low, high = type(self.wrappers[0]).minmax_scale_bound
        names = ("min_scale", "max_scale")
        data = [w._parameters[name].data for name in names for w in self.wrappers]
        torch._foreach_clamp_min_(data, low)
        torch._foreach_clamp_max_(data, high)

    def gather(
        self, name: str, start: int = 0, stop: int | None = None, device: torch.device | None = None
    ) -> torch.Tensor:
        """Parameter `name` of wrappers [start, stop), concatenated differentiably (grads
        reach each), then copied to `device` (default: where the parameters are)."""
        wrappers = self.wrappers[start:stop]
        gathered = torch.cat([w._parameters[name] for w in wrappers])
        return gathered if device is None else gathered.to(device)

    def __call__(self) -> torch.Tensor:
        """Fake-quantized stacked weight [rows, in], as each wrapper's `_qdq_weight` gives it."""
        return self.raw().to(self.weight.dtype)

    def raw(self, fp32: bool = False) -> torch.Tensor:
        """The qdq before the cast to the weight's dtype.

        auto-round's int quantizers compute in fp32 (the weight meets fp32 scales and
        `value`) and cast their result to the weight's dtype themselves. `fp32=True`
        hands them the weight in fp32 (exact), so that the result stays fp32 and the
        cast to the weight's dtype is left to the caller: the same values after that
        cast, and a gradient that reaches this point in fp32. The qdq-once fan-out
        uses it so that the replicas' gradients are summed in fp32 before the single
        qdq backward, as separate qdq backwards would sum them. Where the quantizer
        would divide the weight by its scale in a narrower dtype (scale dtype = weight
        dtype, e.g. both fp16), the weight is left as is: the result then has the
        weight's dtype, as stock.
        """
        self.clamp_scales()
        return self._quantize(0, len(self.wrappers), self.weight, fp32)

    def raw_range(self, start: int, stop: int, device: torch.device) -> torch.Tensor:
        """`raw(fp32=True)`'s rows of wrappers [start, stop), computed on `device`.

        Call `clamp_scales()` once before a call's ranges. The wrappers' tuning
        parameters reach `device` through differentiable copies (their gradients
        return to the home's parameters); the range's weight rows are copied there
        once and kept. Every group's result depends on its own rows and parameters
        only, so each range equals the whole stack's rows bit for bit (measured on
        H200s: bench/probe.py expert-split-bits).
        """
        rows = self._wrapper_rows(self.weight, start, stop)
        if device != self.weight.device:
            key = (device, start, stop)
            if key not in self._weight_copies:
                self._weight_copies[key] = rows.to(device)
            rows = self._weight_copies[key]
        return self._quantize(start, stop, rows, fp32=True, device=device)

    def _wrapper_rows(self, tensor: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        """`tensor`'s rows of wrappers [start, stop): the stacks hold the same number of
        rows per wrapper, in wrapper order (a view)."""
        per = tensor.shape[0] // len(self.wrappers)
        return tensor[start * per : stop * per]

    def _quantize(
        self,
        start: int,
        stop: int,
        weight: torch.Tensor,
        fp32: bool,
        device: torch.device | None = None,
    ) -> torch.Tensor:
        """auto-round's quantizer over `weight`, the rows of wrappers [start, stop)."""
        first = self.wrappers[0]
        layer = first.orig_layer
        quant_kwargs = {}
        if hasattr(layer, "super_bits"):  # stock passes them whenever the layer has them
            quant_kwargs = {
                "super_bits": layer.super_bits,
                "super_group_size": layer.super_group_size,
            }
        if fp32 and _fp32_exact(weight.dtype, layer.scale_dtype):
            weight = weight.float()

        def moved(tensor: torch.Tensor | None) -> torch.Tensor | None:
            if tensor is None:
                return None
            return self._wrapper_rows(tensor, start, stop).to(device or tensor.device)

        weight_q, _, _ = first.weight_quant_func(
            weight,
            bits=layer.bits,
            group_size=layer.group_size,
            v=self.gather("value", start, stop, device),
            min_scale=self.gather("min_scale", start, stop, device),
            max_scale=self.gather("max_scale", start, stop, device),
            scale_dtype=layer.scale_dtype,
            tensor_min=moved(self.weight_min),
            tensor_max=moved(self.weight_max),
            data_type=first.data_type,
            q_scale_thresh=first.q_scale_thresh,
            imatrix=None,  # the row-separable int quantizers ignore it
            global_scale=None,
            init_scale=None,
            **quant_kwargs,
        )
        return weight_q
