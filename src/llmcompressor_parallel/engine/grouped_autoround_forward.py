"""Grouped expert matmuls that add up outputs and gradients in stock's order.

AutoRound's SignSGD keeps only the sign of each gradient element, so a last-bit
difference in a near-zero gradient becomes a different rounding decision and then
a different run. Wherever a grouped execution would sum in another order than
llm-compressor's per-expert loop (forward, and its backward under autograd), the
code here follows stock's order (bit-identical on CPU, measured; GPU matmul kernels
differ between batched and single calls anyway):

- gate and up are two matmuls: a fused one rounds their summed input gradient once
  in bf16 where stock rounds each and adds them;
- a token's expert outputs are added one expert at a time, ascending, as stock's
  per-expert `index_add_` calls do (a single `index_add_` over all pairs would
  accumulate duplicates in fp32 and round once);
- the gradient reaching the MoE block's input adds the experts' contributions one at
  a time in descending expert order (autograd runs later-created nodes first), in
  the input's dtype;
- in llm-compressor's all-experts mode, every expert runs on every token as in stock
  (weight gradients reduce over the same rows) when gradients are needed;
  `all_tokens=False` runs routed tokens only (same math, top_k/E of the FLOPs).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import torch

from llmcompressor_parallel.engine.grouped_ops import Routing, route, segment_matmul

__all__ = ["ExpertStacks", "PartRecorder", "experts_forward", "rank_positions"]

Activation = Callable[[torch.Tensor], torch.Tensor]


class PartRecorder(Protocol):
    """A fanned-out part's hand-over of its matmuls' rows (exact gradients): `index`
    counts the first projections, then down; returns the output to use."""

    def record(self, index: int, input: torch.Tensor, output: torch.Tensor) -> torch.Tensor: ...


class ExpertStacks:
    """The per-call expert weights: [E, H, I] (gate, up) or (up,), [E, I, H] down.

    `recorder`: set where the weights are detached copies whose gradients the home
    computes from every part's rows (all-tokens mode only).
    """

    def __init__(
        self,
        first: Sequence[torch.Tensor],
        down_t: torch.Tensor,
        first_bias: Sequence[torch.Tensor] | None = None,
        down_bias: torch.Tensor | None = None,
        recorder: PartRecorder | None = None,
    ) -> None:
        self.first = list(first)
        self.down_t = down_t
        self.first_bias = None if first_bias is None else list(first_bias)
        self.down_bias = down_bias
        self.recorder = recorder


def rank_positions(routing: Routing, top_k_index: torch.Tensor) -> torch.Tensor:
    """[K, T]: row j holds each token's pair (a row of `routing`'s order) with its
    j-th smallest expert. Static shapes: no host sync."""
    tokens = top_k_index.shape[0]
    position = torch.empty_like(routing.token)
    pair_id = routing.slot * tokens + routing.token
    position[pair_id] = torch.arange(pair_id.numel(), device=pair_id.device)
    slots = top_k_index.argsort(dim=1, stable=True).t()  # [K, T], ascending expert
    return position[slots * tokens + torch.arange(tokens, device=slots.device)]


class _GatherPairs(torch.autograd.Function):
    """`hidden[token]` for the routed pairs; backward adds each token's pair gradients
    one at a time, descending expert, in `hidden`'s dtype, as stock's autograd does."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, token: torch.Tensor, ranks: torch.Tensor):
        ctx.save_for_backward(ranks)
        return hidden.index_select(0, token)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (ranks,) = ctx.saved_tensors
        total = grad.new_zeros(ranks.shape[1], grad.shape[1])
        for rank in reversed(range(ranks.shape[0])):
            total += grad[ranks[rank]]
        return total, None, None


class _PerExpertInput(torch.autograd.Function):
    """`hidden` as every expert's projections see it (`count` views [E, T, H]).

    Forward casts once to the dtype stock's Linears compute in (the autocast dtype)
    and expands without copying. Backward adds the per-expert, per-projection
    gradients in `hidden`'s dtype one at a time, in stock's autograd order: experts
    descending, within an expert the last projection first.
    """

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, experts: int, count: int, dtype: torch.dtype):
        ctx.dtype = hidden.dtype
        ctx.set_materialize_grads(False)
        shared = hidden.to(dtype)
        return tuple(shared.unsqueeze(0).expand(experts, *hidden.shape) for _ in range(count))

    @staticmethod
    def backward(ctx, *grads: torch.Tensor | None):
        present = [g for g in grads if g is not None]
        if not present:
            return None, None, None, None
        total = None
        for expert in reversed(range(present[0].shape[0])):
            for grad in reversed(grads):
                if grad is None:
                    continue
                if total is None:
                    total = grad[expert].to(ctx.dtype, copy=True)
                else:  # in ctx.dtype: the same sum as casting first, without the copy
                    total.add_(grad[expert])
        return total, None, None, None


