"""A weight's gradient computed once over the whole batch, from every part's rows.

Split over replicas, each part's gradient of a weight used in a matmul is a sum over
its own rows, and adding the partials sums the same terms in another order than the
one matmul over the whole batch that the serial backward runs. SignSGD turns such
last-bit differences into different rounding decisions within a few iterations
(bench/demo_int_agreement.py). A `GatheredWeight` instead:
- gives the weight's home an empty token that every part's output depends on, so
  that its backward runs once all parts' gradients have arrived;
- has each part (running the matmul on a detached copy of the weight, so autograd
  computes only its input gradient, row for row the serial one) record its input and
  tap its output gradient;
- computes the weight gradient on the home from the rows gathered in batch order with
  the very matmul the serial backward runs (autocast off: the rows already have the
  dtype the forward computed in), and returns it in the weight's dtype.

Stacked expert weights (llm-compressor's all-experts mode) are used on the routed rows
only, but stock's backward reduces each expert's weight gradient over every token of
the batch. Parts therefore hand over their routed rows with where they sit
(`RoutedRows`), and the home rebuilds stock's all-token layout [experts, tokens, .]
with zeros in the other rows (stock's output gradients are exactly zero there, so
their terms add nothing) before the same batched matmul.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch

__all__ = ["GatheredWeight", "Layout", "RoutedRows"]

# "linear": input [..., in] -> output [..., out] = input @ weight^T (weight [out, in]);
# stacked expert weights [E, in, out], used on routed rows: "experts": input [N, in] and
# output [N, out] routed rows, the gradient that of stock's all-token
# `input.bmm(weight)` over [E, tokens, .]; "experts_shared": the same with the input one
# [tokens, in] tensor that every expert sees (expanded to E, as stock's input is)
Layout = Literal["linear", "experts", "experts_shared"]


@dataclass(frozen=True)
class RoutedRows:
    """Where a part's routed rows sit in stock's all-token layout [E, tokens, .]:
    row i is expert `expert[i]` on the part's token `token[i]`; `tokens` of the part."""

    expert: torch.Tensor
    token: torch.Tensor
    tokens: int

    def to(self, device: torch.device) -> "RoutedRows":
        return RoutedRows(self.expert.to(device), self.token.to(device), self.tokens)


class _Rows:
    """One call's inputs and output gradients of one weight, one entry per part."""

    def __init__(self, devices: list[torch.device]) -> None:
        self.devices = devices
        self.inputs: list[torch.Tensor | None] = [None] * len(devices)
        self.grads: list[torch.Tensor | None] = [None] * len(devices)
        self.places: list[RoutedRows | None] = [None] * len(devices)


def _all_token_layout(rows: list[torch.Tensor], places: list[RoutedRows],
                      experts: int, first: int | None) -> torch.Tensor:
    """The parts' routed rows among zeros in [experts, batch tokens, .], parts in batch
    order. `first`: the layout holds experts [first, first + experts) of a larger stack
    (rows of other experts are written to a spare slot, dropped); None: all experts."""
    spare = 0 if first is None else 1
    out = rows[0].new_zeros(experts + spare, sum(p.tokens for p in places), rows[0].shape[-1])
    offset = 0
    for part_rows, place in zip(rows, places):
        index = place.expert
        if first is not None:
            index = index - first
            index = torch.where((index >= 0) & (index < experts), index, experts)
        out[index, place.token + offset] = part_rows
        offset += place.tokens
    return out[:experts] if spare else out


def _weight_gradient(layout: Layout, inputs: list[torch.Tensor], grads: list[torch.Tensor],
                     places: list[RoutedRows], experts: int, first: int | None) -> torch.Tensor:
    """The serial backward's weight gradient over the concatenated rows (for the experts
    [first, first + experts) in the "experts" layouts; first=None: all of them)."""
    if layout == "linear":  # Linear's backward: grad_output^T @ input over all tokens
        x = torch.cat(inputs).flatten(0, -2)
        return torch.cat(grads).flatten(0, -2).t().mm(x)
    dy = _all_token_layout(grads, places, experts, first)
    if layout == "experts_shared":
        x = torch.cat(inputs).unsqueeze(0).expand(experts, -1, -1)
    else:
        x = _all_token_layout(inputs, places, experts, first)
    return x.transpose(1, 2).bmm(dy)  # bmm's backward for its second operand


class _WeightGrad(torch.autograd.Function):
    """Forward: an empty token on the weight's device. Backward: the weight gradient
    from every part's rows (raises, naming the devices, if a part never reported)."""

    @staticmethod
    def forward(ctx: Any, weight: torch.Tensor, rows: _Rows, name: str, layout: Layout,
                first: int | None):
        ctx.set_materialize_grads(False)
        ctx.rows, ctx.name, ctx.layout, ctx.first = rows, name, layout, first
        ctx.dtype, ctx.home = weight.dtype, weight.device
        ctx.experts = weight.shape[0]
        return weight.new_empty(0)

    @staticmethod
    def backward(ctx: Any, _unused: torch.Tensor | None) -> tuple:
        rows, ctx.rows = ctx.rows, None
        missing = [str(rows.devices[p]) for p, grad in enumerate(rows.grads) if grad is None]
        if missing:
            raise RuntimeError(
                f"{ctx.name}: no output gradient from the part(s) on {', '.join(missing)}; "
                "every part's output must reach the loss"
            )
        inputs = [x.to(ctx.home) for x in rows.inputs]
        grads = [g.to(ctx.home) for g in rows.grads]
        places = [None if p is None else p.to(ctx.home) for p in rows.places]
        with torch.autocast(ctx.home.type, enabled=False):
            gradient = _weight_gradient(ctx.layout, inputs, grads, places, ctx.experts, ctx.first)
        return gradient.to(ctx.dtype), None, None, None, None


class _Tap(torch.autograd.Function):
    """Identity on a part's output; backward keeps its gradient for `_WeightGrad`."""

    @staticmethod
    def forward(ctx: Any, output: torch.Tensor, token: torch.Tensor, rows: _Rows, part: int):
        ctx.rows, ctx.part = rows, part
        return output.view_as(output)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        ctx.rows.grads[ctx.part] = grad
        return grad, None, None, None


class GatheredWeight:
    """One call's gathered gradient of `weight` (on its home device, with grad).

    :param weight: the tensor whose gradient is gathered, as the serial matmul uses it
    :param devices: the parts' devices, in batch order
    :param name: how the weight is called in errors
    :param layout: how the parts use it (see `Layout`)
    :param first_expert: in the "experts" layouts, `weight` holds the stack's experts
        [first_expert, first_expert + len(weight)) only (the expert-split fan-out:
        each device computes its range's gradient from every part's rows); None: all
    """

    def __init__(self, weight: torch.Tensor, devices: list[torch.device], name: str,
                 layout: Layout = "linear", first_expert: int | None = None) -> None:
        if first_expert is not None and layout == "linear":
            raise ValueError("first_expert applies to the experts layouts only")
        self.rows = _Rows(devices)
        self.token = _WeightGrad.apply(weight, self.rows, name, layout, first_expert)

    def record(self, part: int, input: torch.Tensor, output: torch.Tensor,
               place: RoutedRows | None = None) -> torch.Tensor:
        """Part `part` computed `output` from `input` (in the dtype the matmul ran in)
        and a detached copy of the weight: keep the input, tap the output's gradient.
        `place`: where the rows sit in the "experts" layouts."""
        self.rows.inputs[part] = input.detach()
        self.rows.places[part] = place
        return _Tap.apply(output, self.token, self.rows, part)
