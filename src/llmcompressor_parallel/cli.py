"""`llmc-parallel`: run the embedded demo, or a recipe on a local model, from the shell."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Sequence

__all__ = ["main"]


def _parse_data_parallel(text: str) -> object:
    """'off' | 'auto' | '4' | 'cuda:0,cuda:1' | 'cpu,cpu' -> the modifier's value."""
    if text in ("off", "auto"):
        return text
    if text.isdigit():
        return int(text)
    return [part.strip() for part in text.split(",") if part.strip()]


def _default_demo_devices() -> object:
    import torch

    if torch.cuda.is_available() and torch.cuda.device_count() >= 1:
        return "auto"  # every visible GPU (serial, with a log line, if only one)
    return ["cpu", "cpu"]


def _seed(seed: int) -> None:
    """oneshot shuffles the calibration samples with torch's global generator, which
    torch 2.13 seeds from the system's entropy at start-up: seeded here, two runs pick
    the same samples in the same order and save the same checkpoint. Negative: left as
    it is."""
    import torch

    if seed >= 0:
        torch.manual_seed(seed)


def _run_demo(args: argparse.Namespace) -> int:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import llmcompressor_parallel  # noqa: F401  (registers the modifiers)
    from llmcompressor import oneshot
    from llmcompressor_parallel.demo import (
        calibration_dataset,
        demo_model_path,
        generate,
        kl_divergence,
        stdlib_texts,
    )
    from llmcompressor_parallel.recipe_overrides import recipe_with_overrides
    from llmcompressor_parallel.recipes import recipe_path

    model_dir = demo_model_path()
    output_dir = Path(args.output_dir).resolve()
    data_parallel = (
        _parse_data_parallel(args.data_parallel) if args.data_parallel else _default_demo_devices()
    )
    recipe = recipe_with_overrides(
        recipe_path(args.recipe), data_parallel=data_parallel, iters=args.iters
    )
    print(f"demo model: {model_dir}")
    print(f"data_parallel: {data_parallel}; recipe: {args.recipe}; output: {output_dir}")

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    calibration = calibration_dataset(tokenizer, args.samples, args.seq_len)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    _seed(args.seed)
    start = time.perf_counter()
    oneshot(
        model=model,
        dataset=calibration,
        recipe=recipe,
        num_calibration_samples=args.samples,
        max_seq_length=args.seq_len,
        output_dir=str(output_dir),
    )
    seconds = time.perf_counter() - start

    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    quantized = AutoModelForCausalLM.from_pretrained(output_dir, dtype=torch.float32)
    heldout = stdlib_texts("heldout")
    kl = kl_divergence(reference, quantized, tokenizer, heldout, args.seq_len, args.kl_chunks)
    prompt = "def __init__(self"
    print("\n--- generation (original) ---")
    print(generate(reference, tokenizer, prompt, 40))
    print("--- generation (quantized, reloaded with transformers) ---")
    print(generate(quantized, tokenizer, prompt, 40))
    summary = {
        "quantize_seconds": round(seconds, 2),
        "kl_vs_unquantized": kl,
        "heldout_chunks": args.kl_chunks,
        "data_parallel": data_parallel,
        "output_dir": str(output_dir),
    }
    print("\n" + json.dumps(summary))
    return 0


def _calibration_from_path(path: Path, tokenizer, samples: int, seq_len: int):
    """A saved `datasets` folder, or a .txt/.json/.jsonl file with a "text" field."""
    from datasets import Dataset, load_dataset, load_from_disk

    if path.is_dir():
        return load_from_disk(str(path))
    if path.suffix in (".json", ".jsonl"):
        texts = load_dataset("json", data_files=str(path), split="train")["text"]
    elif path.suffix == ".txt":
        texts = [path.read_text()]
    else:
        raise ValueError(f"--dataset {path}: expected a datasets folder, .txt, .json or .jsonl")
    ids: list[int] = []
    for text in texts:
        ids.extend(tokenizer(text, add_special_tokens=False)["input_ids"])
    rows = [ids[i : i + seq_len] for i in range(0, len(ids) - seq_len + 1, seq_len)][:samples]
    if not rows:
        raise ValueError(f"--dataset {path}: fewer than {seq_len} tokens")
    return Dataset.from_dict({"input_ids": rows, "attention_mask": [[1] * seq_len] * len(rows)})


def _run_oneshot(args: argparse.Namespace) -> int:
    from transformers import AutoTokenizer

    import llmcompressor_parallel  # noqa: F401  (registers the modifiers)
    from llmcompressor import oneshot
    from llmcompressor_parallel.demo import calibration_dataset
    from llmcompressor_parallel.recipe_overrides import recipe_with_overrides

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    if args.dataset:
        dataset = _calibration_from_path(Path(args.dataset), tokenizer, args.samples, args.seq_len)
    else:
        print("no --dataset: calibrating on Python standard-library sources")
        dataset = calibration_dataset(tokenizer, args.samples, args.seq_len)
    data_parallel = _parse_data_parallel(args.data_parallel) if args.data_parallel else None
    recipe = recipe_with_overrides(Path(args.recipe), data_parallel=data_parallel)
    _seed(args.seed)
    start = time.perf_counter()
    oneshot(
        model=args.model,
        dataset=dataset,
        recipe=recipe,
        num_calibration_samples=min(args.samples, len(dataset)),
        max_seq_length=args.seq_len,
        output_dir=args.output_dir,
        **({"pipeline": args.pipeline} if args.pipeline else {}),
    )
    print(json.dumps({"quantize_seconds": round(time.perf_counter() - start, 2),
                      "output_dir": str(Path(args.output_dir).resolve())}))
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="llmc-parallel", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    demo = commands.add_parser("demo", help="quantize the embedded MoE model and evaluate it")
    demo.add_argument("--output-dir", default="llmc-parallel-demo")
    demo.add_argument("--recipe", default="demo_autoround_w4a16", help="a shipped recipe name")
    demo.add_argument("--data-parallel", default=None,
                      help="off | auto | N | comma-separated devices (default: all GPUs, else cpu,cpu)")
    demo.add_argument("--iters", type=int, default=None, help="override the recipe's iters")
    demo.add_argument("--samples", type=int, default=64)
    demo.add_argument("--seq-len", type=int, default=256)
    demo.add_argument("--kl-chunks", type=int, default=32)
    demo.add_argument("--seed", type=int, default=0,
                      help="seed of oneshot's shuffle of the calibration samples (negative: unseeded)")
    demo.set_defaults(run=_run_demo)

    one = commands.add_parser("oneshot", help="run a recipe YAML on a local model folder")
    one.add_argument("--model", required=True, help="local Hugging Face model folder")
    one.add_argument("--recipe", required=True, help="recipe YAML (may name our modifiers)")
    one.add_argument("--output-dir", required=True)
    one.add_argument("--dataset", default=None,
                     help="datasets folder or .txt/.json/.jsonl; default: stdlib sources")
    one.add_argument("--data-parallel", default=None, help="override the recipe's data_parallel")
    one.add_argument("--pipeline", default=None,
                     help='calibration pipeline; "parallel_sequential" runs GPTQ calibration '
                          "forwards data-parallel")
    one.add_argument("--samples", type=int, default=128)
    one.add_argument("--seq-len", type=int, default=2048)
    one.add_argument("--seed", type=int, default=0,
                     help="seed of oneshot's shuffle of the calibration samples (negative: unseeded)")
    one.set_defaults(run=_run_oneshot)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