def _compute_dtype(hidden: torch.Tensor) -> torch.dtype:
    """The dtype stock's Linears see their input in: autocast's, else the input's."""
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return hidden.dtype


def _routed(
    hidden: torch.Tensor,
    routing: Routing,
    ranks: torch.Tensor,
    stacks: ExpertStacks,
    activation: Activation,
    backend: str,
) -> torch.Tensor:
    """Each routed pair through its expert: [N, H] rows in `routing`'s order."""
    x = _GatherPairs.apply(hidden, routing.token, ranks)
    projected = [segment_matmul(x, w_t, routing, backend) for w_t in stacks.first]
    if stacks.first_bias is not None:
        projected = [p + b[routing.expert] for p, b in zip(projected, stacks.first_bias)]
    h = activation(torch.cat(projected, dim=-1))
    y = segment_matmul(h, stacks.down_t, routing, backend)
    return y if stacks.down_bias is None else y + stacks.down_bias[routing.expert]


def _all_tokens(
    hidden: torch.Tensor, routing: Routing, stacks: ExpertStacks, activation: Activation
) -> torch.Tensor:
    """Stock's all-experts mode: every expert on every token, the routed rows kept."""
    experts, tokens = stacks.down_t.shape[0], hidden.shape[0]
    count = len(stacks.first)
    inputs = _PerExpertInput.apply(hidden, experts, count, _compute_dtype(hidden))
    projected = [torch.bmm(x, w_t) for x, w_t in zip(inputs, stacks.first)]  # [E, T, I]
    recorder = stacks.recorder
    if recorder is not None:  # every expert's input is the one cast hidden [T, H]
        projected = [recorder.record(i, inputs[0][0], p) for i, p in enumerate(projected)]
    if stacks.first_bias is not None:
        projected = [p + b[:, None] for p, b in zip(projected, stacks.first_bias)]
    h = activation(torch.cat(projected, dim=-1).reshape(experts * tokens, -1))
    h = h.view(experts, tokens, -1)
    y = torch.bmm(h, stacks.down_t)
    if recorder is not None:
        y = recorder.record(count, h, y)
    if stacks.down_bias is not None:
        y = y + stacks.down_bias[:, None]
    return y[routing.expert, routing.token]


def experts_forward(
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    stacks: ExpertStacks,
    activation: Activation,
    backend: str,
    all_experts: bool,
    all_tokens: bool = True,
) -> torch.Tensor:
    """`LinearExperts2D.forward`'s result over `stacks`, summed in stock's order.

    :param hidden_states, top_k_index, top_k_weights: as the MoE block passes them
    :param activation: stock's function of cat([gate, up]) (or of up alone)
    :param backend: grouped_ops' segment-matmul kernel
    :param all_experts: llm-compressor's all-experts calibration mode
    :param all_tokens: in that mode, run every expert on every token when gradients
        are needed (stock's reduction order); otherwise routed tokens only
    """
    routing = route(top_k_index, stacks.down_t.shape[0])
    ranks = rank_positions(routing, top_k_index)
    if all_experts and all_tokens and torch.is_grad_enabled():
        y = _all_tokens(hidden_states, routing, stacks, activation)
    elif stacks.recorder is not None:
        raise RuntimeError(
            "the stacks' gradients are to be gathered, which only the all-tokens mode "
            "(with gradients) records"
        )
    else:  # the routed rows of stock's all-token matmuls are these rows
        y = _routed(hidden_states, routing, ranks, stacks, activation, backend)
    # stock: expert_output * top_k_weights[token, slot, None], index_add_ per expert
    weighted = (y * top_k_weights[routing.token, routing.slot, None]).to(hidden_states.dtype)
    final = torch.zeros_like(hidden_states)
    for rank in range(ranks.shape[0]):
        final = final + weighted[ranks[rank]]
    return final
