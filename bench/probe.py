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
`autoround-capture`: the same over the second decoder layer's input-capture pass (the
pipeline's calibration forwards between the first and the second layer's epoch ends).
`autoround-timeline`: torch.profiler over tuning iterations --skip+1 .. --skip+--window
of the second decoder layer (no synchronisation inside): per GPU, the seconds it was busy
(kernels and copies, overlaps counted once) against the window's wall time, its largest
idle gaps, its top kernels; per host thread, the busy seconds of its top-level ops; then
one middle iteration: each GPU's busy share in 5 ms bins and the calling thread's long ops.
Says whether an iteration waits on a GPU or on the host. The trace goes to --out, gzipped.
`autoround-call-parts`: the host milliseconds of each piece of a fanned-out call's
preparation (replica sync, plan and module checks, hooks, copies), per call.
`expert-split-bits`: whether cutting a layer's experts into ranges, one per GPU, keeps
every bit: the all-token weight-gradient bmm of each range against the whole bmm's
rows, and auto-round's int qdq (forward, and the gradients of value, min_scale and
max_scale) of each range's stacked rows against the whole stack's.
`gptq-updates`: the same over the last layer's GPTQ update phase (`compress_modules`).
`gptq-update-variants`: ours once per scheduling variant of the GPTQ update pool (see
GPTQ_UPDATE_VARIANTS): each layer's update phase, the serial pieces before the pool (Hessian
merge, qparams gathering), the pool's jobs' timeline and the write-back.
`gptq-rowsplit`: stock `quantize_weight` on one update batch against the same batch cut
by rows over the GPUs (same Hessians on each): equal bits? and the seconds of each,
of the Hessian factorisation alone, and of the halves run at once from two threads.

    python bench/probe.py gptq-pass --shape llama3-8b --gpus 2
    python bench/probe.py autoround-profile --shape qwen3-30b-a3b --gpus 1 --iters 10
    python bench/probe.py autoround-host --shape qwen3-30b-a3b --gpus 1 --iters 50 --out bench/out
    python bench/probe.py autoround-capture --shape qwen3-30b-a3b --gpus 1 --iters 2 --out bench/out
    python bench/probe.py autoround-timeline --shape qwen3-30b-a3b --gpus 2 --iters 20 --out bench/out
    python bench/probe.py autoround-call-parts --shape tiny-moe-128 --gpus 2 --iters 50 --samples 16 --seq-len 64
    python bench/probe.py expert-split-bits --gpus 2
    python bench/probe.py gptq-updates --shape llama3-8b --gpus 2 --samples 16 --out bench/out
    python bench/probe.py gptq-update-variants --shape qwen3-235b-a22b --gpus 2 --samples 16
    python bench/probe.py gptq-rowsplit --gpus 2
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, NamedTuple

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
import llmcompressor_parallel.modifiers.gptq as parallel_gptq_module  # noqa: E402
from phases import PhaseTimer, gptq_phases, patched, sync_gpus  # noqa: E402
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


def _profiled_window(out: Path, label: str, args: argparse.Namespace):
    """A cProfile window: its state, start and stop, a call run inside it, the report."""
    import cProfile

    state: dict[str, Any] = {"calls": 0, "open": False}

    def start() -> None:  # a fresh profile: the last window opened is the one reported
        sync_gpus()
        state["profiler"] = cProfile.Profile()
        state["start"], state["open"] = time.perf_counter(), True
        state["profiler"].enable()

    def stop() -> None:
        if state.pop("open", False):
            sync_gpus()
            state["profiler"].disable()
            state["wall"] = time.perf_counter() - state["start"]

    def profiled_call(real: Callable, *args: Any, **kwargs: Any) -> Any:
        start()
        try:
            return real(*args, **kwargs)
        finally:
            stop()

    def report() -> None:
        import pstats

        profiler = state["profiler"]
        path = out / f"{label}-{args.shape}-{args.gpus}gpu.prof"
        profiler.dump_stats(str(path))
        print(f"{label}: {state['wall']:.2f} s wall on {args.gpus} GPU(s); stats in {path}")
        pstats.Stats(profiler).sort_stats("cumulative").print_stats(args.rows)
        pstats.Stats(profiler).sort_stats("tottime").print_stats(args.rows)

    return state, start, stop, profiled_call, report


