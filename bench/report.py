"""JSON lines and a PNG bar chart for the benchmarks."""

from __future__ import annotations

import functools
import json
import os
import platform
import tempfile
import time
from pathlib import Path

import torch


def peak_memory_gib() -> dict[str, float]:
    if not torch.cuda.is_available():
        return {}
    peaks = {}
    for index in range(torch.cuda.device_count()):
        try:
            peaks[f"cuda:{index}"] = round(torch.cuda.max_memory_allocated(index) / 2**30, 2)
        except RuntimeError:
            peaks[f"cuda:{index}"] = 0.0
    return peaks


def reset_peak_memory() -> None:
    if torch.cuda.is_available():
        for index in range(torch.cuda.device_count()):
            try:
                torch.cuda.reset_peak_memory_stats(index)
            except RuntimeError:  # no context on that GPU yet: nothing to reset
                pass


def bench_folders(out: str, work: str | None, prefix: str) -> tuple[Path, Path]:
    """The results folder (created) and the folder for models and checkpoints.

    Model folders are named by shape and layer count (the caller's job), because a
    kept work folder would otherwise hand a later run a model of another depth.
    """
    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    return out_dir, Path(work or tempfile.mkdtemp(prefix=prefix))


def host_info() -> dict:
    """The host a record was measured on: both stock and ours are host-bound in parts,
    and lent machines' hosts differ (stock's same 30B layer took 68 to 97 s across
    three calls), so records from different calls compare through this."""
    model = next(
        (line.split(":", 1)[1].strip() for line in _read_lines("/proc/cpuinfo")
         if line.startswith("model name")),
        platform.processor() or "unknown",
    )
    start = time.perf_counter()
    total = 0
    for value in range(2_000_000):  # a fixed pure-Python loop: the interpreter's speed
        total += value & 7
    return {"cpu": model, "cores": os.cpu_count(),
            "python_loop_ms": round((time.perf_counter() - start) * 1000, 1)}


def _read_lines(path: str) -> list[str]:
    try:
        return Path(path).read_text().splitlines()
    except OSError:
        return []


def emit(record: dict, out_dir: Path) -> None:
    record.setdefault("host", _HOST())
    line = json.dumps(record)
    print(line, flush=True)
    with open(out_dir / "results.jsonl", "a") as stream:
        stream.write(line + "\n")


_HOST = functools.cache(host_info)  # measured once per process, at its first record (between runs)


def plot(records: list[dict], out_file: Path, title: str) -> None:
    """Per-layer time of each configuration, stock first, with the speedup on top."""
    try:
        import matplotlib
    except ImportError:
        print(f"matplotlib is not installed: no plot written to {out_file}")
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = sorted({r["shape"] for r in records})
    fig, axes = plt.subplots(1, len(shapes), figsize=(5 * len(shapes), 4), squeeze=False)
    for axis, shape in zip(axes[0], shapes):
        rows = [r for r in records if r["shape"] == shape]
        labels = [r["config"] for r in rows]
        times = [r["seconds_per_layer"] for r in rows]
        bars = axis.bar(labels, times, color=["#888888"] + ["#2a7ab0"] * (len(rows) - 1))
        for bar, row in zip(bars, rows):
            axis.annotate(f"{row.get('speedup', 1.0):.2f}x", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                          ha="center", va="bottom")
        axis.set_title(shape)
        axis.set_ylabel("seconds per layer")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out_file, dpi=120)
