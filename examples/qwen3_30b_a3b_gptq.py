"""W4A16 GPTQ of Qwen3-30B-A3B (MoE, 128 experts) with the update pool on every GPU.

Needs the model on disk or hub access. Run: python examples/qwen3_30b_a3b_gptq.py [MODEL]
"""

import sys

import llmcompressor_parallel  # noqa: F401  (registers the modifiers)
from chat_calibration import chat_calibration
from llmcompressor import oneshot
from llmcompressor_parallel import ParallelGPTQExpertModifier

MODEL = sys.argv[1] if len(sys.argv) > 1 else "Qwen/Qwen3-30B-A3B"
SAMPLES, SEQ_LEN = 128, 2048

oneshot(
    model=MODEL,
    dataset=chat_calibration(MODEL, SAMPLES, SEQ_LEN),
    recipe=ParallelGPTQExpertModifier(
        targets="Linear", scheme="W4A16", ignore=["lm_head", "re:.*mlp.gate$"],
        data_parallel="auto",
    ),
    num_calibration_samples=SAMPLES,
    max_seq_length=SEQ_LEN,
    output_dir=MODEL.split("/")[-1] + "-W4A16-GPTQ",
    pipeline="parallel_sequential",  # calibration forwards data-parallel too
)