def autoround_window(args: argparse.Namespace, work: Path, out: Path) -> None:
    """cProfile of the second decoder layer's per-layer work or of its capture pass."""
    model_dir = save_random_model(args.shape, 2, work / f"{args.shape}-2-layers")
    recipe = DataParallelAutoRoundModifier(
        data_parallel=_devices(args.gpus) if args.gpus > 1 else "off", iters=args.iters, batch_size=8,
        enable_torch_compile=False, grouped_expert_tokens=args.expert_tokens,
        exact_gradients=args.exact == "on", **COMMON,
    )
    label = args.probe
    state, start, stop, profiled_call, report = _profiled_window(out, label, args)

    def epoch_end(real: Callable) -> Callable:  # the third subgraph: the second decoder layer
        def profiled(self, *call_args, **call_kwargs):
            state["calls"] += 1
            if label == "autoround-capture":
                stop()
                result = real(self, *call_args, **call_kwargs)
                if state["calls"] == 2:
                    start()
                return result
            if state["calls"] != 3:
                return real(self, *call_args, **call_kwargs)
            return profiled_call(real, self, *call_args, **call_kwargs)

        return profiled

    with patched(DataParallelAutoRoundModifier, "on_sequential_epoch_end", epoch_end):
        oneshot(model=str(model_dir), dataset=random_tokens(args.samples, args.seq_len),
                recipe=recipe, num_calibration_samples=args.samples, max_seq_length=args.seq_len)
    report()


def autoround_timeline(args: argparse.Namespace, work: Path, out: Path) -> None:
    """torch.profiler over a window of the second layer's tuning iterations, summarised."""
    from auto_round.algorithms.quantization.sign_round.quantizer import SignRoundQuantizer
    from torch.profiler import ProfilerActivity, profile

    model_dir = save_random_model(args.shape, 2, work / f"{args.shape}-2-layers")
    recipe = DataParallelAutoRoundModifier(
        data_parallel=_devices(args.gpus) if args.gpus > 1 else "off", iters=args.iters, batch_size=8,
        enable_torch_compile=False, **COMMON,
    )
    state: dict[str, Any] = {"steps": 0}
    first, last = args.iters + args.skip, args.iters + args.skip + args.window  # layer 2's steps

    def step(real: Callable) -> Callable:
        def counted(self, *call_args, **call_kwargs):
            result = real(self, *call_args, **call_kwargs)
            state["steps"] += 1
            if state["steps"] == first:
                sync_gpus()
                state["profiler"] = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
                state["profiler"].__enter__()
                state["start"] = time.perf_counter()
            elif state["steps"] == last:
                sync_gpus()
                state["wall"] = time.perf_counter() - state["start"]
                state["profiler"].__exit__(None, None, None)
            return result

        return counted

    with patched(SignRoundQuantizer, "_step", step):
        oneshot(model=str(model_dir), dataset=random_tokens(args.samples, args.seq_len),
                recipe=recipe, num_calibration_samples=args.samples, max_seq_length=args.seq_len)
    trace = out / f"autoround-timeline-{args.shape}-{args.gpus}gpu.json"
    state["profiler"].export_chrome_trace(str(trace))
    print(f"autoround-timeline: {args.window} iterations of layer 2, {state['wall']:.3f} s wall "
          f"({state['wall'] / args.window * 1e3:.1f} ms an iteration) on {args.gpus} GPU(s)")
    print(summarise_trace(trace, args.rows))
    import gzip
    import shutil

    with open(trace, "rb") as raw, gzip.open(f"{trace}.gz", "wb", compresslevel=6) as packed:
        shutil.copyfileobj(raw, packed)
    trace.unlink()


