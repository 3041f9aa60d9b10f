"""GPTQ's Hessians accumulated per replica and merged into stock's statistics.

What stock computes (llm-compressor 0.14.0.1): the forward hook
`GPTQModifier.calibrate_module` calls `accumulate_hessian`, which adds
`(sqrt(2) x)(sqrt(2) x)^T` in fp32 (GPTQ_PRECISION) to one running, *unnormalised*
sum per module and adds the call's sample count to a counter; `prepare_batch`
divides the sum by the count once, just before the update. (Older releases rescaled
H by n/(n+m) on every call; this one does not, so no rescaling is undone here.)

What a replica computes: the same `accumulate_hessian` call, on its own device, into
its own sum and counter. The pipeline gives replica k a contiguous run of the
batches (replica 0 the first ones), so:
- every per-call product is the one stock computes (same inputs, same kernel);
- each replica's sum is stock's running sum over that run of batches;
- the merge adds the replicas' sums in replica order onto the home device,
  ((S_0 + S_1) + S_2) + ..., where stock adds the products one by one. Only the
  grouping of the fp32 additions differs; with one batch per replica it is stock's
  grouping and the result is bit-identical;
- counts are small integers held in fp32: their sum is exact;
- modules enter the modifier's dicts in stock's order (first call in batch order),
  which fixes how stock's `assign_batches` groups them for the update.

Modules fed the very same input tensor (q/k/v of an attention, gate/up of an MLP)
share one product per call: stock computes `(sqrt(2) x)(sqrt(2) x)^T` once per module,
the same fp32 matmul on the same values, so computing it once and adding it to each
module's sum gives each module stock's bits (`linear_product` mirrors
`accumulate_hessian` for Linear inputs; a test holds them equal). At the Llama-3-8B
shape that is 4 fp32 products per batch instead of 7.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
from compressed_tensors.utils import get_execution_device
from llmcompressor.modifiers.gptq.helpers import (
    GPTQ_PRECISION,
    accumulate_hessian,
    make_empty_hessian,
)
from torch import nn

__all__ = ["HessianPartials", "linear_product"]


def linear_product(inp: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, int]:
    """What `accumulate_hessian` adds for a Linear's input: (product, samples)."""
    inp = inp.to(device=device)
    if inp.dim() == 2:
        inp = inp.unsqueeze(0)
    elif inp.dim() > 3:
        inp = inp.reshape(inp.shape[0], -1, inp.shape[-1])
    samples = inp.shape[0]
    inp = inp.reshape((-1, inp.shape[-1])).t()
    inp = math.sqrt(2) * inp.to(dtype=GPTQ_PRECISION)
    return inp.matmul(inp.t()), samples


@dataclass
class _Product:
    """A part's latest Linear-input product, reused while the same tensor comes in."""

    source: torch.Tensor
    version: int
    product: torch.Tensor
    samples: int

    def serves(self, inp: torch.Tensor, device: torch.device) -> bool:
        return (
            self.source is inp
            and self.source._version == self.version
            and self.product.device == device
        )


class HessianPartials:
    """Per-replica Hessian sums and sample counts of one calibration pass."""

    def __init__(self, parts: int):
        self._sums: list[dict[nn.Module, torch.Tensor]] = [{} for _ in range(parts)]
        self._counts: list[dict[nn.Module, torch.Tensor]] = [{} for _ in range(parts)]
        self._latest: list[_Product | None] = [None] * parts
        self.shared_products = [0] * parts  # products reused, per part

    @property
    def parts(self) -> int:
        return len(self._sums)

    def seen(self, part: int) -> int:
        """How many modules part `part` has accumulated so far (call from that part's worker).

        In merged order these are the first modules (part 0's come first), so a
        statistic accumulated elsewhere can be placed where stock's hooks would
        have put it (grouped experts, `gptq_grouped`).
        """
        return len(self._sums[part])

    def hook(self, part: int, home: nn.Module) -> Callable:
        """Forward hook for the module that part `part` runs in place of `home`.

        Each part's worker touches only its own dicts, so parts need no lock.
        """
        sums, counts = self._sums[part], self._counts[part]

        def accumulate(module: nn.Module, args: tuple, _output: object) -> None:
            if home not in sums:
                sums[home] = make_empty_hessian(module)
                counts[home] = torch.zeros((), device=sums[home].device)
            if not isinstance(module, nn.Linear):  # stock's code for every other kind
                sums[home], counts[home] = accumulate_hessian(
                    args[0], module, sums[home], counts[home]
                )
                return
            latest = self._product(part, args[0], sums[home].device)
            counts[home] += latest.samples
            sums[home] += latest.product

        return accumulate

    def _product(self, part: int, inp: torch.Tensor, device: torch.device) -> _Product:
        """The product for `inp` on `device`: the part's latest one if it serves."""
        latest = self._latest[part]
        if latest is not None and latest.serves(inp, device):
            self.shared_products[part] += 1
            return latest
        self._latest[part] = None  # free the old product before computing the new one
        product, samples = linear_product(inp, device)
        self._latest[part] = _Product(inp, inp._version, product, samples)
        return self._latest[part]

    def merge_into(
        self,
        hessians: dict[nn.Module, torch.Tensor],
        num_samples: dict[nn.Module, torch.Tensor],
    ) -> int:
        """Add the parts' sums and counts to the modifier's, in stock's order.

        A module already in `hessians` keeps its place and its sum is added to;
        new modules are appended in order of first call (part 0's first, then part
        1's not yet seen, ...), which is the batch order stock sees them in.
        Returns how many modules were merged.
        """
        self._latest = [None] * self.parts
        merged = 0
        for module in self._first_seen_order():
            device = torch.device(get_execution_device(module))
            hessian, count = hessians.get(module), num_samples.get(module)
            for sums, counts in zip(self._sums, self._counts):
                if module not in sums:
                    continue
                part_sum, part_count = sums.pop(module).to(device), counts.pop(module).to(device)
                if hessian is None:
                    hessian, count = part_sum, part_count
                else:
                    hessian += part_sum
                    count += part_count
            hessians[module], num_samples[module] = hessian, count
            merged += 1
        return merged

    def _first_seen_order(self) -> list[nn.Module]:
        order: dict[nn.Module, None] = {}
        for sums in self._sums:
            for module in sums:
                order.setdefault(module, None)
        return list(order)
