"""Run-to-run noise band of quantization quality on the embedded demo model.

KL against the unquantized model (held-out stdlib text) for:

- AutoRound W4A16: stock `AutoRoundModifier` under several auto-round seeds, and ours
  (`DataParallelAutoRoundModifier`) serial with grouped experts and with CPU replicas, all
  on the same data, iters and tokens. `AutoRoundModifier` has no seed field; auto-round's
  `AutoRound(seed=42)` calls `set_seed(seed)` once per layer (it drives the order of the
  tuning mini-batches), so the seed is passed by wrapping the `AutoRound` factory that
  llm-compressor's modifier calls. Ours runs with auto-round's default seed (42).
- GPTQ W4A16: stock `GPTQModifier` on the calibration set in its original order and in
  permuted orders (`shuffle_calibration_samples=False`), and ours
  (`ParallelGPTQExpertModifier`, `data_parallel` CPU devices, `pipeline="parallel_sequential"`)
  on the original order. GPTQ's Hessian is order-independent in exact arithmetic, so the
  stock band is the fp32 summation-order noise that ours' per-replica partial sums also add.

Prints one JSON line per run, then a markdown table: KL, relative difference to the mean of
the stock runs of that method, and the stock spread (min, max, std).

    OMP_NUM_THREADS=1 python bench/demo_noise_band.py
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import statistics
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import llmcompressor_parallel  # noqa: F401  (registers the "parallel_sequential" pipeline)
import llmcompressor.modifiers.autoround.base as stock_autoround
from llmcompressor import oneshot
from llmcompressor.modifiers.autoround import AutoRoundModifier
from llmcompressor.modifiers.gptq import GPTQModifier
from llmcompressor_parallel import DataParallelAutoRoundModifier, ParallelGPTQExpertModifier
from llmcompressor_parallel.calibration_pipeline import PIPELINE_NAME
from llmcompressor_parallel.cli import _parse_data_parallel
from llmcompressor_parallel.demo import calibration_dataset, demo_model_path, kl_divergence, stdlib_texts

AUTOROUND_DEFAULT_SEED = 42  # auto-round 0.15.1's AutoRound(seed=42)
QUANT = dict(targets="Linear", scheme="W4A16", ignore=["lm_head", "re:.*mlp.gate$"])


@contextlib.contextmanager
def autoround_kwargs(**overrides: Any) -> Iterator[None]:
    """Give every `AutoRound` the stock modifier builds these keyword arguments
    (auto-round's own, such as `seed` or `amp`, which the modifier does not expose)."""
    real_factory = stock_autoround.AutoRound

    def overridden(*args: Any, **kwargs: Any) -> Any:
        return real_factory(*args, **{**kwargs, **overrides})

    stock_autoround.AutoRound = overridden
    try:
        yield
    finally:
        stock_autoround.AutoRound = real_factory


def autoround_seed(seed: int | None) -> contextlib.AbstractContextManager:
    """Give every `AutoRound` the stock modifier builds `seed` (None: auto-round's default)."""
    return contextlib.nullcontext() if seed is None else autoround_kwargs(seed=seed)


def permuted(data, seed: int | None):
    """The dataset in the order of a seeded permutation (None: original order)."""
    if seed is None:
        return data
    order = list(range(len(data)))
    random.Random(seed).shuffle(order)
    return data.select(order)


def quantize_kl(reference, tokenizer, recipe, data, samples: int, seq_len: int, kl_seq_len: int,
                kl_chunks: int, batch_size: int, pipeline: str | None, seed: int | None) -> tuple[float, float]:
    out = Path(tempfile.mkdtemp(prefix="demo-noise-"))
    extra = {} if pipeline is None else {"pipeline": pipeline}
    torch.manual_seed(0)
    start = time.perf_counter()
    with autoround_seed(seed):
        oneshot(model=str(demo_model_path()), dataset=data, recipe=recipe, num_calibration_samples=samples,
                max_seq_length=seq_len, batch_size=batch_size, shuffle_calibration_samples=False,
                output_dir=str(out), **extra)
    seconds = time.perf_counter() - start
    quantized = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    kl = kl_divergence(reference, quantized, tokenizer, stdlib_texts("heldout"), kl_seq_len, kl_chunks)
    return kl, seconds


def table(rows: list[dict]) -> str:
    lines = ["| method | config | KL vs unquantized | vs stock mean | seconds |", "|---|---|---|---|---|"]
    bands = []
    for method in dict.fromkeys(row["method"] for row in rows):
        group = [row for row in rows if row["method"] == method]
        stock = [row["kl"] for row in group if row["stock"]]
        mean = statistics.fmean(stock)
        std = statistics.stdev(stock) if len(stock) > 1 else 0.0
        for row in group:
            lines.append(f"| {method} | {row['config']} | {row['kl']:.6e} | {row['kl'] / mean - 1:+.2%} "
                         f"| {row['seconds']:.0f} |")
        bands.append(f"{method} stock ({len(stock)} runs): mean {mean:.6e}, min {min(stock):.6e} "
                     f"({min(stock) / mean - 1:+.2%}), max {max(stock):.6e} ({max(stock) / mean - 1:+.2%}), "
                     f"std {std:.3e} ({std / mean:.2%} of mean), max/min {max(stock) / min(stock) - 1:.2%}")
    return "\n".join(lines) + "\n\n" + "\n".join(bands)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ar-iters", type=int, default=30)
    parser.add_argument("--ar-samples", type=int, default=32)
    parser.add_argument("--ar-seq-len", type=int, default=256)
    parser.add_argument("--ar-seeds", type=int, nargs="+", default=[42, 1, 2, 3],
                        help="auto-round seeds for stock (42 is auto-round's default)")
    parser.add_argument("--ar-kl-chunks", type=int, default=32)
    parser.add_argument("--gptq-samples", type=int, default=16)
    parser.add_argument("--gptq-seq-len", type=int, default=128)
    parser.add_argument("--gptq-orders", type=int, nargs="+", default=[-1, 1, 2, 3],
                        help="permutation seeds for stock GPTQ's calibration order; -1: original order")
    parser.add_argument("--gptq-kl-chunks", type=int, default=8)
    parser.add_argument("--data-parallel", default="cpu,cpu")
    parser.add_argument("--skip", choices=["autoround", "gptq"], default=None)
    args = parser.parse_args()
    devices = _parse_data_parallel(args.data_parallel)
    tokenizer = AutoTokenizer.from_pretrained(demo_model_path())
    reference = AutoModelForCausalLM.from_pretrained(demo_model_path(), dtype=torch.float32)
    rows: list[dict] = []

    def record(method: str, config: str, is_stock: bool, kl: float, seconds: float, **extra: Any) -> None:
        row = dict(method=method, config=config, stock=is_stock, kl=kl, seconds=round(seconds, 1), **extra)
        rows.append(row)
        print(json.dumps({"bench": "demo_noise_band", **row}), flush=True)

    if args.skip != "autoround":
        data = calibration_dataset(tokenizer, args.ar_samples, args.ar_seq_len)
        common = dict(iters=args.ar_iters, batch_size=8, enable_torch_compile=False, **QUANT)
        size = dict(samples=args.ar_samples, seq_len=args.ar_seq_len, kl_seq_len=args.ar_seq_len,
                    kl_chunks=args.ar_kl_chunks, batch_size=1, pipeline=None)
        runs = [(f"stock, seed {seed}", True, AutoRoundModifier(**common), seed) for seed in args.ar_seeds]
        runs += [
            ("ours, data_parallel off, grouped_experts", False,
             DataParallelAutoRoundModifier(data_parallel="off", grouped_experts=True, **common), None),
            (f"ours, data_parallel {args.data_parallel} (grouped_experts)", False,
             DataParallelAutoRoundModifier(data_parallel=devices, **common), None),
        ]
        for config, is_stock, recipe, seed in runs:
            kl, seconds = quantize_kl(reference, tokenizer, recipe, data, seed=seed, **size)
            record("AutoRound", config, is_stock, kl, seconds, iters=args.ar_iters, samples=args.ar_samples,
                   seq_len=args.ar_seq_len)

    if args.skip != "gptq":
        data = calibration_dataset(tokenizer, args.gptq_samples, args.gptq_seq_len)
        size = dict(samples=args.gptq_samples, seq_len=args.gptq_seq_len, kl_seq_len=args.gptq_seq_len,
                    kl_chunks=args.gptq_kl_chunks, batch_size=1, seed=None)
        for order in args.gptq_orders:
            seed = None if order < 0 else order
            config = "stock, original order" if seed is None else f"stock, order permuted (seed {seed})"
            kl, seconds = quantize_kl(reference, tokenizer, GPTQModifier(**QUANT), permuted(data, seed),
                                      pipeline=None, **size)
            record("GPTQ", config, True, kl, seconds, samples=args.gptq_samples, seq_len=args.gptq_seq_len)
        recipe = ParallelGPTQExpertModifier(data_parallel=devices, **QUANT)
        kl, seconds = quantize_kl(reference, tokenizer, recipe, data, pipeline=PIPELINE_NAME, **size)
        record("GPTQ", f"ours, data_parallel {args.data_parallel}, {PIPELINE_NAME}, original order", False,
               kl, seconds, samples=args.gptq_samples, seq_len=args.gptq_seq_len)

    print("\n" + table(rows), flush=True)


if __name__ == "__main__":
    main()
