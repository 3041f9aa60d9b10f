"""Stock AutoRoundModifier on 1 GPU vs DataParallelAutoRoundModifier on 1..N GPUs, one run.

Random-weight layers at real shapes (Llama-3-8B dense, Qwen3-30B-A3B MoE), the same
calibration tokens for every configuration. Prints one JSON line per configuration
(per-layer time, speedup over stock, per-phase times, final block losses, peak
memory per GPU, agreement of the saved checkpoint with stock) and writes a PNG. `--gpus 1` runs ours on one GPU (`data_parallel="off"`):
what grouped experts alone give on an MoE layer.

    python bench/bench_autoround.py --shapes llama3-8b --gpus 2 4 \
        --samples 128 --seq-len 2048 --iters 50 --out bench/out
    python bench/bench_autoround.py --shapes qwen3-30b-a3b --gpus 1 2 --layers 1 --out bench/out
    python bench/bench_autoround.py --shapes qwen3-30b-a3b --gpus 1 2 --pipeline sequential parallel_sequential

Per-layer times come from a `--phases coarse` run (the default): the GPUs are
synchronised only at the edges of capture, reference, tuning and quantized-input.
`--phases fine` also times the tuning loop's forward, backward and step, at the cost of
three synchronisations an iteration: the host can no longer queue one part while the
GPUs finish the last, so every configuration runs slower than it does unmeasured.

Each configuration runs in a fresh process of its own (`--isolate on`, the default), as a
user's run does: no configuration inherits the state (host and GPU memory, caches) that
the ones before it left.

`--pipeline parallel_sequential` runs ours on >= 2 GPUs under that pipeline (the layers'
input-capture passes data-parallel too); its configs are named "-pp".
"""

from __future__ import annotations

import argparse
import gc
import itertools
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent / "tests"))

import llmcompressor_parallel  # noqa: E402,F401
from llmcompressor import oneshot  # noqa: E402
from llmcompressor.modifiers.autoround import AutoRoundModifier  # noqa: E402
from llmcompressor_parallel import DataParallelAutoRoundModifier  # noqa: E402
from phases import PhaseTimer, autoround_phases  # noqa: E402
from isolated import run_configuration  # noqa: E402
from report import bench_folders, emit, plot  # noqa: E402
from shapes import random_tokens, save_random_model  # noqa: E402


CACHE_CHOICES = {"default": None, "off": False, "on": True}


def _cache_suffix(gpus: int, keep_cache: bool | None) -> str:
    """How the config is named: "-gpucache" when auto-round's caches stay on the GPU."""
    on = gpus > 1 if keep_cache is None else keep_cache
    return "-gpucache" if on else ""


def _variant_suffix(gpus: int, tokens: str, qdq_once: bool, exact: bool = True) -> str:
    """How the config is named when it departs from the defaults: "-routed", "-qdq-each",
    "-split" (exact_gradients=False)."""
    suffix = "" if tokens == "auto" else f"-{tokens}"
    if gpus > 1:
        suffix += ("" if qdq_once else "-qdq-each") + ("" if exact else "-split")
    return suffix


def _modifier(gpus: int | None, args: argparse.Namespace, keep_cache: bool | None = None,
              tokens: str = "auto", qdq_once: bool = True, exact: bool = True, nan_fill: bool = False):
    """gpus=None: stock; else ours on that many devices (1: data_parallel="off")."""
    common = dict(targets="Linear", scheme="W4A16", ignore=["lm_head", "re:.*mlp.gate$"],
                  iters=args.iters, batch_size=args.batch_size, enable_torch_compile=False)
    if gpus is None:
        return AutoRoundModifier(**common)
    if gpus == 1:
        data_parallel = "off"
    else:
        data_parallel = ["cpu"] * gpus if args.cpu else gpus
    return DataParallelAutoRoundModifier(data_parallel=data_parallel, keep_cache_on_gpu=keep_cache,
                                         grouped_experts=not args.no_grouped,
                                         grouped_expert_tokens=tokens, grouped_qdq_once=qdq_once,
                                         exact_gradients=exact, nan_fill_new_tensors=nan_fill,
                                         **common)


def _run(model_dir: Path, gpus: int | None, args: argparse.Namespace, save_dir: Path | None,
         variant: tuple = ()) -> tuple[PhaseTimer, float]:
    timer = PhaseTimer()
    torch.manual_seed(0)
    start = time.perf_counter()
    extra = {"pipeline": variant[4]} if len(variant) > 4 and variant[4] != "sequential" else {}
    nan_fill = variant[5] if len(variant) > 5 else False
    with autoround_phases(timer, fine=args.phases == "fine"):
        oneshot(model=str(model_dir), dataset=random_tokens(args.samples, args.seq_len),
                recipe=_modifier(gpus, args, *variant[:4], nan_fill=nan_fill), num_calibration_samples=args.samples,
                max_seq_length=args.seq_len, output_dir=str(save_dir) if save_dir else None,
                **extra)
    return timer, time.perf_counter() - start