def autoround_call_parts(args: argparse.Namespace, work: Path, out: Path) -> None:
    """Host seconds of each piece of a fanned-out call's preparation, per call, over a
    whole run (plan builds included): what runs in the calling thread before the
    workers start, on the iteration's critical path. Meaningful on a CPU too (shape
    tiny-moe-128), since these pieces are host work."""
    import functools

    import llmcompressor_parallel.engine.exact_weight_grads as exact_grads
    import llmcompressor_parallel.engine.fan_out as fan_out
    import llmcompressor_parallel.engine.grouped_autoround as grouped
    import llmcompressor_parallel.engine.replicate as replicate

    seconds: dict[str, float] = collections.defaultdict(float)
    calls: collections.Counter = collections.Counter()
    pieces = [
        (fan_out.FanOut, "_call", "FanOut._call (everything)"),
        (fan_out, "foreign_hooks", "hooks inside the layer"),
        (replicate.ReplicaSet, "sync", "ReplicaSet.sync"),
        (replicate.ReplicaSet, "_current_structure", "  its structure walk"),
        (fan_out, "_participants", "participants lookup"),
        (grouped.GroupedAutoRoundExperts, "prepare_fan_out", "grouped experts' preparation"),
        (grouped._Site, "plan_for", "  plan checks (plan_for)"),
        (grouped, "_module_reason", "  module checks (_module_reason)"),
        (grouped.GroupedAutoRoundExperts, "_split_by_experts", "  experts' qdq by range (device work)"),
        (exact_grads.ExactWeightGradients, "prepare_fan_out", "exact gradients' preparation"),
        (replicate.ReplicaSet, "install_trainable_copies", "trainable copies"),
    ]

    def timing(owner: Any, name: str, label: str) -> Callable[[Callable], Callable]:
        def make(real: Callable) -> Callable:
            @functools.wraps(real)
            def timed(*call_args: Any, **call_kwargs: Any) -> Any:
                start = time.perf_counter()
                try:
                    return real(*call_args, **call_kwargs)
                finally:
                    seconds[label] += time.perf_counter() - start
                    calls[label] += 1
            return staticmethod(timed) if isinstance(vars(owner).get(name), staticmethod) else timed
        return make

    model_dir = save_random_model(args.shape, 2, work / f"{args.shape}-2-layers")
    recipe = DataParallelAutoRoundModifier(
        data_parallel=_devices(args.gpus), iters=args.iters, batch_size=8, enable_torch_compile=False,
        **COMMON,
    )
    with contextlib.ExitStack() as stack:
        for owner, name, label in pieces:
            stack.enter_context(patched(owner, name, timing(owner, name, label)))
        oneshot(model=str(model_dir), dataset=random_tokens(args.samples, args.seq_len),
                recipe=recipe, num_calibration_samples=args.samples, max_seq_length=args.seq_len)
    total = calls["FanOut._call (everything)"]
    print(f"autoround-call-parts: {total} fanned-out calls, {args.shape}, {args.gpus} devices; ms per call:")
    for _, _, label in pieces:
        print(f"  {label:42s} {seconds[label] / max(total, 1) * 1e3:8.2f}  ({calls[label]} calls)")


def _union_seconds(spans: list[tuple[float, float]]) -> tuple[float, list[float]]:
    """Seconds covered by `spans` (microsecond start, end), and the gaps between them."""
    busy, gaps, end = 0.0, [], None
    for start, stop in sorted(spans):
        if end is None or start > end:
            if end is not None:
                gaps.append(start - end)
            busy += stop - start
            end = stop
        elif stop > end:
            busy += stop - end
            end = stop
    return busy / 1e6, [gap / 1e6 for gap in gaps]


