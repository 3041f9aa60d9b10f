"""The knobs both parallel modifiers share, validated at construction."""

from __future__ import annotations

from typing import Any, Callable, ClassVar, Iterable

import torch
from compressed_tensors.offload.dist_utils import is_distributed
from loguru import logger
from pydantic import BaseModel, field_validator

from llmcompressor_parallel.engine.devices import (
    DataParallelSpec,
    resolve_devices,
    validate_data_parallel,
)
from llmcompressor_parallel.engine.worker_pool import DeviceWorkerPool
from llmcompressor_parallel.engine.rank_devices import (
    check_disjoint_across_ranks,
    resolve_rank_devices,
)

__all__ = ["DataParallelOptions", "check_allowed", "refuse_active_process_group"]


def check_allowed(name: str, value: Any, allowed: Iterable[Any]) -> Any:
    """`value` if it is one of `allowed`, else the error every knob gives, listing them.

    Compared by type and value, so 1 is not taken for True nor 0 for False.
    """
    allowed = tuple(allowed)
    if not any(isinstance(value, type(v)) and value == v for v in allowed):
        raise ValueError(
            f"{name}={value!r} is not valid; allowed values: "
            + ", ".join(repr(v) for v in allowed)
        )
    return value


class DataParallelOptions(BaseModel):
    """Mixin of pydantic fields: which devices run the replicas.

    `composes_with_torch_distributed`: whether the modifier's data parallelism runs
    inside one rank of an active process group (over that rank's devices,
    `engine.rank_devices`) or is refused there.
    """

    data_parallel: DataParallelSpec = "off"

    composes_with_torch_distributed: ClassVar[bool] = False

    @field_validator("data_parallel", mode="before")
    @classmethod
    def _check_data_parallel(cls, value: Any) -> DataParallelSpec:
        return validate_data_parallel(value)

    def stop_workers(self) -> None:
        """Remove the worker guard and stop the pool's threads (idempotent); forget the
        pipeline, which a modifier reused in another run must find out again.

        Both modifiers hold `_pool` (a `DeviceWorkerPool`), `_worker_guard` (the
        forward-error hooks that stop it when a layer raises, `worker_guard`) and
        `_in_parallel_pipeline`.
        """
        self._in_parallel_pipeline = False
        guard, self._worker_guard = self._worker_guard, None
        if guard is not None:
            guard.remove()
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.close()

    # ------------------------------------------------------------ "parallel_sequential"
    # the part of calibration_pipeline's ParallelCalibrationParticipant protocol both
    # modifiers share; `merged_hook` names the modifier's own hook method that the
    # pipeline may run per replica and the modifier merges
    merged_hook: ClassVar[str]

    def join_parallel_pipeline(self) -> None:
        self._in_parallel_pipeline = True

    def parallel_calibration_pool(self) -> DeviceWorkerPool | None:
        return self._pool

    def merges_hook(self, hook: Callable) -> bool:
        """Only this modifier's own `merged_hook`, bound to it (not e.g. its observers')."""
        return getattr(hook, "__self__", None) is self and getattr(
            hook, "__func__", None
        ) is getattr(type(self), self.merged_hook)

    def resolve_parallel_devices(self) -> list[torch.device] | None:
        """This process's devices (this rank's, under torch.distributed), or None: serial.

        Under an active process group this is collective for modifiers that compose
        with it: call it on every rank.
        """
        if is_distributed() and self.composes_with_torch_distributed:
            devices = resolve_rank_devices(self.data_parallel)
            check_disjoint_across_ranks(devices)
        else:
            devices = resolve_devices(self.data_parallel)
            if devices is not None:
                refuse_active_process_group(type(self).__name__)
        if devices is not None:
            rank = f"rank {torch.distributed.get_rank()}: " if is_distributed() else ""
            logger.info(
                "{}: {}data-parallel over {} devices: {}",
                type(self).__name__,
                rank,
                len(devices),
                ", ".join(str(device) for device in devices),
            )
        return devices


def refuse_active_process_group(modifier: str = "this modifier") -> None:
    """For modifiers whose in-process fan-out is not verified to compose with torchrun.

    `DataParallelAutoRoundModifier`: under torch.distributed auto-round tunes each
    block under its own DDP (a reducer that all-reduces the block's gradients across
    ranks) and spreads a block over a rank's GPU group itself; replicas summing
    their gradients into the block behind that reducer have not been verified.
    """
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        raise RuntimeError(
            f"{modifier}: data_parallel cannot be combined with an active "
            f"torch.distributed process group (world size "
            f"{torch.distributed.get_world_size()}): under torchrun auto-round "
            "synchronises each block's gradients across ranks itself (DDP), and the "
            "in-process fan-out has not been verified behind that. Either run one "
            'ordinary process with data_parallel to use every GPU, or keep torchrun, '
            'set data_parallel="off", and give each rank a GPU group the stock way '
            "(LLMCOMPRESSOR_GPUS_PER_GROUP). ParallelGPTQExpertModifier does compose "
            "with torchrun."
        )