def _agreement(stock_dir: Path, ours_dir: Path) -> dict:
    from oneshot_runs import compare_checkpoints
    from tiny_models import load_saved_tensors

    return compare_checkpoints(load_saved_tensors(stock_dir), load_saved_tensors(ours_dir))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--shapes", nargs="+", default=["llama3-8b", "qwen3-30b-a3b"])
    parser.add_argument("--gpus", nargs="+", type=int, default=[2])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--samples", type=int, default=128)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--out", default="bench/out")
    parser.add_argument("--work", default=None, help="folder for models and checkpoints")
    parser.add_argument("--cache", nargs="+", choices=list(CACHE_CHOICES), default=["default"],
                        help="keep_cache_on_gpu of ours: default (the modifier's: on when data-parallel), "
                             "off, on; several run one after another")
    parser.add_argument("--no-grouped", action="store_true", help="ours without grouped experts")
    parser.add_argument("--expert-tokens", nargs="+", choices=["auto", "all", "routed"],
                        default=["auto"], help="grouped_expert_tokens of ours; several run in turn")
    parser.add_argument("--qdq-once", nargs="+", choices=["on", "off"], default=["on"],
                        help="grouped_qdq_once of ours on >= 2 GPUs (off: each replica computes "
                             "its own qdq from the tuning parameters sent to it); several run in turn")
    parser.add_argument("--exact", nargs="+", choices=["on", "off"], default=["on"],
                        help="exact_gradients of ours on >= 2 GPUs (off: each replica sums its own "
                             "rows' weight gradients); several run in turn")
    parser.add_argument("--pipeline", nargs="+", choices=["sequential", "parallel_sequential"],
                        default=["sequential"], help="oneshot pipeline of ours on >= 2 GPUs "
                        "(parallel_sequential: capture passes data-parallel); several run in turn")
    parser.add_argument("--nan-fill", nargs="+", choices=["off", "on"], default=["off"],
                        help="nan_fill_new_tensors; configs with it on are named \"-nanfill\"")
    parser.add_argument("--phases", choices=["coarse", "fine"], default="coarse",
                        help="fine: also time the tuning loop's forward/backward/step, which "
                             "synchronises the GPUs three times an iteration and slows the layer")
    parser.add_argument("--cpu", action="store_true", help="smoke test: CPU replicas instead of GPUs")
    parser.add_argument("--isolate", choices=["on", "off"], default="on",
                        help="on: each configuration in a fresh process of its own (a user's run); "
                             "off: all in this process, one after the other")
    args = parser.parse_args()
    out, work = bench_folders(args.out, args.work, prefix="llmc-bench-")
    records = []
    for shape in args.shapes:
        model_dir = save_random_model(shape, args.layers, work / f"{shape}-{args.layers}-layers")
        stock_seconds = None
        configs = {"stock-1gpu": (None, ())}
        for cache, tokens, qdq, exact, pipeline, nan_fill, g in itertools.product(
            args.cache, args.expert_tokens, args.qdq_once, args.exact, args.pipeline, args.nan_fill,
            args.gpus,
        ):
            # by name: "default" on 2 GPUs and "on" are one configuration; qdq, exact and
            # the pipeline are moot on 1
            keep_cache = CACHE_CHOICES[cache]
            pipeline = pipeline if g > 1 else "sequential"
            variant = (keep_cache, tokens, qdq == "on", exact == "on", pipeline, nan_fill == "on")
            name = (f"ours-{g}gpu" + _cache_suffix(g, keep_cache) + _variant_suffix(g, *variant[1:4])
                    + ("-pp" if pipeline == "parallel_sequential" else "")
                    + ("-nanfill" if nan_fill == "on" else ""))
            configs.setdefault(name, (g, variant))
        for name, (gpus, variant) in configs.items():
            if gpus is not None and not args.cpu and gpus > torch.cuda.device_count():
                emit({"shape": shape, "config": name, "skipped": "not enough GPUs"}, out)
                continue
            save_dir = work / f"{shape}-{name}"
            (timer, total), peaks = run_configuration(args.isolate == "on", _run, model_dir, gpus, args,
                                                      save_dir, variant)
            layer = timer.layers[-1]  # the last layer: warm, steady state
            seconds = layer["capture"] + layer["layer_work"]
            record = {
                "bench": "autoround", "shape": shape, "config": name,
                "gpus": gpus or 1, "samples": args.samples, "seq_len": args.seq_len, "iters": args.iters,
                "phase_timing": args.phases,
                "seconds_per_layer": round(seconds, 3),
                "phases": {k: round(v, 3) for k, v in layer.items()},
                "all_layers": [{k: round(v, 3) for k, v in l.items()} for l in timer.layers],
                "block_losses": timer.losses, "total_seconds": round(total, 1),
                "peak_memory_gib": peaks, "isolated": args.isolate == "on",
            }
            if gpus is None:
                stock_seconds, stock_tuning, stock_layer = seconds, layer.get("tuning", 0.0), layer
            else:
                record["speedup"] = round(stock_seconds / seconds, 3)
                record["tuning_speedup"] = round(stock_tuning / max(layer.get("tuning", 1e-9), 1e-9), 3)
                record["phase_speedups"] = {k: round(stock_layer[k] / max(layer.get(k, 1e-9), 1e-9), 3)
                                            for k in stock_layer}
                record["parallel_efficiency"] = round(record["tuning_speedup"] / gpus, 3)
                (record["keep_cache_on_gpu"], record["expert_tokens"], record["qdq_once"],
                 record["exact_gradients"], record["pipeline"], record["nan_fill_new_tensors"]) = variant
                record["vs_stock_checkpoint"] = _agreement(work / f"{shape}-stock-1gpu", save_dir)
            emit(record, out)
            records.append(record)
            gc.collect()
            torch.cuda.empty_cache()
    plot([r for r in records if "seconds_per_layer" in r], out / "autoround.png",
         f"AutoRound W4A16, {args.samples}x{args.seq_len} tokens, iters={args.iters}")


if __name__ == "__main__":
    main()
