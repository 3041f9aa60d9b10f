"""llm-compressor's linearised MoE experts (`LinearExperts2D`), run grouped.

Stock `LinearExperts2D.forward` loops in Python over the experts: three Linear calls
and three GPTQ hook calls per expert per batch. That loop is launch/GIL bound, so
threads over GPUs do not help (DESIGN.md, measured facts 2-3). `GroupedExperts`
stacks the experts' weights once and runs all experts in a few grouped matmuls;
`GroupedExpertHessians` (grouped_hessians.py) fills the same Hessians in a few
batched kernels. Routing is not touched: the MoE block's router computes
`top_k_index` / `top_k_weights` and passes them in, exactly as to the stock module.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import torch
from torch import nn

from llmcompressor.modeling.moe.context import get_calibrate_all_experts_flag
from llmcompressor.modeling.moe.linear_experts import (
    ExpertMLPWithGate,
    ExpertMLPWithoutGate,
    LinearExperts2D,
)
from llmcompressor_parallel.engine.grouped_ops import (
    Backend,
    resolve_backend,
    route,
    segment_matmul,
)

if TYPE_CHECKING:
    from llmcompressor_parallel.engine.grouped_hessians import GroupedExpertHessians

__all__ = ["GroupedExperts", "grouped_forward", "unsupported_reason"]

_STOCK_EXPERT_FORWARDS = (ExpertMLPWithGate.forward, ExpertMLPWithoutGate.forward)


def unsupported_reason(experts: nn.Module) -> str | None:
    """Why `experts` cannot run grouped with stock's exact math (None: it can).

    Only the generic path is reproduced: `LinearExperts2D.forward` with
    `ExpertMLPWithGate` / `ExpertMLPWithoutGate` experts made of plain Linears.
    Model-specific subclasses (Llama4, custom expert classes) keep the stock loop.
    """
    if not isinstance(experts, LinearExperts2D):
        return f"{type(experts).__name__} is not a LinearExperts2D"
    if type(experts).forward is not LinearExperts2D.forward:
        return f"{type(experts).__name__} overrides LinearExperts2D.forward"
    names = ("gate_proj", "up_proj", "down_proj") if experts.has_gate else ("up_proj", "down_proj")
    shapes = None
    for index in range(experts.num_experts):
        expert = experts[index]
        if type(expert).forward not in _STOCK_EXPERT_FORWARDS:
            return f"expert {index} is a {type(expert).__name__} with its own forward"
        linears = [getattr(expert, name) for name in names]
        if any(type(linear).forward is not nn.Linear.forward for linear in linears):
            return f"expert {index} has a projection that is not a plain Linear"
        expert_shapes = [
            (lin.weight.shape, lin.weight.dtype, lin.bias is not None) for lin in linears
        ]
        if shapes is not None and expert_shapes != shapes:
            return f"expert {index} differs in shape, dtype or bias from expert 0"
        shapes = expert_shapes
    return None


class GroupedExperts:
    """Stacked weights of one `LinearExperts2D` and its forward without a loop over experts.

    The stacks are detached copies: call `refresh()` after the experts' weights change
    (GPTQ writes quantized weights at the end of each layer, before propagation). For
    no-grad passes only (calibration, propagation); a forward that should train the
    experts' parameters raises (issue 4's AutoRound path needs differentiable stacks).

    :param experts: the linearised experts module (see `unsupported_reason`)
    :param device: where the stacks live (default: the first expert's weight device)
    :param backend: "auto", "grouped_mm" or "bmm" (grouped_ops.py)
    """

    KIND = "experts"  # for the error message

    @staticmethod
    def unsupported_reason(experts: nn.Module) -> str | None:
        """The support check; subclasses that accept other experts override it."""
        return unsupported_reason(experts)

    def __init__(
        self,
        experts: LinearExperts2D,
        device: torch.device | str | None = None,
        backend: Backend = "auto",
    ) -> None:
        reason = self.unsupported_reason(experts)
        if reason is not None:
            raise ValueError(f"cannot run these {self.KIND} grouped: {reason}")
        self.experts = experts
        self.num_experts: int = experts.num_experts
        self.has_gate: bool = experts.has_gate
        first = experts[0]
        self.device = torch.device(device) if device is not None else first.up_proj.weight.device
        self.dtype: torch.dtype = first.up_proj.weight.dtype
        # the exact elementwise function each stock expert applies after gate/up
        self.activation: Callable[[torch.Tensor], torch.Tensor] = (
            first._apply_gate if self.has_gate else first.act_fn
        )
        self.backend = resolve_backend(backend, self.device, self.dtype)
        self.refresh()

    @torch.no_grad()
    def refresh(self) -> None:
        """(Re)build the stacks: [E, in, out] views of [E, out, in] Linear weights."""
        experts = [self.experts[index] for index in range(self.num_experts)]

        def stack(tensors: list[torch.Tensor]) -> torch.Tensor:
            return torch.stack([t.to(self.device) for t in tensors])

        def first(expert: nn.Module, attr: str) -> torch.Tensor:
            # gate rows then up rows: the order of stock's torch.cat([gate, up])
            up = getattr(expert.up_proj, attr)
            return torch.cat([getattr(expert.gate_proj, attr), up]) if self.has_gate else up

        # [E, hidden, (2)I] and [E, I, hidden]
        self.gate_up_t = stack([first(e, "weight") for e in experts]).transpose(1, 2)
        self.down_t = stack([e.down_proj.weight for e in experts]).transpose(1, 2)
        self.gate_up_bias: torch.Tensor | None = None
        self.down_bias: torch.Tensor | None = None
        if experts[0].down_proj.bias is not None:
            self.gate_up_bias = stack([first(e, "bias") for e in experts])
            self.down_bias = stack([e.down_proj.bias for e in experts])
        self._trainable = any(p.requires_grad for e in experts for p in e.parameters())

    @property
    def hidden_size(self) -> int:
        return self.gate_up_t.shape[1]

    @property
    def intermediate_size(self) -> int:
        return self.down_t.shape[1]

    def forward(
        self,
        hidden_states: torch.Tensor,
        top_k_index: torch.Tensor,
        top_k_weights: torch.Tensor,
        *,
        all_experts: bool | None = None,
        hessians: GroupedExpertHessians | None = None,
    ) -> torch.Tensor:
        """Stock `LinearExperts2D.forward`'s result, grouped; optionally fill Hessians.

        :param hidden_states: [T, hidden], as the MoE block passes it
        :param top_k_index, top_k_weights: [T, K], the block router's output
        :param all_experts: llm-compressor's `moe_calibrate_all_experts` mode (every
            expert runs on every token, only routed outputs are kept); default: the
            global flag `oneshot` sets, read as stock reads it
        :param hessians: when given, receives exactly what stock's GPTQ hooks on the
            experts' Linears would accumulate for this call
        """
        if hidden_states.dim() != 2:
            shape = tuple(hidden_states.shape)
            raise ValueError(f"expected hidden_states [tokens, hidden], got {shape}")
        if self._trainable and torch.is_grad_enabled():
            raise RuntimeError(
                "GroupedExperts runs no-grad passes only (its stacks are detached copies); "
                "wrap the call in torch.no_grad() or use the stock experts"
            )
        if all_experts is None:
            all_experts = get_calibrate_all_experts_flag()
        routing = route(top_k_index, self.num_experts)
        x = hidden_states.index_select(0, routing.token)

        if all_experts:
            # stock: expert(hidden_states)[token_indices]; the intermediate over all
            # tokens is what every down_proj hook sees
            gate_up_all = torch.matmul(hidden_states, self.gate_up_t)  # [E, T, (2)I]
            if self.gate_up_bias is not None:
                gate_up_all = gate_up_all + self.gate_up_bias[:, None]
            num_tokens = hidden_states.shape[0]
            h_all = self.activation(gate_up_all.reshape(self.num_experts * num_tokens, -1))
            h_all = h_all.view(self.num_experts, num_tokens, -1)
            h = h_all[routing.expert, routing.token]
        else:
            gate_up = segment_matmul(x, self.gate_up_t, routing, self.backend)
            if self.gate_up_bias is not None:
                gate_up = gate_up + self.gate_up_bias[routing.expert]
            h = self.activation(gate_up)

        y = segment_matmul(h, self.down_t, routing, self.backend)
        if self.down_bias is not None:
            y = y + self.down_bias[routing.expert]

        if hessians is not None:
            if all_experts:
                hessians.accumulate_all_experts(hidden_states, h_all)
            else:
                hessians.accumulate_routed(x, h, routing)

        # stock: expert_output * top_k_weights[token, slot, None], then index_add_
        weighted = y * top_k_weights[routing.token, routing.slot, None]
        final = torch.zeros_like(hidden_states)
        final.index_add_(0, routing.token, weighted.to(final.dtype))
        return final

    __call__ = forward


@contextlib.contextmanager
def grouped_forward(
    experts: LinearExperts2D,
    grouped: GroupedExperts,
    hessians: GroupedExpertHessians | None = None,
    should_accumulate: Callable[[], bool] | None = None,
) -> Iterator[None]:
    """Route calls of `experts` to `grouped` for the duration of the block.

    Patches the instance's `forward` (restoring whatever was there, e.g.
    compressed-tensors' offloading wrapper, on exit). Hessians are filled only while
    `should_accumulate()` is true; a GPTQ modifier passes
    `lambda: not HooksMixin._HOOKS_DISABLED` so the propagation pass adds nothing,
    as stock's disabled hooks add nothing.
    """
    missing = object()
    previous = experts.__dict__.get("forward", missing)

    def forward(
        hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        # as compressed-tensors' offloading wrapper (replaced here) does: inputs to
        # the device the module runs on
        device = grouped.device
        accumulate = hessians is not None and (should_accumulate is None or should_accumulate())
        return grouped.forward(
            hidden_states.to(device),
            top_k_index.to(device),
            top_k_weights.to(device),
            hessians=hessians if accumulate else None,
        )

    experts.forward = forward
    try:
        yield
    finally:
        if previous is missing:
            del experts.forward
        else:
            experts.forward = previous
