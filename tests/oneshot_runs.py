"""Run stock and parallel modifiers through oneshot() on the same tiny model and data."""

from __future__ import annotations

import contextlib
import logging
import re
from pathlib import Path
from typing import Iterator

import torch
from loguru import logger

from llmcompressor import oneshot
from tiny_models import calibration_data, load_saved_tensors, unpack_int4

AUTOROUND_ARGS = dict(
    targets="Linear",
    scheme="W4A16",
    ignore=["lm_head", "re:.*mlp.gate$"],
    batch_size=4,
    enable_torch_compile=False,
)


def run_oneshot(model_dir: Path, recipe, output_dir: Path, samples: int = 16, seq_len: int = 32,
                dataset=None, **oneshot_args) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    oneshot(
        model=str(model_dir),
        dataset=dataset if dataset is not None else calibration_data(samples, seq_len),
        recipe=recipe,
        num_calibration_samples=samples,
        max_seq_length=seq_len,
        output_dir=str(output_dir),
        **oneshot_args,
    )
    return load_saved_tensors(output_dir)


def calibrate_in_order(model, recipe, samples: int, **oneshot_args) -> None:
    """oneshot on `samples` tiny calibration samples in their given order, nothing saved.

    For the tests that break a run on purpose and then look at the model and modifier.
    """
    oneshot(model=model, dataset=calibration_data(samples), recipe=recipe,
            num_calibration_samples=samples, max_seq_length=32,
            shuffle_calibration_samples=False, **oneshot_args)


def compare_checkpoints(stock: dict, ours: dict) -> dict[str, float]:
    """Share of identical quantized integers, worst relative scale gap, other tensors equal."""
    assert stock.keys() == ours.keys()
    same = total = 0
    worst_scale = 0.0
    other_equal = True
    for name, tensor in stock.items():
        if name.endswith("weight_packed"):
            a, b = unpack_int4(tensor), unpack_int4(ours[name])
            same += (a == b).sum().item()
            total += a.numel()
        elif name.endswith("weight_scale"):
            gap = (tensor.float() - ours[name].float()).abs() / tensor.float().abs().clamp_min(1e-12)
            worst_scale = max(worst_scale, gap.max().item())
        elif not torch.equal(tensor, ours[name]):
            other_equal = False
    return {"int_identical": same / max(total, 1), "ints": total,
            "worst_scale_rel": worst_scale, "other_tensors_equal": float(other_equal)}


class _BlockLossLog(logging.Handler):
    """Collects auto-round's per-block "loss iter 0: a -> iter k: b" lines."""

    PATTERN = re.compile(r"loss iter 0: ([0-9.e+-]+) -> iter \d+: ([0-9.e+-]+)")

    def __init__(self) -> None:
        super().__init__()
        self.losses: list[tuple[float, float]] = []

    def emit(self, record: logging.LogRecord) -> None:
        match = self.PATTERN.search(record.getMessage())
        if match:
            self.losses.append((float(match.group(1)), float(match.group(2))))


@contextlib.contextmanager
def block_losses() -> Iterator[list[tuple[float, float]]]:
    """Yields a list that fills with (initial, best) loss per tuned block."""
    handler = _BlockLossLog()
    autoround_logger = logging.getLogger("autoround")
    autoround_logger.addHandler(handler)
    try:
        yield handler.losses
    finally:
        autoround_logger.removeHandler(handler)


@contextlib.contextmanager
def log_lines(level: str = "INFO") -> Iterator[list[str]]:
    """Yields a list that fills with the loguru messages logged meanwhile."""
    lines: list[str] = []
    sink = logger.add(lambda message: lines.append(str(message)), level=level)
    try:
        yield lines
    finally:
        logger.remove(sink)
