"""llm-compressor's linearised experts, plain or wrapped by auto-round, run grouped.

`StockOrderGroupedExperts` runs plain Linear experts with stock's summation order
(no-grad passes and backward alike). `QuantizedGroupedExperts` computes what
`LinearExperts2D.forward` computes over auto-round's per-expert `WrapperLinear`s:
every expert's weight fake-quantized with its own tuning parameters, then the expert
MLPs over the routed tokens. Here the experts' original weights are stacked once,
all experts are fake-quantized in two batched calls of auto-round's own quantizer
(`StackedQdq`: gate+up, down), and the expert matmuls run grouped
(grouped_autoround_forward, on grouped_ops' routing and segment matmuls). The tuning
parameters stay each wrapper's own and are gathered differentiably per call, so
auto-round's optimizer, best-parameter copies and unwrapping work on them unchanged.
"""

from __future__ import annotations

import torch
from torch import nn

from llmcompressor.modeling.moe.context import get_calibrate_all_experts_flag
from llmcompressor.modeling.moe.linear_experts import LinearExperts2D
from llmcompressor_parallel.engine.grouped_autoround_forward import ExpertStacks, experts_forward
from llmcompressor_parallel.engine.grouped_autoround_qdq import StackedQdq, group_unsupported_reason
from llmcompressor_parallel.engine.grouped_experts import _STOCK_EXPERT_FORWARDS, GroupedExperts
from llmcompressor_parallel.engine.grouped_ops import Backend
from llmcompressor_parallel.engine.offload_forward import parameter_values

__all__ = [
    "QuantizedGroupedExperts",
    "ShippedGroupedExperts",
    "StockOrderGroupedExperts",
    "experts_list",
    "projections",
    "wrapped_unsupported_reason",
]


def _projection_names(experts: LinearExperts2D) -> tuple[str, ...]:
    return ("gate_proj", "up_proj", "down_proj") if experts.has_gate else ("up_proj", "down_proj")


def experts_list(experts: LinearExperts2D) -> list[nn.Module]:
    """The expert MLPs, read through `_modules` (cheap enough to do on every call)."""
    children = experts._modules
    return [children[str(index)] for index in range(experts.num_experts)]


def projections(experts: LinearExperts2D) -> list[nn.Module]:
    """Every expert's projections, expert-major, in `_projection_names` order."""
    names = _projection_names(experts)
    return [expert._modules[name] for expert in experts_list(experts) for name in names]


def _qdq_groups(experts: LinearExperts2D) -> tuple[list[nn.Module], list[nn.Module]]:
    """(gate/up wrappers in the row order of GroupedExperts' gate_up stack, down wrappers)."""
    first = ("gate_proj", "up_proj") if experts.has_gate else ("up_proj",)
    mlps = experts_list(experts)
    gate_up = [mlp._modules[name] for mlp in mlps for name in first]
    return gate_up, [mlp._modules["down_proj"] for mlp in mlps]


def wrapped_unsupported_reason(experts: nn.Module, shipped: bool = False) -> str | None:
    """Why `experts`, with auto-round-wrapped projections, cannot run grouped (None: it can).

    :param shipped: a replica's experts that run qdq stacks shipped from the home
        (`ShippedGroupedExperts`): their tuning parameters are not checked
    """
    if not isinstance(experts, LinearExperts2D):
        return f"{type(experts).__name__} is not a LinearExperts2D"
    if type(experts).forward is not LinearExperts2D.forward:
        return f"{type(experts).__name__} overrides LinearExperts2D.forward"
    for index, expert in enumerate(experts_list(experts)):
        if type(expert).forward not in _STOCK_EXPERT_FORWARDS:
            return f"expert {index} is a {type(expert).__name__} with its own forward"
    gate_up, down = _qdq_groups(experts)
    for wrappers in (gate_up, down):
        reason = group_unsupported_reason(wrappers, shipped)
        if reason is not None:
            return reason
    biases = {w.orig_layer.bias is None for w in gate_up + down}
    if len(biases) > 1:
        return "some projections have a bias and some do not"
    shapes = {tuple(w.orig_layer.weight.shape) for w in gate_up}
    if len(shapes) > 1:
        return "gate/up projections differ in shape"
    return None


