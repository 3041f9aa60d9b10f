"""This thread's own CUDA stream on a device, for copies that must not queue behind its default stream.

Why: a copy queued on a device's default (current) stream runs after everything any
thread queued there before it, such as another worker's update job on that GPU, or
another write-back thread's blocking copy. The update pool's input copies and the GPTQ
write-back threads' copies to the GPU run on a stream of their own instead, ordered
after the work they need by an explicit event or `wait_stream`. One stream per thread and device, kept for the thread's life, so the
copies one thread queues stay in the order it queued them. The streams come from torch's
per-device stream pool (`torch.cuda.Stream`), so short-lived threads (the GPTQ write-back's)
create no new CUDA streams.
"""

from __future__ import annotations

import threading

import torch

__all__ = ["side_stream"]

_STREAMS = threading.local()


def side_stream(device: torch.device) -> torch.cuda.Stream:
    """This thread's own stream on the CUDA device `device`."""
    streams: dict[int, torch.cuda.Stream] | None = getattr(_STREAMS, "streams", None)
    if streams is None:
        streams = _STREAMS.streams = {}
    index = torch.device(device).index
    if index is None:
        index = torch.cuda.current_device()
    if index not in streams:
        streams[index] = torch.cuda.Stream(index)
    return streams[index]