def summarise_trace(path: Path, rows: int) -> str:
    """Per GPU: busy seconds, largest gaps, top kernels; per host thread: busy seconds."""
    import json

    events = [e for e in json.loads(path.read_text())["traceEvents"] if e.get("ph") == "X"]
    device_kinds = {"kernel", "gpu_memcpy", "gpu_memset"}
    lines = []
    window = [min(e["ts"] for e in events), max(e["ts"] + e.get("dur", 0) for e in events)]
    lines.append(f"trace window {(window[1] - window[0]) / 1e6:.3f} s")
    by_device: dict[Any, list] = collections.defaultdict(list)
    for event in events:
        if event.get("cat") in device_kinds:
            by_device[event.get("args", {}).get("device")].append(event)
    for device, kernels in sorted(by_device.items(), key=lambda item: str(item[0])):
        busy, gaps = _union_seconds([(e["ts"], e["ts"] + e.get("dur", 0)) for e in kernels])
        gaps.sort(reverse=True)
        lines.append(f"GPU {device}: busy {busy:.3f} s, {len(kernels)} kernels/copies; "
                     f"gaps > 1 ms: {sum(g > 1e-3 for g in gaps)} totalling {sum(g for g in gaps if g > 1e-3):.3f} s; "
                     f"largest {', '.join(f'{g * 1e3:.1f}' for g in gaps[:5])} ms")
        totals: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0])
        for e in kernels:
            totals[e["name"][:90]][0] += e.get("dur", 0) / 1e6
            totals[e["name"][:90]][1] += 1
        for name, (seconds, count) in sorted(totals.items(), key=lambda item: -item[1][0])[:rows]:
            lines.append(f"    {seconds:8.3f} s {count:6d}x  {name}")
    by_thread: dict[Any, list] = collections.defaultdict(list)
    for event in events:
        if event.get("cat") in ("cpu_op", "python_function", "user_annotation", "cuda_runtime", "cuda_driver"):
            by_thread[event.get("tid")].append(event)
    for thread, ops in sorted(by_thread.items(), key=lambda item: -len(item[1])):
        busy, _ = _union_seconds([(e["ts"], e["ts"] + e.get("dur", 0)) for e in ops])
        runtime = [e for e in ops if e.get("cat") in ("cuda_runtime", "cuda_driver")]
        runtime_busy, _ = _union_seconds([(e["ts"], e["ts"] + e.get("dur", 0)) for e in runtime])
        lines.append(f"host thread {thread}: in ops {busy:.3f} s ({len(ops)} events), of it in the CUDA "
                     f"runtime {runtime_busy:.3f} s ({len(runtime)} calls)")
        totals = collections.defaultdict(lambda: [0.0, 0])
        for e in runtime:
            totals[e["name"]][0] += e.get("dur", 0) / 1e6
            totals[e["name"]][1] += 1
        for name, (seconds, count) in sorted(totals.items(), key=lambda item: -item[1][0])[:6]:
            lines.append(f"    {seconds:8.3f} s {count:6d}x  {name}")
    lines += _one_iteration(events, device_kinds)
    return "\n".join(lines)


def _one_iteration(events: list[dict], device_kinds: set[str]) -> list[str]:
    """A middle tuning iteration (between two optimizer steps): each GPU's busy share in
    5 ms bins, and the calling thread's top-level ops longer than 0.5 ms."""
    steps = sorted((e for e in events if e["name"].startswith("Optimizer.step")
                    and e.get("cat") == "user_annotation"), key=lambda e: e["ts"])
    if len(steps) < 3:
        return []
    middle = len(steps) // 2
    start = steps[middle - 1]["ts"] + steps[middle - 1]["dur"]
    stop = steps[middle]["ts"] + steps[middle]["dur"]
    lines = [f"one iteration ({(stop - start) / 1e3:.1f} ms), GPU busy % per 5 ms bin:"]
    kernels = [e for e in events if e.get("cat") in device_kinds and start <= e["ts"] < stop]
    for device in sorted({e.get("args", {}).get("device") for e in kernels}, key=str):
        spans = [(e["ts"], e["ts"] + e.get("dur", 0)) for e in kernels if e.get("args", {}).get("device") == device]
        bins = []
        for left in range(int(start), int(stop), 5000):
            right = min(left + 5000, stop)
            busy, _ = _union_seconds([(max(a, left), min(b, right)) for a, b in spans if a < right and b > left])
            bins.append(f"{busy * 1e6 / (right - left) * 100:3.0f}")
        lines.append(f"  GPU {device}: {' '.join(bins)}")
    caller = steps[middle]["tid"]
    ops = sorted((e for e in events if e.get("tid") == caller and e.get("cat") in ("cpu_op", "user_annotation")
                  and start <= e["ts"] < stop), key=lambda e: (e["ts"], -e.get("dur", 0)))
    end = -1.0
    lines.append(f"  calling thread {caller}, top-level ops over 0.5 ms:")
    for op in ops:
        if op["ts"] >= end:
            end = op["ts"] + op.get("dur", 0)
            if op.get("dur", 0) > 500:
                lines.append(f"    +{(op['ts'] - start) / 1e3:7.1f} ms {op['dur'] / 1e3:6.1f} ms  {op['name'][:80]}")
    return lines


