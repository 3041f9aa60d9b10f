"""Run one bench configuration, in a fresh process of its own unless told otherwise.

Why: run one after the other in one process, a configuration inherits the state the
ones before it left (host and GPU memory, allocator caches, page cache); a user's run
starts without it. In a fresh process every configuration starts alike.
"""

from __future__ import annotations

import multiprocessing
from concurrent.futures import ProcessPoolExecutor
from typing import Any, Callable

from report import peak_memory_gib, reset_peak_memory


def run_configuration(isolate: bool, run: Callable[..., Any], *args: Any) -> tuple[Any, dict[str, float]]:
    """`run(*args)` and the peak GPU memory it reached; in a spawned process where `isolate`."""
    if not isolate:
        return _measured(run, *args)
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as child:
        return child.submit(_measured, run, *args).result()


def _measured(run: Callable[..., Any], *args: Any) -> tuple[Any, dict[str, float]]:
    reset_peak_memory()
    return run(*args), peak_memory_gib()
