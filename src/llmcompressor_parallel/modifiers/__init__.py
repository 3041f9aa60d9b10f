"""The parallel modifiers: thin subclasses of the stock ones plus engine calls."""

from llmcompressor_parallel.modifiers.autoround import DataParallelAutoRoundModifier

__all__ = ["DataParallelAutoRoundModifier"]
