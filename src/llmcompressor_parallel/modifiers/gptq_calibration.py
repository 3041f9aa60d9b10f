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
"""

from __future__ import annotations

from typing import Callable

import torch
from compressed_tensors.utils import get_execution_device
from llmcompressor.modifiers.gptq.helpers import accumulate_hessian, make_empty_hessian
from torch import nn

__all__ = ["HessianPartials"]


class HessianPartials:
    """Per-replica Hessian sums and sample counts of one calibration pass."""

    def __init__(self, parts: int):
        self._sums: list[dict[nn.Module, torch.Tensor]] = [{} for _ in range(parts)]
        self._counts: list[dict[nn.Module, torch.Tensor]] = [{} for _ in range(parts)]

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
            sums[home], counts[home] = accumulate_hessian(args[0], module, sums[home], counts[home])

        return accumulate

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
