"""Stock GPTQModifier on 1 GPU vs ParallelGPTQExpertModifier on 1..N GPUs, one run.

Random-weight layers at real shapes (Qwen3-30B-A3B and Qwen3-235B-A22B MoE, Llama-3-8B
dense), the same calibration tokens for every configuration. Ours runs under the
"parallel_sequential" pipeline (calibration forwards data-parallel) with the update pool,
and with grouped experts unless --no-grouped. Prints one JSON line per configuration:
per-layer time and speedup, per-phase times (calibration, updates, propagation), peak
memory per GPU, agreement of the saved checkpoint with stock; writes a PNG. Each
configuration runs in a fresh process of its own (`--isolate on`, bench/isolated.py).

    python bench/bench_gptq.py --shapes qwen3-30b-a3b llama3-8b --gpus 1 2 --samples 128 --out bench/out
    python bench/bench_gptq.py --shapes qwen3-235b-a22b --gpus 1 2 --samples 64 --out bench/out
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent / "tests"))

import llmcompressor_parallel  # noqa: E402,F401
from llmcompressor import oneshot  # noqa: E402
from llmcompressor.modifiers.gptq import GPTQModifier  # noqa: E402
from llmcompressor_parallel import ParallelGPTQExpertModifier  # noqa: E402
from oneshot_runs import compare_checkpoints  # noqa: E402
from phases import PhaseTimer, gptq_phases  # noqa: E402
from isolated import run_configuration  # noqa: E402
from report import bench_folders, emit, plot  # noqa: E402
from shapes import random_tokens, save_random_model  # noqa: E402
from tiny_models import load_saved_tensors  # noqa: E402

COMMON = dict(targets="Linear", scheme="W4A16", ignore=["lm_head", "re:.*mlp.gate$"])


def _run(model_dir: Path, gpus: int | None, args: argparse.Namespace, save_dir: Path) -> tuple[PhaseTimer, float]:
    """gpus=None: stock; else ours on that many devices (cpu replicas with --cpu)."""
    if gpus is None:
        recipe, pipeline = GPTQModifier(**COMMON), None
    else:
        devices = (["cpu"] * gpus if args.cpu else [f"cuda:{i}" for i in range(gpus)])
        recipe = ParallelGPTQExpertModifier(
            data_parallel=devices if gpus > 1 else "off", grouped_experts=not args.no_grouped, **COMMON
        )
        pipeline = "parallel_sequential"
    timer = PhaseTimer()
    torch.manual_seed(0)
    start = time.perf_counter()
    with gptq_phases(timer):
        oneshot(model=str(model_dir), dataset=random_tokens(args.samples, args.seq_len), recipe=recipe,
                num_calibration_samples=args.samples, max_seq_length=args.seq_len,
                shuffle_calibration_samples=False, output_dir=str(save_dir),
                **({"pipeline": pipeline} if pipeline else {}))
    return timer, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--shapes", nargs="+", default=["qwen3-30b-a3b", "llama3-8b"])
    parser.add_argument("--gpus", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--samples", type=int, default=128)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--no-grouped", action="store_true", help="ours without grouped experts")
    parser.add_argument("--out", default="bench/out")
    parser.add_argument("--work", default=None, help="folder for models and checkpoints")
    parser.add_argument("--cpu", action="store_true", help="smoke test: CPU replicas instead of GPUs")
    parser.add_argument("--isolate", choices=["on", "off"], default="on",
                        help="on: each configuration in a fresh process of its own (a user's run); "
                             "off: all in this process, one after the other")
    args = parser.parse_args()
    out, work = bench_folders(args.out, args.work, prefix="llmc-bench-gptq-")
    records = []
    for shape in args.shapes:
        model_dir = save_random_model(shape, args.layers, work / f"{shape}-{args.layers}-layers")
        stock = None
        for gpus in [None, *args.gpus]:
            name = "stock-1gpu" if gpus is None else f"ours-{gpus}gpu"
            if gpus is not None and not args.cpu and gpus > torch.cuda.device_count():
                emit({"bench": "gptq", "shape": shape, "config": name, "skipped": "not enough GPUs"}, out)
                continue
            save_dir = work / f"{shape}-{name}"
            (timer, total), peaks = run_configuration(args.isolate == "on", _run, model_dir, gpus, args,
                                                      save_dir)
            layer = timer.layers[-1]
            seconds = sum(layer.values())
            record = {
                "bench": "gptq", "shape": shape, "config": name, "gpus": gpus or 1,
                "samples": args.samples, "seq_len": args.seq_len, "seconds_per_layer": round(seconds, 3),
                "phases": {k: round(v, 3) for k, v in layer.items()},
                "all_layers": [{k: round(v, 3) for k, v in l.items()} for l in timer.layers],
                "total_seconds": round(total, 1), "peak_memory_gib": peaks,
                "isolated": args.isolate == "on",
            }
            if stock is None:
                stock = layer
            else:
                record["speedup"] = round(sum(stock.values()) / seconds, 3)
                record["phase_speedups"] = {k: round(stock[k] / max(layer.get(k, 1e-9), 1e-9), 3)
                                            for k in stock}
                record["vs_stock_checkpoint"] = compare_checkpoints(
                    load_saved_tensors(work / f"{shape}-stock-1gpu"), load_saved_tensors(save_dir))
            emit(record, out)
            records.append(record)
            gc.collect()
            torch.cuda.empty_cache()
    plot(records, out / "gptq.png", f"GPTQ W4A16, {args.samples}x{args.seq_len} tokens")


if __name__ == "__main__":
    main()
