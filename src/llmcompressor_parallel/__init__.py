"""llmcompressor-parallel: every GPU of the machine for llm-compressor's oneshot().

Importing the package registers its modifiers with llm-compressor's ModifierFactory,
so recipe YAML can name them.
"""

from llmcompressor.modifiers import ModifierFactory

from llmcompressor_parallel.modifiers import (
    DataParallelAutoRoundModifier,
    ParallelGPTQExpertModifier,
)

__all__ = ["DataParallelAutoRoundModifier", "ParallelGPTQExpertModifier"]
__version__ = "0.1.0"

for _modifier in (DataParallelAutoRoundModifier, ParallelGPTQExpertModifier):
    ModifierFactory.register(_modifier.__name__, _modifier)
