"""GPTQ Hessians of all experts of a `LinearExperts2D`, accumulated in batched kernels.

Stock semantics (llmcompressor 0.14, `GPTQModifier.calibrate_module` ->
`gptq.helpers.accumulate_hessian`), per Linear and per forward call:
    H += (sqrt(2) * x.float()).T @ (sqrt(2) * x.float());  num_samples += 1
where x is the module's 2D input [tokens, in] (a 2D input counts as ONE sample,
whatever its token count), H is fp32 (GPTQ_PRECISION) on the execution device, and
the update step later divides H by num_samples (`prepare_batch`). Stock's expert
loop calls every expert's Linears on every forward, an expert routed no token
included (input [0, in]: H unchanged, num_samples += 1), so all the expert Linears
of a block share one sample count.

Shared Hessians: gate_proj and up_proj of an expert see the same input, so they get
one Hessian; in all-experts mode every expert's gate/up sees all tokens, so one
Hessian serves all 2E of them (exactly what stock computes 2E times).
"""

from __future__ import annotations

import math
from collections.abc import Container

import torch
from torch import nn

from llmcompressor.modifiers.gptq.helpers import GPTQ_PRECISION
from llmcompressor_parallel.engine.grouped_experts import GroupedExperts
from llmcompressor_parallel.engine.grouped_ops import (
    Backend,
    Routing,
    resolve_backend,
    segment_gram,
)

__all__ = ["GroupedExpertHessians"]


def _scaled(x: torch.Tensor) -> torch.Tensor:
    """Stock's `math.sqrt(2) * inp.to(dtype=GPTQ_PRECISION)`."""
    return math.sqrt(2) * x.to(dtype=GPTQ_PRECISION)


class GroupedExpertHessians:
    """Per-expert GPTQ Hessians of one grouped experts module.

    `gate_up` is [E, in, in], or [1, in, in] while every call so far was all-experts
    (then shared by all experts); `down` is [E, I, I]; `num_samples` counts calls.
    Stored on `device` (default: the stacks' device, i.e. the execution device,
    where stock keeps them), fp32.
    """

    def __init__(
        self,
        grouped: GroupedExperts,
        device: torch.device | str | None = None,
        backend: Backend = "auto",
    ) -> None:
        self.grouped = grouped
        self.device = torch.device(device) if device is not None else grouped.device
        self.backend = resolve_backend(backend, self.device, GPTQ_PRECISION)
        self.gate_up: torch.Tensor | None = None
        self.down: torch.Tensor | None = None
        self.num_samples = 0

    def _allocate(self, shared_gate_up: bool) -> None:
        if self.down is not None:
            return
        grouped, kwargs = self.grouped, dict(device=self.device, dtype=GPTQ_PRECISION)
        hidden, inter = grouped.hidden_size, grouped.intermediate_size
        num = 1 if shared_gate_up else grouped.num_experts
        self.gate_up = torch.zeros(num, hidden, hidden, **kwargs)
        self.down = torch.zeros(grouped.num_experts, inter, inter, **kwargs)

    @torch.no_grad()
    def accumulate_routed(self, x: torch.Tensor, h: torch.Tensor, routing: Routing) -> None:
        """One routed call: x [N, in] and h [N, I] are the experts' inputs, sorted by expert."""
        self._allocate(shared_gate_up=False)
        if self.gate_up.shape[0] != routing.num_experts:  # earlier calls were all-experts
            self.gate_up = self.gate_up.expand(routing.num_experts, -1, -1).clone()
        segment_gram(_scaled(x.to(self.device)), routing, self.backend, self.gate_up)
        segment_gram(_scaled(h.to(self.device)), routing, self.backend, self.down)
        self.num_samples += 1

    @torch.no_grad()
    def accumulate_all_experts(self, hidden_states: torch.Tensor, h_all: torch.Tensor) -> None:
        """One all-experts call: hidden_states [T, in] feeds every gate/up, h_all [E, T, I]
        every down."""
        self._allocate(shared_gate_up=True)
        inp = _scaled(hidden_states.to(self.device)).t()  # stock's layout: [in, T]
        self.gate_up += inp.matmul(inp.t())  # broadcasts over [1 or E, in, in]
        h = _scaled(h_all.to(self.device))
        self.down.baddbmm_(h.transpose(1, 2), h)
        self.num_samples += 1

    @torch.no_grad()
    def merge_(self, other: GroupedExpertHessians) -> GroupedExpertHessians:
        """Add another accumulator's sums and counts (a replica's partial) to this one.

        Exact for partials of whole calls (each replica ran whole calibration batches):
        stock counts one sample per call, so counts add. A batch split over replicas
        would count once per piece: do not merge those with this.
        """
        if other.down is None:
            return self
        if self.down is None:
            self.gate_up = other.gate_up.to(self.device, copy=True)
            self.down = other.down.to(self.device, copy=True)
        else:
            self.gate_up = self.gate_up + other.gate_up.to(self.device)  # [1] + [E] -> [E]
            self.down += other.down.to(self.device)
        self.num_samples += other.num_samples
        return self

    def export(
        self,
        hessians: dict[nn.Module, torch.Tensor],
        num_samples: dict[nn.Module, torch.Tensor],
        modules: Container[nn.Module] | None = None,
        share: bool = True,
    ) -> list[nn.Module]:
        """Move the statistics into GPTQModifier's `_hessians` / `_num_samples` dicts.

        Call once per layer, after its last calibration batch: the accumulator is
        emptied (as stock's `prepare_batch` consumes its dicts). A module already in
        the dicts (stock hooks ran for some batches) keeps its place and gets the sums
        added, out of place. New modules are appended per expert as gate_proj, up_proj,
        down_proj: the order stock's hooks first fire in, which `assign_batches` follows.

        `modules` restricts to the Linears stock would hook (the modifier's targets
        minus ignore). With `share` (default), gate/up entries are views of one tensor:
        the dict entries must then be read-only (stock's `prepare_batch` only reads);
        `share=False` gives each module its own copy, needed before anything adds into
        entries in place (e.g. DDP's `_reduce_hessian_to_target_rank`, or merging more
        partials later). Returns the modules written.
        """
        if self.down is None:
            return []
        written = []
        for index in range(self.grouped.num_experts):
            expert = self.grouped.experts[index]
            gate_up = self.gate_up[index if self.gate_up.shape[0] > 1 else 0]
            pairs = [("up_proj", gate_up), ("down_proj", self.down[index])]
            if self.grouped.has_gate:
                pairs.insert(0, ("gate_proj", gate_up))
            for name, hessian in pairs:
                linear = getattr(expert, name)
                if modules is not None and linear not in modules:
                    continue
                count = torch.full(
                    (), self.num_samples, dtype=torch.get_default_dtype(), device=self.device
                )
                if linear in hessians:
                    device = hessians[linear].device
                    hessians[linear] = hessians[linear] + hessian.to(device)
                    num_samples[linear] = num_samples[linear] + count.to(device)
                else:
                    hessians[linear] = hessian if share else hessian.clone()
                    num_samples[linear] = count
                written.append(linear)
        self.gate_up, self.down, self.num_samples = None, None, 0
        return written
