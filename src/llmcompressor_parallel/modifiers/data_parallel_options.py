"""The knobs both parallel modifiers share, validated at construction."""

from __future__ import annotations

from typing import Any

import torch
from loguru import logger
from pydantic import BaseModel, field_validator

from llmcompressor_parallel.engine.devices import (
    DataParallelSpec,
    resolve_devices,
    validate_data_parallel,
)

__all__ = ["DataParallelOptions", "refuse_active_process_group"]


class DataParallelOptions(BaseModel):
    """Mixin of pydantic fields: which devices run the replicas."""

    data_parallel: DataParallelSpec = "off"

    @field_validator("data_parallel", mode="before")
    @classmethod
    def _check_data_parallel(cls, value: Any) -> DataParallelSpec:
        return validate_data_parallel(value)

    def resolve_parallel_devices(self) -> list[torch.device] | None:
        devices = resolve_devices(self.data_parallel)
        if devices is not None:
            refuse_active_process_group()
            logger.info(
                "{}: data-parallel over {} devices: {}",
                type(self).__name__,
                len(devices),
                ", ".join(str(device) for device in devices),
            )
        return devices


def refuse_active_process_group() -> None:
    """In-process data parallelism and torchrun's one-process-per-GPU do not mix yet."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        raise RuntimeError(
            "data_parallel cannot be combined with an active torch.distributed "
            f"process group (world size {torch.distributed.get_world_size()}): under "
            "torchrun every rank already owns its GPU(s), and fanning a layer out "
            "inside a rank would need the ranks' GPU sets agreed beforehand. Either "
            "run one ordinary process with data_parallel to use every GPU, or keep "
            'torchrun and set data_parallel="off".'
        )
