"""Embedded demo: a tiny MoE model trained on the Python stdlib, plus its data helpers."""

from llmcompressor_parallel.demo.data import (
    calibration_dataset,
    demo_model_path,
    generate,
    kl_divergence,
    stdlib_texts,
)

__all__ = [
    "calibration_dataset",
    "demo_model_path",
    "generate",
    "kl_divergence",
    "stdlib_texts",
]
