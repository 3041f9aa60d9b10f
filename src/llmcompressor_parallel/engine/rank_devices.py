"""Which devices one rank of a torch.distributed run (torchrun) may use for `data_parallel`.

Why: under llm-compressor's DDP mode every rank is its own process; a rank's
in-process data parallelism must stay on GPUs no other rank uses, and should
include the GPU the rank already works on: llm-compressor's sequential pipeline
onloads rank r's layers to cuda:r (`get_main_device`), which is cuda:LOCAL_RANK on
one host. So under an active process group `data_parallel` means:

- "auto": the host's visible GPUs dealt out over the host's ranks (LOCAL_WORLD_SIZE,
  set by torchrun): local rank l of L gets cuda:l, cuda:l+L, cuda:l+2L, ...; with one
  rank per host (one rank per node) that is every GPU. A rank dealt a single GPU
  runs serially, with a log line saying how to give it more;
- N: the first N GPUs of that deal (fewer dealt fails at initialize);
- a list: taken as given (each rank passes its own).

Then, collectively, every rank sends the GPUs it took to every other
(`all_gather_object`), and two ranks of one host naming the same GPU fail at
initialize with both named, before any work.
"""

from __future__ import annotations

import os
import socket
from typing import NamedTuple, Sequence

import torch
import torch.distributed as dist
from loguru import logger

from llmcompressor_parallel.engine.devices import (
    DataParallelSpec,
    resolve_devices,
    validate_data_parallel,
)

__all__ = [
    "RankGPUs",
    "check_disjoint_across_ranks",
    "dealt_gpus",
    "resolve_rank_devices",
    "shared_gpus",
]


def resolve_rank_devices(value: DataParallelSpec) -> list[torch.device] | None:
    """This rank's devices for a validated spec, or None for a serial rank."""
    value = validate_data_parallel(value)
    if value == "off" or isinstance(value, list):
        return resolve_devices(value)
    local_rank, local_ranks = _env_int("LOCAL_RANK", 0), _env_int("LOCAL_WORLD_SIZE", 1)
    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    dealt = dealt_gpus(visible, local_rank, local_ranks)
    if value == "auto":
        if len(dealt) < 2:
            logger.info(
                "data_parallel='auto' under torch.distributed: rank {} (local rank {} of "
                "{}) is dealt {} of this host's {} GPU(s); running its work serially. "
                "Start fewer ranks per host (one per node gives each rank every GPU) or "
                "pass each rank its own device list",
                dist.get_rank(),
                local_rank,
                local_ranks,
                len(dealt),
                visible,
            )
            return None
        return [torch.device("cuda", index) for index in dealt]
    if len(dealt) < value:
        raise ValueError(
            f"data_parallel={value} under torch.distributed: local rank {local_rank} of "
            f"{local_ranks} is dealt {len(dealt)} of this host's {visible} GPU(s) "
            f"({', '.join(f'cuda:{index}' for index in dealt) or 'none'}); allowed: "
            f'N <= {len(dealt)}, "auto", or a list of devices'
        )
    return [torch.device("cuda", index) for index in dealt[:value]]


def dealt_gpus(visible: int, local_rank: int, local_ranks: int) -> list[int]:
    """GPU indices local rank `local_rank` of `local_ranks` gets: every L-th from its own."""
    if not 0 <= local_rank < max(local_ranks, 1):
        raise ValueError(f"LOCAL_RANK={local_rank} is outside LOCAL_WORLD_SIZE={local_ranks}")
    return list(range(local_rank, visible, max(local_ranks, 1)))


def check_disjoint_across_ranks(devices: list[torch.device] | None) -> None:
    """Collective: fail when two ranks of one host took the same GPU.

    Every rank must call it (the ones with `devices=None` too), in the same order
    relative to other collectives. GPUs are told apart by UUID, so ranks with
    different CUDA_VISIBLE_DEVICES are compared correctly.
    """
    mine = RankGPUs(
        host=socket.gethostname(),
        gpus=sorted({_gpu_identity(d) for d in devices or [] if d.type == "cuda"}),
        asked=[str(device) for device in devices or []],
    )
    everyone: list[RankGPUs | None] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    clashes = shared_gpus(everyone)  # type: ignore[arg-type]
    if clashes:
        raise ValueError(
            "data_parallel under torch.distributed: each rank needs GPUs of its own; "
            + "; ".join(clashes)
            + '. Allowed: "auto" or N (GPUs dealt out over the ranks of a host), or a '
            "per-rank list of disjoint devices"
        )


class RankGPUs(NamedTuple):
    """What one rank took: its host, its GPUs' identities, the devices as it named them."""

    host: str
    gpus: list[str]
    asked: list[str]


def shared_gpus(ranks: Sequence[RankGPUs]) -> list[str]:
    """One line per GPU of a host that more than one rank took (index = rank)."""
    owner: dict[tuple[str, str], int] = {}
    clashes = []
    for rank, entry in enumerate(ranks):
        for gpu in entry.gpus:
            first = owner.setdefault((entry.host, gpu), rank)
            if first != rank:
                clashes.append(
                    f"ranks {first} ({ranks[first].asked}) and {rank} ({entry.asked}) "
                    f"on host {entry.host} share GPU {gpu}"
                )
    return clashes


def _gpu_identity(device: torch.device) -> str:
    index = 0 if device.index is None else device.index
    uuid = getattr(torch.cuda.get_device_properties(index), "uuid", None)
    return str(uuid) if uuid is not None else f"cuda:{index}"


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not an integer") from None