def expert_split_bits(args: argparse.Namespace, work: Path, out: Path) -> None:
    """Bits of per-range expert work against the whole layer's (see the docstring)."""
    from auto_round.data_type.int import quant_tensor_sym

    devices = [torch.device(d) for d in _devices(args.gpus)]
    torch.manual_seed(0)  # tensors are drawn on the home device: GPU-sized ones
    experts, hidden, inter, tokens, top_k = 128, 2048, 768, args.samples * 128, 8
    ranges = split_row_ranges(experts, len(devices), multiple=1)
    home = devices[0]
    pick = torch.rand(tokens, experts, device=home).argsort(-1)[:, :top_k]
    routed = torch.zeros(experts, tokens, dtype=torch.bool, device=home)
    routed[pick.t(), torch.arange(tokens, device=home)] = True

    def all_token(columns: int) -> torch.Tensor:  # routed rows among zeros, bf16
        values = torch.randn(experts, tokens, columns, device=home, dtype=torch.bfloat16)
        return values * routed[..., None]

    shared = torch.randn(tokens, hidden, device=home, dtype=torch.bfloat16)
    for name, x, dy in [("gate/up (shared input)", shared.unsqueeze(0).expand(experts, -1, -1), all_token(inter)),
                        ("down", all_token(inter), all_token(hidden))]:
        whole = x.transpose(1, 2).bmm(dy)
        equal = True
        for (a, b), device in zip(ranges, devices):
            with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
                piece = x[a:b].to(device).transpose(1, 2).bmm(dy[a:b].to(device))
            equal &= torch.equal(piece.to(home), whole[a:b])
        print(f"weight-gradient bmm, {name}, experts {ranges}: bits equal: {equal}")
        del whole, dy
    for rows_per_expert, columns in [(2 * inter, hidden), (hidden, inter)]:
        weight = (torch.randn(experts * rows_per_expert, columns, device=home) * 0.02).to(torch.bfloat16)
        groups = experts * rows_per_expert * columns // 128
        params = {"v": torch.rand(groups, 128, device=home) - 0.5,  # as auto-round's wrapper shapes it
                  "min_scale": torch.rand(groups, device=home) * 0.5 + 0.5,
                  "max_scale": torch.rand(groups, device=home) * 0.5 + 0.5}
        grad_out = torch.randn(weight.shape, device=home)

        def qdq(rows: slice, device: torch.device) -> tuple[torch.Tensor, dict]:
            group_rows = slice(rows.start * columns // 128, rows.stop * columns // 128)
            leaves = {k: v[group_rows].to(device).requires_grad_() for k, v in params.items()}
            with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
                q, _, _ = quant_tensor_sym(weight[rows].to(device).float(), bits=4, group_size=128,
                                           scale_dtype=torch.float16, **leaves)
                q.backward(grad_out[rows].to(device))
            return q.detach(), {k: v.grad for k, v in leaves.items()}

        whole, whole_grads = qdq(slice(0, weight.shape[0]), home)
        equal = {"qdq": True, "v": True, "min_scale": True, "max_scale": True}
        for (a, b), device in zip(ranges, devices):
            rows = slice(a * rows_per_expert, b * rows_per_expert)
            group_rows = slice(rows.start * columns // 128, rows.stop * columns // 128)
            q, grads = qdq(rows, device)
            equal["qdq"] &= torch.equal(q.to(home), whole[rows])
            for k, g in grads.items():
                equal[k] &= torch.equal(g.to(home), whole_grads[k][group_rows])
        print(f"qdq of [{experts} x {rows_per_expert}, {columns}] rows, experts {ranges}: bits equal: {equal}")


def gptq_updates(args: argparse.Namespace, work: Path, out: Path) -> None:
    """cProfile of the last layer's GPTQ update phase (ours, parallel_sequential)."""
    model_dir = save_random_model(args.shape, 2, work / f"{args.shape}-2-layers")
    recipe = ParallelGPTQExpertModifier(data_parallel=_devices(args.gpus) if args.gpus > 1 else "off", **COMMON)
    _state, _start, _stop, profiled_call, report = _profiled_window(out, "gptq-updates", args)

    def compress(real: Callable) -> Callable:
        def profiled(self, *call_args, **call_kwargs):  # the last call: the last layer
            if not self._hessians:
                return real(self, *call_args, **call_kwargs)
            return profiled_call(real, self, *call_args, **call_kwargs)

        return profiled

    with patched(ParallelGPTQExpertModifier, "compress_modules", compress):
        oneshot(model=str(model_dir), dataset=random_tokens(args.samples, args.seq_len),
                recipe=recipe, num_calibration_samples=args.samples, max_seq_length=args.seq_len,
                shuffle_calibration_samples=False, pipeline="parallel_sequential")
    report()


class PoolVariant(NamedTuple):
    """What a variant of the GPTQ update phase patches back to an earlier session's code."""

    warm_every_layer: bool  # one job warms up in the caller every layer (session 7)
    default_stream_copies: bool  # inputs from another GPU copied on its default stream (7)
    shared_write_stream: bool  # the write-back threads copy on the default stream (8)
    write_threads: int | None = None  # MAX_WRITE_THREADS, None: as committed
    staged: bool = True  # False: results stay on the GPUs, written as stock writes them (5)


GPTQ_UPDATE_VARIANTS = {
    "session7": PoolVariant(True, True, True),
    "session8": PoolVariant(False, False, True),
    "write-streams": PoolVariant(False, False, False),  # the current code
    "write-streams-16-threads": PoolVariant(False, False, False, 16),
    "write-streams-2-threads": PoolVariant(False, False, False, 2),
    "unstaged": PoolVariant(False, False, False, None, False),
    "unstaged-2-threads": PoolVariant(False, False, False, 2, False),
}


def gptq_update_variants(args: argparse.Namespace, work: Path, out: Path) -> None:
    """Ours on the same layers once per variant of the update phase (the current code is
    "write-streams"; the others patch parts of it back to what they were, or try a
    setting): each layer's update phase, pool and write-back seconds, and its jobs'
    timeline."""
    import llmcompressor_parallel.engine.update_pool as update_pool
    import llmcompressor_parallel.modifiers.gptq_write_back as write_back
    from torch.utils._pytree import tree_map

    model_dir = save_random_model(args.shape, 2, work / f"{args.shape}-2-layers")
    real_run, real_write = parallel_gptq_module.run_update_jobs, parallel_gptq_module.write_batches
    for name in args.variants:
        variant = GPTQ_UPDATE_VARIANTS[name]
        layers: list[str] = []
        serial_ms = collections.defaultdict(float)  # this layer's serial pieces before the pool

        def timed_ms(piece: str) -> Callable[[Callable], Callable]:
            def make(real: Callable) -> Callable:
                def timed(*call_args, **call_kwargs):
                    start = time.perf_counter()
                    try:
                        return real(*call_args, **call_kwargs)
                    finally:
                        serial_ms[piece] += (time.perf_counter() - start) * 1e3
                return timed
            return make

        def run(pool, jobs, update, warmed=None):
            start = time.perf_counter()
            results = real_run(pool, jobs, update, None if variant.warm_every_layer else warmed)
            spans = " ".join(
                f"[{r.place.split()[0][0]}{r.worker if r.worker is not None else ''} "
                f"{(r.started - start) * 1e3:.0f}-{(r.started + r.seconds - start) * 1e3:.0f}]"
                for r in results)
            before = ", ".join(f"{piece} {ms:.0f} ms" for piece, ms in serial_ms.items())
            serial_ms.clear()
            layers.append(f"{before}; pool {(time.perf_counter() - start) * 1e3:.0f} ms, "
                          f"jobs {sum(r.seconds for r in results) * 1e3:.0f} ms: {spans}")
            return results

        def write(*call_args, **call_kwargs):
            start = time.perf_counter()
            real_write(*call_args, **call_kwargs)
            layers[-1] += f"; write-back {(time.perf_counter() - start) * 1e3:.0f} ms"

        def plain_copy(tree, device, context):
            return tree_map(lambda v: v.to(device) if isinstance(v, torch.Tensor) else v, tree)

        timer = PhaseTimer()
        recipe = ParallelGPTQExpertModifier(data_parallel=_devices(args.gpus), **COMMON)
        with contextlib.ExitStack() as stack:
            stack.enter_context(patched(parallel_gptq_module, "run_update_jobs", lambda _real: run))
            stack.enter_context(patched(parallel_gptq_module, "write_batches", lambda _real: write))
            stack.enter_context(patched(ParallelGPTQExpertModifier, "end_parallel_calibration",
                                        timed_ms("Hessian merge")))
            stack.enter_context(patched(ParallelGPTQExpertModifier, "_batch_job", timed_ms("gather")))
            if variant.default_stream_copies:
                stack.enter_context(patched(update_pool, "_copy_to", lambda _real: plain_copy))
            if variant.shared_write_stream:
                stack.enter_context(patched(write_back, "_own_stream",
                                            lambda _real: lambda device: contextlib.nullcontext()))
            if not variant.staged:
                stack.enter_context(patched(parallel_gptq_module, "offloaded_to_host",
                                            lambda _real: lambda module: False))
            if variant.write_threads is not None:
                stack.enter_context(patched(write_back, "MAX_WRITE_THREADS",
                                            lambda _real: variant.write_threads))
            stack.enter_context(gptq_phases(timer))
            oneshot(model=str(model_dir), dataset=random_tokens(args.samples, args.seq_len),
                    recipe=recipe, num_calibration_samples=args.samples, max_seq_length=args.seq_len,
                    shuffle_calibration_samples=False, pipeline="parallel_sequential")
        updates = [layer.get("updates", 0.0) for layer in timer.layers]
        print(f"variant {name}: update phase per layer {', '.join(f'{u:.3f}' for u in updates)} s")
        for line in layers:
            print(f"    {line}")


# (batch, rows, columns) of update batches: Llama-3-8B modules, a per-GPU chunk of
# Qwen3-235B-A22B / Qwen3-30B-A3B experts (gate/up, then down)
ROWSPLIT_SHAPES = [(1, 4096, 14336), (1, 14336, 4096), (1, 4096, 4096), (1, 1024, 4096),
                   (64, 1536, 4096), (64, 4096, 1536), (64, 768, 2048), (64, 2048, 768)]


def gptq_rowsplit(args: argparse.Namespace, work: Path, out: Path) -> None:
    from compressed_tensors.quantization import QuantizationArgs
    from llmcompressor.modifiers.gptq.gptq_quantize import quantize_weight
    from llmcompressor.modifiers.gptq.helpers import factorize_hessian

    devices = [torch.device(d) for d in _devices(args.gpus)]
    quant_args = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=128)

    def run(weights, hessians, scale, zero, device):
        # Triton launches on the current device: make it the tensors' one
        with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
            return _run(weights, hessians, scale, zero, device)

    def _run(weights, hessians, scale, zero, device):
        return quantize_weight(weights.to(device), hessians.to(device, copy=True), scale.to(device), zero.to(device),
                               None, quant_args, blocksize=128, percdamp=0.01)

    def timed(fn):
        sync_gpus()
        start = time.perf_counter()
        result = fn()
        sync_gpus()
        return result, time.perf_counter() - start

    for batch, rows, columns in ROWSPLIT_SHAPES:
        generator = torch.Generator().manual_seed(0)
        weights = (torch.randn(batch, rows, columns, generator=generator) * 0.02).to(torch.bfloat16)
        samples = torch.randn(batch, 2 * columns, columns, generator=generator)
        hessians = (samples.transpose(1, 2) @ samples / samples.shape[1]).contiguous()
        groups = weights.float().reshape(batch, rows, columns // 128, 128).abs().amax(-1)
        scale = (groups / 7.5).clamp(min=1e-8).to(torch.bfloat16)
        zero = torch.zeros_like(scale, dtype=torch.int8)
        home = devices[0]
        run(weights[:1], hessians[:1], scale[:1], zero[:1], home)  # warm-up (JIT, handles)
        (full, _, _), full_s = timed(lambda: run(weights, hessians, scale, zero, home))
        used = torch.zeros(batch, dtype=torch.bool, device=home)
        _, factor_s = timed(lambda: factorize_hessian(
            weights.to(home, torch.float32), hessians.to(home).clone(), 0.01, used))
        cuts = split_row_ranges(rows, len(devices))
        pieces = [(weights[:, a:b], hessians, scale[:, a:b], zero[:, a:b], d) for (a, b), d in zip(cuts, devices)]
        for piece in pieces:  # warm-up on every device
            run(piece[0][:1], piece[1][:1], piece[2][:1], piece[3][:1], piece[4])
        halves, serial_s = [], 0.0
        for piece in pieces:
            (part, _, _), seconds = timed(lambda: run(*piece))
            halves.append(part.to(home))
            serial_s = max(serial_s, seconds)
        results: list[Any] = [None] * len(pieces)

        def worker(index: int) -> None:
            torch.cuda.set_device(pieces[index][4]) if torch.cuda.is_available() else None
            results[index] = run(*pieces[index])[0]

        def concurrent() -> None:
            threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(pieces))]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()

        _, together_s = timed(concurrent)
        equal = torch.equal(full, torch.cat(halves, dim=1)) and torch.equal(
            full, torch.cat([r.to(home) for r in results], dim=1))
        print(f"batch {batch:3d} x {rows:5d} x {columns:5d}: whole {full_s:.3f} s (factorisation "
              f"{factor_s:.3f} s), largest row piece {serial_s:.3f} s, {len(pieces)} pieces at once "
              f"{together_s:.3f} s ({full_s / together_s:.2f}x); bits equal: {equal}")