class StockOrderGroupedExperts(GroupedExperts):
    """`GroupedExperts` (its stacks and fields) with a forward that also trains.

    The forward (grouped_autoround_forward) sums outputs and gradients in the order
    of stock's per-expert loop; the weights it runs come from `stacks()`: here the
    original weights (plain Linears), in `QuantizedGroupedExperts` their qdq.

    :param all_tokens: in llm-compressor's all-experts mode, when gradients are
        needed, sum the weight gradients over every token, as stock does; False:
        over routed tokens only
    """

    def __init__(
        self,
        experts: LinearExperts2D,
        device: torch.device | str | None = None,
        backend: Backend = "auto",
        all_tokens: bool = True,
    ) -> None:
        super().__init__(experts, device, backend)
        self.all_tokens = all_tokens

    def stacks(self) -> ExpertStacks:
        """This call's weights: the stacked original Linears."""
        return _split_stacks(self.gate_up_t, self.down_t, self)

    def forward(
        self,
        hidden_states: torch.Tensor,
        top_k_index: torch.Tensor,
        top_k_weights: torch.Tensor,
        *,
        all_experts: bool | None = None,
        hessians: None = None,
        stacks: ExpertStacks | None = None,
    ) -> torch.Tensor:
        """Stock `LinearExperts2D.forward`'s result (and gradients), grouped.

        :param stacks: this call's weights, where the caller formed them
            (`stacks_from_rows` over qdq rows shipped from the home); default `stacks()`
        """
        if hessians is not None:
            raise ValueError(f"{type(self).__name__} does not fill Hessians")
        if hidden_states.dim() != 2:
            shape = tuple(hidden_states.shape)
            raise ValueError(f"expected hidden_states [tokens, hidden], got {shape}")
        if self._trainable and torch.is_grad_enabled():
            raise RuntimeError("the experts' weights are trainable; their stacks are detached")
        if all_experts is None:
            all_experts = get_calibrate_all_experts_flag()
        return experts_forward(
            hidden_states, top_k_index, top_k_weights,
            self.stacks() if stacks is None else stacks, self.activation,
            self.backend, all_experts, self.all_tokens,
        )

    __call__ = forward


def _split_stacks(
    gate_up_t: torch.Tensor, down_t: torch.Tensor, grouped: GroupedExperts
) -> ExpertStacks:
    """GroupedExperts' fused [E, H, (2)I] stack as separate gate and up views."""
    intermediate = grouped.intermediate_size
    first = gate_up_t.split(intermediate, dim=2)
    first_bias = None
    if grouped.gate_up_bias is not None:
        first_bias = grouped.gate_up_bias.split(intermediate, dim=-1)
    return ExpertStacks(first, down_t, first_bias, grouped.down_bias)


