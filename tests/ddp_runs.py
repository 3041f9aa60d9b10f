"""One rank of a 2-process gloo group running oneshot() variants (started by test_gptq_ddp.py).

    python ddp_runs.py RANK WORLD_SIZE STORE_FILE PLAN_JSON

Output (llm-compressor's log lines, progress bars) comes after a line
"=== run NAME".

Each rank calibrates on its own contiguous share of the samples, the way
llm-compressor's distributed guide partitions data (`get_rank_partition`). Passing
every rank the same dataset and relying on llm-compressor 0.14.0.1's automatic
partition is avoided: its sampler selects the rank's share, but the DataLoader then
indexes the unpartitioned dataset with those indices, so every rank calibrates on
the first share.

Stock's reference is `GPTQModifier` plus one barrier after each layer's updates
(`StockGPTQWithBarrier`): on CPU, stock's ranks otherwise race on the shared-memory
weights of modules another rank quantized, and two stock runs differ.
"""

from __future__ import annotations

import datetime
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))

from llmcompressor import oneshot  # noqa: E402
from llmcompressor.modifiers.gptq import GPTQModifier  # noqa: E402

# importing the package registers the "parallel_sequential" pipeline
from llmcompressor_parallel import ParallelGPTQExpertModifier  # noqa: E402
from tiny_models import calibration_data  # noqa: E402


class StockGPTQWithBarrier(GPTQModifier):
    """Stock GPTQ, every rank waiting for the others' writes before it goes on."""

    def compress_modules(self):
        super().compress_modules()
        dist.barrier()


def rank_share(samples: int, seq_len: int, rank: int, world: int):
    start, end = samples * rank // world, samples * (rank + 1) // world
    return calibration_data(samples, seq_len).select(range(start, end)), end - start


def build(run: dict):
    args = dict(run["args"])
    if run["modifier"] == "stock":
        return StockGPTQWithBarrier(**args)
    return ParallelGPTQExpertModifier(**args, data_parallel=run["data_parallel"])


def main(rank: int, world: int, store: str, plan_file: str) -> None:
    torch.set_num_threads(1)
    plan = json.loads(Path(plan_file).read_text())
    dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=rank, world_size=world,
        timeout=datetime.timedelta(seconds=120),
    )
    try:
        dataset, samples = rank_share(plan["samples"], plan["seq_len"], rank, world)
        for run in plan["runs"]:
            print(f"=== run {run['name']}", flush=True)
            pipeline = {} if run["pipeline"] is None else {"pipeline": run["pipeline"]}
            oneshot(
                model=run["model"],
                dataset=dataset,
                recipe=build(run),
                num_calibration_samples=samples,
                max_seq_length=plan["seq_len"],
                batch_size=run["batch_size"],
                shuffle_calibration_samples=False,
                output_dir=run["output_dir"],
                **pipeline,
            )
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4])
