"""Which devices a run uses: the `data_parallel` knob, validated early, resolved late.

Validation happens when a modifier is constructed (bad values fail before any model
is loaded); resolution against the visible GPUs happens at initialize, because only
then do we know where the run actually executes.
"""

from __future__ import annotations

from typing import Union

import torch
from loguru import logger

__all__ = ["DataParallelSpec", "validate_data_parallel", "resolve_devices"]

DataParallelSpec = Union[str, int, list[str]]

_ALLOWED = (
    'allowed values: "off", "auto", an int N >= 2, or a list of at least two '
    'device strings such as ["cuda:0", "cuda:1"] or ["cpu", "cpu"]'
)


def validate_data_parallel(value: DataParallelSpec) -> DataParallelSpec:
    """Check the shape of a `data_parallel` value without looking at the hardware.

    YAML 1.1 reads an unquoted `off` as false, so False means "off".
    """
    if value is False:
        return "off"
    if isinstance(value, bool):
        raise ValueError(f"data_parallel={value!r} is not valid; {_ALLOWED}")
    if isinstance(value, str):
        if value not in ("off", "auto"):
            raise ValueError(f"data_parallel={value!r} is not valid; {_ALLOWED}")
        return value
    if isinstance(value, int):
        if value < 2:
            raise ValueError(
                f"data_parallel={value} is not valid (one replica is the stock "
                f'modifier: use "off"); {_ALLOWED}'
            )
        return value
    if isinstance(value, (list, tuple)):
        devices = list(value)
        if len(devices) < 2:
            raise ValueError(f"data_parallel={devices!r} names fewer than two devices; {_ALLOWED}")
        for device in devices:
            _parse_device(device)
        return devices
    raise ValueError(f"data_parallel={value!r} is not valid; {_ALLOWED}")


def _parse_device(device: object) -> torch.device:
    if not isinstance(device, str):
        raise ValueError(f"data_parallel device {device!r} is not a string; {_ALLOWED}")
    try:
        parsed = torch.device(device)
    except RuntimeError as error:
        raise ValueError(f"data_parallel device {device!r} is not a device: {error}; {_ALLOWED}")
    if parsed.type not in ("cpu", "cuda"):
        raise ValueError(
            f"data_parallel device {device!r} has type {parsed.type!r}; "
            'only "cpu" and "cuda" devices are supported'
        )
    return parsed


def _visible_gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def resolve_devices(value: DataParallelSpec) -> list[torch.device] | None:
    """Turn a validated spec into concrete devices, or None for a serial run.

    Raises when the spec asks for more GPUs than are visible or names one that does
    not exist; "auto" with fewer than two GPUs falls back to serial with a log line.
    """
    value = validate_data_parallel(value)
    visible = _visible_gpus()
    if value == "off":
        return None
    if value == "auto":
        if visible < 2:
            logger.info(
                "data_parallel='auto': {} GPU(s) visible, running serially (stock path)",
                visible,
            )
            return None
        return [torch.device("cuda", index) for index in range(visible)]
    if isinstance(value, int):
        if value > visible:
            raise ValueError(
                f"data_parallel={value} asks for {value} GPUs but {visible} are visible "
                "(CUDA_VISIBLE_DEVICES / torch.cuda.device_count())"
            )
        return [torch.device("cuda", index) for index in range(value)]
    devices = [_parse_device(device) for device in value]
    for device in devices:
        if device.type != "cuda":
            continue
        index = 0 if device.index is None else device.index
        if index >= visible:
            raise ValueError(
                f"data_parallel device {str(device)!r} does not exist: {visible} GPU(s) visible"
            )
    return [
        torch.device("cuda", 0 if d.index is None else d.index) if d.type == "cuda" else d
        for d in devices
    ]
