"""Full garbage collections that traverse only what a layer created.

auto-round calls `gc.collect()` five to six times for every layer it quantizes (while
building its compressor and model context, and when clearing memory). Each call
traverses every object the process tracks: with torch, transformers and a model
loaded that is about half a million objects and 0.25-0.3 s a call on a 2-core CPU
machine, so about 1.5 s of every layer goes to finding a handful of cycles.

`young_objects_gc()` collects once, then freezes every tracked object (`gc.freeze`:
moved to a permanent generation that collections skip) for the layer's duration, and
unfreezes them afterwards. The layer's own collections then see only the objects
created since: the same garbage is found (what the layer left is collected at the
next layer's first collection, as stock's first collection there does), in
milliseconds. Numerics are untouched. If something else froze objects already, its
freeze is left alone and nothing is done.
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
    if gc.get_freeze_count() > 0:  # someone else's freeze: unfreezing would undo it
        yield
        return
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
        gc.unfreeze()
