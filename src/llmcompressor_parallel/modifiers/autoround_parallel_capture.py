"""A layer's input-capture pass data-parallel, under the "parallel_sequential" pipeline.

Why: with the tuning fanned out, the pipeline's capture pass (the layer's calibration
forwards, whose outputs are the next layer's inputs since AutoRound switches error
propagation off) is about a quarter of a Qwen3-30B-A3B-shape layer's time on 2 GPUs
(5.5 of 20.6 s). Under `oneshot(..., pipeline="parallel_sequential")` each device of
the modifier's pool runs a contiguous run of the batches on its replica of the layer
(`calibration_pipeline`); stock's capture hook on the home layer pauses meanwhile,
each part's layer gets a forward-pre hook recording that part's batches, and at the
end the parts' records are appended in part order, that is in batch order, to stock's
`_all_module_input`: the list stock's hook builds, with the same values (each part
runs the same kernels on the same inputs; nothing is summed).
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Mapping, Sequence

import torch
from torch import nn
from torch.utils._pytree import tree_map
from torch.utils.hooks import RemovableHandle

__all__ = ["PartCapture"]

Keep = Callable[[Any], Any]


class PartCapture:
    """Per-part records of the layers' inputs during one data-parallel capture pass.

    :param layers: each home decoder layer whose inputs are captured -> (its name as
        stock keys it, how a captured value is kept: on the host as stock, or on the
        layer's device where auto-round's caches stay on the GPU)
    :param parts: `parts[k]` maps each home module to the module part k runs
    """

    def __init__(
        self, layers: Mapping[nn.Module, tuple[str, Keep]], parts: Sequence[Mapping[nn.Module, nn.Module]]
    ) -> None:
        self._records: list[list[tuple[str, tuple, dict]]] = [[] for _ in parts]
        self._handles: list[RemovableHandle] = []
        try:
            for part, module_map in enumerate(parts):
                for home, (name, keep) in layers.items():
                    hook = functools.partial(self._record, part, name, keep)
                    self._handles.append(
                        module_map[home].register_forward_pre_hook(hook, with_kwargs=True)
                    )
        except BaseException:
            self.remove()
            raise

    def _record(
        self, part: int, name: str, keep: Keep, _module: nn.Module, args: tuple, kwargs: dict
    ) -> None:
        self._records[part].append((name, tree_map(keep, args), tree_map(keep, kwargs)))

    def remove(self) -> None:
        """Remove the per-part hooks (idempotent)."""
        handles, self._handles = self._handles, []
        for handle in handles:
            handle.remove()

    def merge_into(self, captured: dict[str, list[tuple[tuple, dict]]]) -> int:
        """Append every part's records, part by part, to `captured`; returns how many."""
        count = 0
        for records in self._records:
            for name, args, kwargs in records:
                captured.setdefault(name, []).append((args, kwargs))
                count += 1
        self._records = [[] for _ in self._records]
        return count


def kept_on_host(value: Any) -> Any:
    """Stock's capture: tensors detached and copied to host memory."""
    return value.detach().cpu() if isinstance(value, torch.Tensor) else value


def kept_on(device: torch.device | None) -> Keep:
    """A captured value kept on `device` (the home layer's; None: its own device),
    copied there from any device; host tensors stay uncopied, as stock's
    `detach().cpu()` leaves them."""

    def keep(value: Any) -> Any:
        if not isinstance(value, torch.Tensor):
            return value
        value = value.detach()
        if value.device.type == "cpu":
            return value
        return value.to(value.device if device is None else device, copy=True)

    return keep