def split_row_ranges(rows: int, parts: int, multiple: int = 16) -> list[tuple[int, int]]:
    """`parts` contiguous row ranges, cut at multiples of `multiple`."""
    step = -(-rows // parts // multiple) * multiple
    return [(start, min(start + step, rows)) for start in range(0, rows, step)]


# each probe by name: run(args, work folder, output folder)
PROBES: dict[str, Callable[[argparse.Namespace, Path, Path], None]] = {
    "gptq-pass": lambda args, work, out: gptq_pass(args, work),
    "autoround-profile": lambda args, work, out: autoround_profile(args, work),
    "autoround-host": autoround_window,
    "autoround-capture": autoround_window,
    "autoround-timeline": autoround_timeline,
    "autoround-call-parts": autoround_call_parts,
    "expert-split-bits": expert_split_bits,
    "gptq-updates": gptq_updates,
    "gptq-update-variants": gptq_update_variants,
    "gptq-rowsplit": gptq_rowsplit,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("probe", choices=list(PROBES))
    parser.add_argument("--shape", default="llama3-8b")
    parser.add_argument("--gpus", type=int, default=2)
    parser.add_argument("--samples", type=int, default=128)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--expert-tokens", default="auto", choices=["auto", "all", "routed"])
    parser.add_argument("--exact", default="on", choices=["on", "off"], help="exact_gradients (autoround-host)")
    parser.add_argument("--rows", type=int, default=25)
    parser.add_argument("--skip", type=int, default=5, help="autoround-timeline: iterations before the window")
    parser.add_argument("--window", type=int, default=10, help="autoround-timeline: iterations profiled")
    parser.add_argument("--variants", nargs="+", choices=list(GPTQ_UPDATE_VARIANTS),
                        default=list(GPTQ_UPDATE_VARIANTS), help="gptq-update-variants")
    parser.add_argument("--out", default="bench/out")
    parser.add_argument("--work", default=None)
    args = parser.parse_args()
    out, work = bench_folders(args.out, args.work, prefix="llmc-probe-")
    PROBES[args.probe](args, work, out)


if __name__ == "__main__":
    main()