class QuantizedGroupedExperts(StockOrderGroupedExperts):
    """The wrapped experts' forward: all experts fake-quantized in two batched calls.

    The original weights are stacked once (the parent's `refresh`, which reads
    `WrapperLinear.weight`, i.e. the wrapped Linear's weight). Each call
    fake-quantizes the stacks with the wrappers' current tuning parameters,
    differentiably, and runs the experts over them.

    :param experts: a `LinearExperts2D` whose projections auto-round wrapped
    :param device: where the stacks live (default: the experts' weight device)
    :param backend: segment-matmul kernel, "auto", "grouped_mm" or "bmm"
    :param all_tokens: as `StockOrderGroupedExperts`
    """

    KIND = "wrapped experts"

    @staticmethod
    def unsupported_reason(experts: nn.Module) -> str | None:
        """GroupedExperts refuses wrapped projections; these need auto-round's wrappers."""
        return wrapped_unsupported_reason(experts)

    @torch.no_grad()
    def refresh(self) -> None:
        """Stack the original weights; group the wrappers' qdq over those stacks."""
        super().refresh()
        # training goes through the qdq of these stacks, never the stacks themselves
        self._trainable = False
        gate_up, down = _qdq_groups(self.experts)
        # [E, in, out] stacks back to the Linears' [rows, in] layout, experts stacked
        gate_up_rows = self.gate_up_t.transpose(1, 2).reshape(-1, self.hidden_size)
        down_rows = self.down_t.transpose(1, 2).reshape(-1, self.intermediate_size)
        self.gate_up_qdq = StackedQdq.build(gate_up, gate_up_rows)
        self.down_qdq = StackedQdq.build(down, down_rows)

    def frozen_tensors(self) -> list[torch.Tensor]:
        """Tensors the stacks were built from: weights, biases, weight_min/max."""
        return self.gate_up_qdq.frozen_tensors() + self.down_qdq.frozen_tensors()

    def stacks(self) -> ExpertStacks:
        """This call's weights: every expert's qdq with its current tuning parameters."""
        return stacks_from_rows(self.gate_up_qdq(), self.down_qdq(), self)

    def qdq_rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This call's qdq in the Linears' row layout (gate_up, down), before the cast to
        the weights' dtype: fp32 where that is exact (`StackedQdq.raw`). What the
        qdq-once fan-out computes once on the home and ships to the replicas; each
        forms its stacks with `stacks_from_rows`, the same values as `stacks()`."""
        return self.gate_up_qdq.raw(fp32=True), self.down_qdq.raw(fp32=True)

    def qdq_rows_by_range(
        self, ranges: list[tuple[int, int]], devices: list[torch.device]
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """`qdq_rows()` cut by experts: range i's (gate_up, down) rows computed on
        `devices[i]`, bit for bit the whole call's rows of those experts. auto-round's
        in-place scale clamps run once, on the home, before any range."""
        self.gate_up_qdq.clamp_scales()
        self.down_qdq.clamp_scales()
        per_expert = len(self.gate_up_qdq.wrappers) // self.num_experts
        return [
            (
                self.gate_up_qdq.raw_range(start * per_expert, stop * per_expert, device),
                self.down_qdq.raw_range(start, stop, device),
            )
            for (start, stop), device in zip(ranges, devices)
        ]


def stacks_from_rows(
    gate_up_rows: torch.Tensor, down_rows: torch.Tensor, grouped: GroupedExperts,
    experts: int | None = None,
) -> ExpertStacks:
    """Expert stacks from qdq rows ([E*(2)I, H], [E*H, I]) on the rows' device.

    The cast to the weights' dtype happens here (a no-op where the rows have it), so
    a differentiable copy of fp32 rows returns its gradient in fp32. `experts`: how
    many experts the rows hold (default: all of `grouped`'s).
    """
    experts = grouped.num_experts if experts is None else experts
    hidden, intermediate = grouped.hidden_size, grouped.intermediate_size
    gate_up_t = gate_up_rows.to(grouped.dtype).view(experts, -1, hidden).transpose(1, 2)
    down_t = down_rows.to(grouped.dtype).view(experts, hidden, intermediate).transpose(1, 2)
    return _split_stacks(gate_up_t, down_t, grouped)


class ShippedGroupedExperts(StockOrderGroupedExperts):
    """A replica's wrapped experts whose qdq the home computes and ships (qdq-once).

    Holds only what the grouped forward needs besides the weights (sizes, activation,
    biases): no weight stacks, no qdq, and no use of the tuning parameters, which the
    fan-out does not copy to this replica. Every call takes its stacks from the
    caller (`forward(..., stacks=stacks_from_rows(...))`); `stacks()` raises.
    """

    KIND = "wrapped experts (qdq shipped from the home)"

    @staticmethod
    def unsupported_reason(experts: nn.Module) -> str | None:
        return wrapped_unsupported_reason(experts, shipped=True)

    @torch.no_grad()
    def refresh(self) -> None:
        gate_up, down = _qdq_groups(self.experts)
        self._hidden = gate_up[0].orig_layer.weight.shape[1]
        self._intermediate = down[0].orig_layer.weight.shape[1]
        self.gate_up_bias = self.down_bias = None
        if down[0].orig_layer.bias is not None:
            per_expert = len(gate_up) // self.num_experts
            # [E, (2)I]: gate rows then up rows per expert, as GroupedExperts' stack
            first = [
                torch.cat([w.orig_layer.bias for w in gate_up[e * per_expert:(e + 1) * per_expert]])
                for e in range(self.num_experts)
            ]
            self.gate_up_bias = torch.stack([b.to(self.device) for b in first])
            self.down_bias = torch.stack([w.orig_layer.bias.to(self.device) for w in down])
        self._trainable = False

    @property
    def hidden_size(self) -> int:
        return self._hidden

    @property
    def intermediate_size(self) -> int:
        return self._intermediate

    def frozen_tensors(self) -> list[torch.Tensor]:
        """The replica's copies of the wrapped weights and biases (re-copied: refresh)."""
        gate_up, down = _qdq_groups(self.experts)
        return parameter_values([w._modules["orig_layer"] for w in gate_up + down])

    def stacks(self) -> ExpertStacks:
        raise RuntimeError(
            "these experts' qdq is shipped from the home device: pass stacks= to forward"
        )
