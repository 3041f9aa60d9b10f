"""Split a layer call along the batch dimension, and gather the outputs back.

The batch dimension is that of the forward's first argument (the hidden states).
A tensor is split when its dim 0 has that size and it has at least two dims; other
tensors (rotary embeddings of batch 1, broadcasting masks, 1-D cache positions) go
whole to every replica. Splits are as even as possible and keep sample order, so
gathering is a concatenation.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

__all__ = ["split_sizes", "split_ranges", "split_call", "gather_outputs", "move_to"]


def split_sizes(batch: int, parts: int) -> list[int]:
    """As-even-as-possible sizes, larger first: 5 over 3 gives [2, 2, 1]."""
    base, extra = divmod(batch, parts)
    return [base + (1 if index < extra else 0) for index in range(parts)]


def split_ranges(total: int, parts: int) -> list[tuple[int, int]]:
    """`split_sizes` as contiguous [start, stop) ranges: 5 over 3 gives (0, 2), (2, 4), (4, 5)."""
    ranges, start = [], 0
    for size in split_sizes(total, parts):
        ranges.append((start, start + size))
        start += size
    return ranges


def _is_batched(value: Any, batch: int) -> bool:
    return isinstance(value, torch.Tensor) and value.ndim >= 2 and value.shape[0] == batch


def split_call(
    args: tuple, kwargs: dict, batch: int, sizes: Sequence[int]
) -> list[tuple[tuple, dict]]:
    """One (args, kwargs) per part; batched tensors are narrowed (views), others shared."""
    parts = []
    start = 0
    for size in sizes:
        def narrow(value: Any, start: int = start, size: int = size) -> Any:
            return value.narrow(0, start, size) if _is_batched(value, batch) else value

        parts.append((tree_map(narrow, args), tree_map(narrow, kwargs)))
        start += size
    return parts


def move_to(tree: Any, device: torch.device) -> Any:
    """Differentiable move of every tensor in a pytree (no-op for tensors already there)."""
    return tree_map(
        lambda value: value.to(device, non_blocking=True)
        if isinstance(value, torch.Tensor)
        else value,
        tree,
    )


def gather_outputs(outputs: Sequence[Any], sizes: Sequence[int]) -> Any:
    """Concatenate the parts' outputs (already on the home device) in order.

    Tensors whose dim 0 matches each part's share are concatenated; anything else
    (a scalar, a None, a non-batched tensor) is taken from the first part.
    """
    flats = [tree_flatten(output) for output in outputs]
    leaves0, spec = flats[0]
    for leaves, other_spec in flats[1:]:
        if other_spec != spec:
            raise RuntimeError(
                f"replicas returned differently structured outputs: {spec} vs {other_spec}"
            )
    gathered = []
    for position, first in enumerate(leaves0):
        column = [leaves[position] for leaves, _ in flats]
        if isinstance(first, torch.Tensor) and all(
            isinstance(value, torch.Tensor) and value.ndim >= 1 and value.shape[0] == size
            for value, size in zip(column, sizes)
        ):
            gathered.append(torch.cat(column, dim=0))
        else:
            gathered.append(first)
    return tree_unflatten(gathered, spec)
