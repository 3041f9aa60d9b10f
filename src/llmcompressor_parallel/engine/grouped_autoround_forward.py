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
- in llm-compressor's all-experts mode with gradients (`all_tokens=True`), stock runs
  every expert on every token and keeps the routed rows. Here the forward and the
  input gradients run on those routed rows only (row for row what the all-token
  matmuls compute: the same row, the same weight, the same reduction), while each
  stack's weight gradient is stock's all-token reduction: the routed rows' output
  gradients among zeros in [E, tokens, .] (stock's are exactly zero in the other
  rows, so those terms add nothing), in the batched matmul autograd runs for
  `bmm(input, weight)` (gathered_weight.py, also for data-parallel parts).
  `all_tokens=False` sums the weight gradients over the routed rows only (same math,
  another floating-point order, top_k/E of the weight-gradient FLOPs).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from llmcompressor_parallel.engine.gathered_weight import GatheredWeight, RoutedRows
from llmcompressor_parallel.engine.grouped_ops import Routing, route, segment_matmul

__all__ = ["ExpertStacks", "StackRecorder", "experts_forward", "rank_positions", "stack_recorders"]

Activation = Callable[[torch.Tensor], torch.Tensor]


@dataclass
class StackRecorder:
    """One part's hand-over of its routed matmul rows to the call's `GatheredWeight`s:
    per stack (the first projections, then down), one per expert range whose gradient
    is computed apart (empty: the stack takes no gradient)."""

    gathers: list[list[GatheredWeight]]
    part: int

    def record(self, index: int, input: torch.Tensor, output: torch.Tensor,
               place: RoutedRows) -> torch.Tensor:
        """Keep stack `index`'s input, tap its output's gradient; returns the output to use."""
        for gather in self.gathers[index]:
            output = gather.record(self.part, input, output, place)
        return output


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
        recorder: StackRecorder | None = None,
    ) -> None:
        self.first = list(first)
        self.down_t = down_t
        self.first_bias = None if first_bias is None else list(first_bias)
        self.down_bias = down_bias
        self.recorder = recorder


def stack_recorders(
    ranges: Sequence[ExpertStacks], devices: list[torch.device], name: str,
    first_experts: Sequence[int | None] = (None,),
) -> list[StackRecorder]:
    """Each part's recorder (the parts, on `devices` in batch order, run detached copies):
    per stack that takes a gradient, one `GatheredWeight` per entry of `ranges`, the
    stacks of experts from `first_experts[i]` on (None: `ranges` is the whole stack)."""
    first = ranges[0]
    names = ["gate", "up"] if len(first.first) == 2 else ["up"]
    layouts = ["experts_shared"] * len(names) + ["experts"]
    gathers: list[list[GatheredWeight]] = [[] for _ in layouts]
    for stacks, first_expert in zip(ranges, first_experts):
        label = "" if first_expert is None else f" from expert {first_expert}"
        weights = [*stacks.first, stacks.down_t]
        for index, (w_t, stack, layout) in enumerate(zip(weights, [*names, "down"], layouts)):
            if w_t.requires_grad:
                gathers[index].append(
                    GatheredWeight(w_t, devices, f"{name} {stack} stack{label}", layout, first_expert)
                )
    return [StackRecorder(gathers, part) for part in range(len(devices))]


def rank_positions(routing: Routing, top_k_index: torch.Tensor) -> torch.Tensor:
    """[K, T]: row j holds each token's pair (a row of `routing`'s order) with its
    j-th smallest expert. Static shapes: no host sync."""
    tokens = top_k_index.shape[0]
    position = torch.empty_like(routing.token)
    pair_id = routing.slot * tokens + routing.token
    position[pair_id] = torch.arange(pair_id.numel(), device=pair_id.device)
    slots = top_k_index.argsort(dim=1, stable=True).t()  # [K, T], ascending expert
    return position[slots * tokens + torch.arange(tokens, device=slots.device)]


