"""Full garbage collections that traverse only what a layer created.

auto-round calls `gc.collect()` five to six times for every layer it quantizes (while
building its compressor and model context, and when clearing memory). Each call
traverses every object the process tracks: with torch, transformers and a model
loaded that is about half a million objects and 0.25-0.3 s a call (on a 2-core CPU
machine and on an H200 machine's host alike), so about 1.5 s of every layer goes to
finding a handful of cycles.

`young_objects_gc()` collects once, then freezes every tracked object (`gc.freeze`:
moved to a permanent generation that collections skip) for the layer's duration. The
layer's own collections (auto-round's and the automatic ones) then traverse only the
objects created since, in milliseconds, and find the same garbage: everything older
was just collected. On the way out the layer's garbage is collected (cheap, still
frozen), then the freeze is undone. Numerics are untouched.

A freeze that existed before (Python 3.12 as the GPU machine runs it starts with 375
frozen objects; servers freeze after start-up) is kept: the objects are frozen again
on the way out, which keeps the earlier freeze and adds the objects alive then.
"""

from __future__ import annotations

import contextlib
import gc
import time
from typing import Iterator

from loguru import logger

__all__ = ["young_objects_gc"]


@contextlib.contextmanager
def young_objects_gc(what: str = "layer") -> Iterator[None]:
    """Within the block, full collections skip the objects that existed before it."""
    frozen_before = gc.get_freeze_count()
    start = time.perf_counter()
    found = gc.collect()
    gc.freeze()
    logger.debug(
        "{}: collected {} objects in {:.3f} s, then froze {} for the {}'s collections",
        what, found, time.perf_counter() - start, gc.get_freeze_count(), what,
    )
    try:
        yield
    finally:
        gc.collect()  # the block's garbage, while the old objects are still skipped
        gc.unfreeze()
        if frozen_before:
            gc.freeze()
