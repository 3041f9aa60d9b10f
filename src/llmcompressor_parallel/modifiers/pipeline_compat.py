"""What the stock pipelines decide by a modifier's class name, made to hold for ours.

llm-compressor 0.14's sequential pipeline turns error propagation off only when a
modifier's class is named exactly `AutoRoundModifier` (DESIGN.md trap 2). A
subclass would leave it on, and the next layer would then receive the quantized
layer's outputs. The pipeline reads `dataset_args.propagate_error` on every batch,
so setting it from `on_calibration_start` (which the pipeline calls after its check)
gives the stock behaviour without patching llm-compressor.
"""

from __future__ import annotations

import sys

from loguru import logger

__all__ = ["disable_error_propagation"]


def disable_error_propagation() -> bool:
    """Find the running pipeline's dataset arguments and switch propagation off.

    Returns False (after a warning) when no calibration pipeline is on the stack.
    """
    frame = sys._getframe(1)
    while frame is not None:
        dataset_args = frame.f_locals.get("dataset_args")
        if dataset_args is not None and hasattr(dataset_args, "propagate_error"):
            if dataset_args.propagate_error:
                dataset_args.propagate_error = False
                logger.debug("error propagation switched off, as for AutoRoundModifier")
            return True
        frame = frame.f_back
    logger.warning(
        "no llm-compressor calibration pipeline found on the stack: could not switch "
        "error propagation off as the sequential pipeline does for AutoRoundModifier"
    )
    return False