class _PairInputs(torch.autograd.Function):
    """The routed pairs' rows of `shared` (`hidden`, or its cast to the dtype stock's
    Linears compute in), one view per projection that differentiates it apart.

    Backward adds each token's per-pair, per-projection gradients in `hidden`'s dtype
    one at a time, in stock's autograd order: experts descending, within an expert the
    last projection first. Stock also adds its unrouted experts' gradients, which are
    exact zeros (their output gradients are), so leaving them out changes no bit.
    """

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, shared: torch.Tensor, token: torch.Tensor,
                ranks: torch.Tensor, count: int):
        ctx.save_for_backward(ranks)
        ctx.dtype = hidden.dtype
        ctx.set_materialize_grads(False)
        rows = shared.index_select(0, token)
        return tuple(rows.view_as(rows) for _ in range(count))

    @staticmethod
    def backward(ctx, *grads: torch.Tensor | None):
        present = [g for g in grads if g is not None]
        if not present:
            return None, None, None, None, None
        (ranks,) = ctx.saved_tensors
        total = present[0].new_zeros(ranks.shape[1], present[0].shape[1], dtype=ctx.dtype)
        for rank in reversed(range(ranks.shape[0])):
            for grad in reversed(grads):
                if grad is not None:  # in ctx.dtype: the same sum as casting first
                    total += grad[ranks[rank]]
        return total, None, None, None, None


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
    (x,) = _PairInputs.apply(hidden, hidden.detach(), routing.token, ranks, 1)
    projected = [segment_matmul(x, w_t, routing, backend) for w_t in stacks.first]
    if stacks.first_bias is not None:
        projected = [p + b[routing.expert] for p, b in zip(projected, stacks.first_bias)]
    h = activation(torch.cat(projected, dim=-1))
    y = segment_matmul(h, stacks.down_t, routing, backend)
    return y if stacks.down_bias is None else y + stacks.down_bias[routing.expert]


def _all_tokens(
    hidden: torch.Tensor,
    routing: Routing,
    ranks: torch.Tensor,
    stacks: ExpertStacks,
    activation: Activation,
    backend: str,
) -> torch.Tensor:
    """Stock's all-experts mode on the routed rows: [N, H] in `routing`'s order.

    The matmuls run on detached stacks, so autograd computes only their input
    gradients; every stack's weight gradient is computed in stock's all-token layout
    by the recorder's `GatheredWeight` (the stacks' own where the call has none).
    """
    recorder = stacks.recorder
    if recorder is None:
        recorder = stack_recorders([stacks], [hidden.device], "experts")[0]
    shared = hidden.detach().to(_compute_dtype(hidden))
    count = len(stacks.first)
    inputs = _PairInputs.apply(hidden, shared, routing.token, ranks, count)
    place = RoutedRows(routing.expert, routing.token, hidden.shape[0])
    projected = [
        recorder.record(index, shared, segment_matmul(x, w_t.detach(), routing, backend), place)
        for index, (x, w_t) in enumerate(zip(inputs, stacks.first))
    ]
    if stacks.first_bias is not None:
        projected = [p + b[routing.expert] for p, b in zip(projected, stacks.first_bias)]
    h = activation(torch.cat(projected, dim=-1))
    y = segment_matmul(h, stacks.down_t.detach(), routing, backend)
    y = recorder.record(count, h, y, place)
    return y if stacks.down_bias is None else y + stacks.down_bias[routing.expert]


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
    :param all_tokens: in that mode, when gradients are needed, reduce the weight
        gradients over every token as stock does; otherwise over routed tokens only
    """
    routing = route(top_k_index, stacks.down_t.shape[0])
    ranks = rank_positions(routing, top_k_index)
    if all_experts and all_tokens and torch.is_grad_enabled():
        y = _all_tokens(hidden_states, routing, ranks, stacks, activation, backend)
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
