"""W4A16 AutoRound of Llama-3-8B-Instruct on every GPU of the machine.

Needs the model on disk or hub access. Run: python examples/llama3_8b_autoround.py [MODEL]
"""

import sys

import llmcompressor_parallel  # noqa: F401  (registers the modifiers)
from chat_calibration import chat_calibration
from llmcompressor import oneshot
from llmcompressor_parallel import DataParallelAutoRoundModifier

MODEL = sys.argv[1] if len(sys.argv) > 1 else "meta-llama/Meta-Llama-3-8B-Instruct"
SAMPLES, SEQ_LEN = 128, 2048

oneshot(
    model=MODEL,
    dataset=chat_calibration(MODEL, SAMPLES, SEQ_LEN),
    recipe=DataParallelAutoRoundModifier(
        targets="Linear", scheme="W4A16", ignore=["lm_head"], iters=200,
        data_parallel="auto",  # every visible GPU; keep_cache_on_gpu follows
    ),
    num_calibration_samples=SAMPLES,
    max_seq_length=SEQ_LEN,
    output_dir=MODEL.split("/")[-1] + "-W4A16-AutoRound",
)
