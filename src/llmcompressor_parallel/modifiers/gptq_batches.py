"""Stock's GPTQ update batches, large ones split so that every device gets a share.

Why: llm-compressor stacks all same-shape modules of a layer into one update batch
(256 gate/up experts of a Qwen3-MoE layer in one call). With a few such batches per
layer, one GPU computes the largest while the others finish early and wait: two
GPUs gave 1.09x on the update phase. GPTQ treats every module of a batch on its own
(its own Hessian factor, its own column loop; only the kernels are shared), so
cutting a batch into chunks changes what runs where, not what is computed. Chunks
keep at least `MIN_BATCHED_CHOLESKY_SIZE` modules, so each runs the same batched
factorisation that stock runs on the whole batch; tests check the result bit for
bit against stock's batches on CPU and on GPUs.
"""

from __future__ import annotations

from llmcompressor.modifiers.gptq.helpers import MIN_BATCHED_CHOLESKY_SIZE
from torch import nn

from llmcompressor_parallel.engine.scatter_gather import split_ranges

__all__ = ["split_for_devices"]


def split_for_devices(batches: list[list[nn.Module]], devices: int) -> list[list[nn.Module]]:
    """Cut each batch into up to `devices` contiguous chunks of at least 16 modules.

    Order is kept (chunks of a batch stay together, in stock's module order), so
    write-back and logging see stock's order. Batches too small to split, and every
    batch when there is one device, are returned as they are.
    """
    chunked: list[list[nn.Module]] = []
    for batch in batches:
        parts = min(devices, len(batch) // MIN_BATCHED_CHOLESKY_SIZE)
        if parts < 2:
            chunked.append(batch)
            continue
        chunked.extend(batch[start:stop] for start, stop in split_ranges(len(batch), parts))
    return chunked
