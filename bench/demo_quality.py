"""Quality of ours vs stock on the embedded demo model: KL against the unquantized model.

Runs stock AutoRoundModifier and DataParallelAutoRoundModifier (CPU replicas, or GPUs with
--data-parallel) on the same calibration data and prints one JSON line each.

    python bench/demo_quality.py --iters 50 --data-parallel cpu,cpu
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import llmcompressor_parallel  # noqa: F401
from llmcompressor import oneshot
from llmcompressor.modifiers.autoround import AutoRoundModifier
from llmcompressor_parallel import DataParallelAutoRoundModifier
from llmcompressor_parallel.cli import _parse_data_parallel
from llmcompressor_parallel.demo import calibration_dataset, demo_model_path, kl_divergence, stdlib_texts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--data-parallel", default="cpu,cpu")
    parser.add_argument("--kl-chunks", type=int, default=32)
    args = parser.parse_args()
    model_dir = demo_model_path()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    data = calibration_dataset(tokenizer, args.samples, args.seq_len)
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    common = dict(targets="Linear", scheme="W4A16", ignore=["lm_head", "re:.*mlp.gate$"],
                  iters=args.iters, batch_size=8, enable_torch_compile=False)
    configs = {
        "stock": AutoRoundModifier(**common),
        "ours": DataParallelAutoRoundModifier(data_parallel=_parse_data_parallel(args.data_parallel), **common),
    }
    for name, modifier in configs.items():
        out = Path(tempfile.mkdtemp(prefix=f"demo-{name}-"))
        torch.manual_seed(0)
        start = time.perf_counter()
        oneshot(model=str(model_dir), dataset=data, recipe=modifier, num_calibration_samples=args.samples,
                max_seq_length=args.seq_len, output_dir=str(out))
        seconds = time.perf_counter() - start
        quantized = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
        kl = kl_divergence(reference, quantized, tokenizer, stdlib_texts("heldout"), args.seq_len, args.kl_chunks)
        print(json.dumps({"bench": "demo_quality", "config": name, "iters": args.iters,
                          "kl_vs_unquantized": kl, "seconds": round(seconds, 1)}), flush=True)


if __name__ == "__main__":
    main()
