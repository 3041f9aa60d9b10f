"""Where the time of one layer goes: diagnostics for the GPU machine, not a benchmark.

`gptq-pass`: ours (parallel_sequential) on a random-weight layer, with the pieces of
each data-parallel pass timed (replica build, per-part fetch / forward / offload
copies, Hessian merge, release); every timed piece synchronises its device, so the
sum runs slower than the bench: read it for proportions.
`autoround-profile`: torch.profiler over one layer's `quantize_block` (ours), top ops
by GPU time and by host time, and the wall time to compare the GPUs' busy time with.
`autoround-host`: cProfile over the last layer's whole per-layer work (ours:
`on_sequential_epoch_end`, from auto-round's set-up to llm-compressor's write-back),
the Python functions by cumulative time; the stats file goes to --out for pstats.

    python bench/probe.py gptq-pass --shape llama3-8b --gpus 2
    python bench/probe.py autoround-profile --shape qwen3-30b-a3b --gpus 1 --iters 10
    python bench/probe.py autoround-host --shape qwen3-30b-a3b --gpus 1 --iters 50 --out bench/out
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent / "tests"))

from llmcompressor import oneshot  # noqa: E402

import llmcompressor_parallel.calibration_pipeline as pipeline  # noqa: E402
import llmcompressor_parallel.modifiers.autoround as autoround_module  # noqa: E402
from llmcompressor_parallel import (  # noqa: E402
    DataParallelAutoRoundModifier,
    ParallelGPTQExpertModifier,
)
from phases import patched, sync_gpus  # noqa: E402
from report import bench_folders  # noqa: E402
from shapes import random_tokens, save_random_model  # noqa: E402

COMMON = dict(targets="Linear", scheme="W4A16", ignore=["lm_head", "re:.*mlp.gate$"])
TIMES: dict[tuple[str, str], float] = collections.defaultdict(float)


def _timed_as(key: str, sync: Callable[[], None]) -> Callable[[Callable], Callable]:
    """A `patched` maker: each call's time, between synchronisations, added to TIMES[key, thread]."""

    def make(real: Callable) -> Callable:
        def timed(*args: Any, **kwargs: Any) -> Any:
            sync()
            start = time.perf_counter()
            try:
                return real(*args, **kwargs)
            finally:
                sync()
                TIMES[(key, threading.current_thread().name)] += time.perf_counter() - start

        return timed

    return make


def _sync_current() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _devices(count: int) -> list[str]:
    """The first `count` GPUs; CPU devices where there is none (smoke test)."""
    if torch.cuda.is_available():
        return [f"cuda:{i}" for i in range(count)]
    return ["cpu"] * count


def gptq_pass(args: argparse.Namespace, work: Path) -> None:
    model_dir = save_random_model(args.shape, 2, work / f"{args.shape}-2-layers")
    devices = _devices(args.gpus)
    recipe = ParallelGPTQExpertModifier(data_parallel=devices if args.gpus > 1 else "off", **COMMON)
    with contextlib.ExitStack() as stack:
        for owner, name, key, sync in [
            (pipeline, "SubgraphReplicas", "replicas build", sync_gpus),
            (pipeline._PassRunner, "_parallel", "pass (all parts)", sync_gpus),
            (pipeline.IntermediatesCache, "fetch", "fetch via home", _sync_current),
            (pipeline, "fetch_to", "fetch to own device", _sync_current),
            (pipeline.Subgraph, "forward", "subgraph forward", _sync_current),
            (pipeline, "_offload_copies", "offload copies", _sync_current),
            (pipeline, "_store", "store (under lock)", _sync_current),
            (type(recipe), "end_parallel_calibration", "Hessian merge", sync_gpus),
            (type(recipe), "on_sequential_epoch_end", "updates", sync_gpus),
        ]:
            stack.enter_context(patched(owner, name, _timed_as(key, sync)))
        start = time.perf_counter()
        oneshot(model=str(model_dir), dataset=random_tokens(args.samples, args.seq_len),
                recipe=recipe, num_calibration_samples=args.samples,
                max_seq_length=args.seq_len, shuffle_calibration_samples=False,
                pipeline="parallel_sequential")
        total = time.perf_counter() - start
    print(f"oneshot {total:.2f} s (2 layers; every piece below synchronises its device)")
    for (key, thread), seconds in sorted(TIMES.items()):
        print(f"  {key:24s} {thread:28s} {seconds:8.3f} s")


