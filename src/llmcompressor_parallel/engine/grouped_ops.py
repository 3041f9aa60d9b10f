"""Routing and segment kernels for experts that run grouped (no Python loop over experts).

The routed (token, top-k slot) pairs are sorted by expert once per call; every expert's
tokens then form one contiguous segment, and each projection of all experts is one
grouped matmul over those segments. Two kernels, same math:

- "grouped_mm": `torch._grouped_mm` with segment offsets (no padding). On sm90/sm100
  GPUs in bf16 it is one CUTLASS grouped GEMM; elsewhere a C++ loop of plain matmuls
  (on CPU the very ones stock runs, bit-identical to stock in the tests, but 2-4x
  slower than bmm there, measured). Needs 16-byte aligned rows; unaligned inputs use bmm.
- "bmm": segments zero-padded to the longest one, one `torch.bmm` (any device/dtype;
  padding rows are zeros, so they add exactly nothing to a Hessian). Costs
  E * longest segment rows instead of N, so it pays for routing imbalance.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Literal

import torch

__all__ = [
    "Backend",
    "Routing",
    "resolve_backend",
    "route",
    "segment_gram",
    "segment_matmul",
]

Backend = Literal["auto", "grouped_mm", "bmm"]
_HAS_GROUPED_MM = hasattr(torch, "_grouped_mm")


@dataclass(frozen=True)
class Routing:
    """Routed pairs sorted by expert, in the order stock's per-expert loop visits them.

    Stock visits expert e's pairs as `torch.where(one_hot(idx).permute(2, 1, 0)[e])`:
    slot-major, then token. Sorting pair ids `slot * T + token` stably by expert
    reproduces that order, so each segment holds exactly stock's rows, in stock's order.
    """

    token: torch.Tensor  # [N] token of each pair
    slot: torch.Tensor  # [N] top-k slot of each pair
    expert: torch.Tensor  # [N] expert of each pair (non-decreasing)
    counts: torch.Tensor  # [E] pairs per expert
    ends: torch.Tensor  # [E] int32 cumulative segment ends (grouped_mm offsets)
    num_experts: int

    @cached_property
    def position(self) -> torch.Tensor:
        """Row of each pair inside its expert's segment (for the padded layout)."""
        starts = self.ends.long() - self.counts
        return torch.arange(self.token.numel(), device=self.token.device) - starts[self.expert]

    @cached_property
    def longest(self) -> int:
        """Rows of the longest segment (one host sync, only the padded layout needs it)."""
        return int(self.counts.max()) if self.token.numel() else 0

    def padded(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, in] sorted by expert -> [E, longest, in], zero rows after each segment."""
        out = x.new_zeros(self.num_experts, self.longest, x.shape[1])
        out[self.expert, self.position] = x
        return out


def route(top_k_index: torch.Tensor, num_experts: int) -> Routing:
    """Sort the routed (token, slot) pairs of `top_k_index` [T, K] by expert."""
    num_tokens = top_k_index.shape[0]
    flat = top_k_index.t().reshape(-1)  # pair id = slot * T + token
    order = torch.argsort(flat, stable=True)
    # not bincount: on CUDA it reads the indices' min and max back to the host, a sync
    # in every MoE forward; the same integer counts without it
    counts = torch.zeros(num_experts, dtype=torch.long, device=flat.device)
    counts.scatter_add_(0, flat.long(), torch.ones_like(flat, dtype=torch.long))
    return Routing(
        token=order % num_tokens,
        slot=order // num_tokens,
        expert=flat[order],
        counts=counts,
        ends=counts.cumsum(0).to(torch.int32),
        num_experts=num_experts,
    )


def resolve_backend(backend: Backend, device: torch.device, dtype: torch.dtype) -> str:
    """Pick the kernel: grouped_mm where it is one grouped GEMM, else bmm.

    `_grouped_mm` is one kernel only for bf16 on CUDA sm90/sm100; elsewhere (fp32
    Hessians, older GPUs, CPU) it loops over groups (on CUDA after a host sync), so
    "auto" takes bmm there.
    """
    if backend not in ("auto", "grouped_mm", "bmm"):
        raise ValueError(f"backend={backend!r} is not valid; allowed: 'auto', 'grouped_mm', 'bmm'")
    if backend == "grouped_mm" and not _HAS_GROUPED_MM:
        raise ValueError("backend='grouped_mm' needs torch._grouped_mm (torch >= 2.8)")
    if backend != "auto":
        return backend
    if (
        _HAS_GROUPED_MM
        and device.type == "cuda"
        and dtype == torch.bfloat16
        and torch.cuda.get_device_capability(device)[0] in (9, 10)
    ):
        return "grouped_mm"
    return "bmm"


def _aligned(*mats: torch.Tensor) -> bool:
    """`_grouped_mm`'s layout rule: 16-byte aligned data and leading stride."""
    for mat in mats:
        if mat.data_ptr() % 16 or mat.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            return False
        rows, cols = mat.stride()[-2:]
        lead = cols if rows == 1 else rows
        if 1 not in (rows, cols) or (lead * mat.element_size()) % 16:
            return False
    return True


def segment_matmul(
    x: torch.Tensor, weight_t: torch.Tensor, routing: Routing, backend: str
) -> torch.Tensor:
    """Per-segment `x_e @ weight_t[e]`: x [N, in] sorted by expert, weight_t [E, in, out]."""
    if backend == "grouped_mm" and _aligned(x, weight_t):
        return torch._grouped_mm(x, weight_t, offs=routing.ends)
    return torch.bmm(routing.padded(x), weight_t)[routing.expert, routing.position]


def segment_gram(
    x: torch.Tensor, routing: Routing, backend: str, into: torch.Tensor
) -> None:
    """`into[e] += x_e^T x_e` for every expert segment of x [N, in], in a batched kernel."""
    if backend == "grouped_mm" and _aligned(x, x.t()):
        into += torch._grouped_mm(x.t(), x, offs=routing.ends)
        return
    padded = routing.padded(x)
    into.baddbmm_(padded.transpose(1, 2), padded)
