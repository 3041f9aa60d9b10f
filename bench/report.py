"""JSON lines and a PNG bar chart for the benchmarks."""

from __future__ import annotations

import json
import tempfile
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


def emit(record: dict, out_dir: Path) -> None:
    line = json.dumps(record)
    print(line, flush=True)
    with open(out_dir / "results.jsonl", "a") as stream:
        stream.write(line + "\n")


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