def autoround_profile(args: argparse.Namespace, work: Path) -> None:
    from torch.profiler import ProfilerActivity, profile

    model_dir = save_random_model(args.shape, 1, work / f"{args.shape}-1-layers")
    recipe = DataParallelAutoRoundModifier(
        data_parallel=_devices(args.gpus) if args.gpus > 1 else "off", iters=args.iters, batch_size=8,
        enable_torch_compile=False, grouped_expert_tokens=args.expert_tokens, **COMMON,
    )
    state: dict[str, Any] = {}

    def enter(real: Callable) -> Callable:  # the grouped experts' context spans quantize_block
        def profiled(self):
            sync_gpus()
            state["profiler"] = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
            state["profiler"].__enter__()
            state["start"] = time.perf_counter()
            return real(self)

        return profiled

    def exit_(real: Callable) -> Callable:
        def profiled(self, *exc):
            result = real(self, *exc)
            sync_gpus()
            state["wall"] = time.perf_counter() - state["start"]
            state["profiler"].__exit__(None, None, None)
            return result

        return profiled

    grouped = autoround_module.GroupedAutoRoundExperts
    with patched(grouped, "__enter__", enter), patched(grouped, "__exit__", exit_):
        oneshot(model=str(model_dir), dataset=random_tokens(args.samples, args.seq_len),
                recipe=recipe, num_calibration_samples=args.samples, max_seq_length=args.seq_len)
    events = state["profiler"].key_averages()
    print(f"quantize_block wall {state['wall']:.2f} s on {args.gpus} GPU(s), iters {args.iters} "
          "(GPU busy time: the tables' 'Self CUDA time total', summed over the GPUs)")
    print(events.table(sort_by="self_device_time_total", row_limit=args.rows))
    print(events.table(sort_by="self_cpu_time_total", row_limit=args.rows))


def autoround_host(args: argparse.Namespace, work: Path, out: Path) -> None:
    import cProfile
    import pstats

    model_dir = save_random_model(args.shape, 2, work / f"{args.shape}-2-layers")
    recipe = DataParallelAutoRoundModifier(
        data_parallel=_devices(args.gpus) if args.gpus > 1 else "off", iters=args.iters, batch_size=8,
        enable_torch_compile=False, grouped_expert_tokens=args.expert_tokens,
        exact_gradients=args.exact == "on", **COMMON,
    )
    profiler, state = cProfile.Profile(), {"calls": 0}

    def epoch_end(real: Callable) -> Callable:  # the third subgraph: the second decoder layer
        def profiled(self, *call_args, **call_kwargs):
            state["calls"] += 1
            if state["calls"] != 3:
                return real(self, *call_args, **call_kwargs)
            sync_gpus()
            start = time.perf_counter()
            profiler.enable()
            try:
                return real(self, *call_args, **call_kwargs)
            finally:
                sync_gpus()
                profiler.disable()
                state["wall"] = time.perf_counter() - start

        return profiled

    with patched(DataParallelAutoRoundModifier, "on_sequential_epoch_end", epoch_end):
        oneshot(model=str(model_dir), dataset=random_tokens(args.samples, args.seq_len),
                recipe=recipe, num_calibration_samples=args.samples, max_seq_length=args.seq_len)
    path = out / f"autoround-host-{args.shape}-{args.gpus}gpu.prof"
    profiler.dump_stats(str(path))
    print(f"last layer's on_sequential_epoch_end: {state['wall']:.2f} s wall on {args.gpus} GPU(s), "
          f"iters {args.iters}; stats in {path}")
    pstats.Stats(profiler).sort_stats("cumulative").print_stats(args.rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("probe", choices=["gptq-pass", "autoround-profile", "autoround-host"])
    parser.add_argument("--shape", default="llama3-8b")
    parser.add_argument("--gpus", type=int, default=2)
    parser.add_argument("--samples", type=int, default=128)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--expert-tokens", default="auto", choices=["auto", "all", "routed"])
    parser.add_argument("--exact", default="on", choices=["on", "off"], help="exact_gradients (autoround-host)")
    parser.add_argument("--rows", type=int, default=25)
    parser.add_argument("--out", default="bench/out")
    parser.add_argument("--work", default=None)
    args = parser.parse_args()
    out, work = bench_folders(args.out, args.work, prefix="llmc-probe-")
    if args.probe == "autoround-host":
        autoround_host(args, work, out)
    else:
        {"gptq-pass": gptq_pass, "autoround-profile": autoround_profile}[args.probe](args, work)


if __name__ == "__main__":
    main()
