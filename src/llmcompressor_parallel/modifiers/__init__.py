"""The parallel modifiers: thin subclasses of the stock ones plus engine calls."""

from llmcompressor_parallel.modifiers.autoround import DataParallelAutoRoundModifier
from llmcompressor_parallel.modifiers.gptq import ParallelGPTQExpertModifier

__all__ = ["DataParallelAutoRoundModifier", "ParallelGPTQExpertModifier"]
