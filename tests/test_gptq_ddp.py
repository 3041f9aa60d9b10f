"""ParallelGPTQExpertModifier under torch.distributed: 2 gloo ranks x 2 CPU devices each.

Two processes (`ddp_runs.py`, init_method file://) run stock GPTQ and ours through
`oneshot()` on the tiny models, each rank calibrating on its half of 16 samples;
stock GPTQ in one process on all 16 gives the single-process checkpoint. Ours uses
the update pool over the rank's two devices under the stock sequential pipeline,
and additionally the data-parallel calibration under "parallel_sequential".

What must hold: ours equals stock-DDP bit for bit. Stock-DDP sums each rank's
Hessian and then the ranks' sums, where one process sums batch after batch, so it
equals the single-process checkpoint only when each rank has one batch (asserted,
batch size 8); with two batches per rank the gap is printed (-s to see it).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from llmcompressor import oneshot
from llmcompressor.modifiers.gptq import GPTQModifier

from tiny_models import calibration_data, load_saved_tensors, unpack_int4

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

WORLD = 2
SAMPLES, SEQ_LEN = 16, 32
ARGS = {
    "dense": dict(targets="Linear", scheme="W4A16", ignore=["lm_head"]),
    "moe": dict(targets="Linear", scheme="W4A16", ignore=["lm_head"], batched_quantization=4),
}
# (model, batch size): 4 = two batches per rank, one per device; 8 = one batch per rank
CASES = [("dense", 4), ("moe", 4), ("dense", 8)]
VARIANTS = {  # name: (modifier, pipeline)
    "stock_ddp": ("stock", None),
    "ours_ddp": ("ours", None),
    "ours_ddp_parallel_calibration": ("ours", "parallel_sequential"),
}


def _plan(model_dirs: dict[str, Path], root: Path) -> dict:
    runs = []
    for kind, batch_size in CASES:
        for name, (modifier, pipeline) in VARIANTS.items():
            if batch_size == 8 and pipeline is not None:
                continue  # one batch per rank: nothing to spread over its devices
            runs.append(dict(
                name=f"{kind}-b{batch_size}-{name}", model=str(model_dirs[kind]),
                modifier=modifier, pipeline=pipeline, args=ARGS[kind],
                data_parallel=["cpu", "cpu"], batch_size=batch_size,
                output_dir=str(root / f"{kind}-b{batch_size}-{name}"),
            ))
    return dict(runs=runs, samples=SAMPLES, seq_len=SEQ_LEN)


@pytest.fixture(scope="module")
def ddp(model_dirs, tmp_path_factory) -> dict:
    """Checkpoints of every DDP variant (saved by rank 0) and each rank's log lines."""
    root = tmp_path_factory.mktemp("ddp")
    plan = _plan(model_dirs, root)
    (root / "plan.json").write_text(json.dumps(plan))
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    script = Path(__file__).with_name("ddp_runs.py")
    start = time.perf_counter()
    logs = [root / f"rank{rank}.log" for rank in range(WORLD)]
    ranks = []
    for rank in range(WORLD):
        with logs[rank].open("w") as log:
            ranks.append(subprocess.Popen(
                [sys.executable, str(script), str(rank), str(WORLD), str(root / "store"),
                 str(root / "plan.json")],
                env=env, stdout=log, stderr=subprocess.STDOUT,
            ))
    failures = []
    for rank, process in enumerate(ranks):
        try:
            process.wait(timeout=300)
        except subprocess.TimeoutExpired:
            for other in ranks:
                other.kill()
                other.wait()
            pytest.fail(f"DDP rank {rank} did not finish within 300 s")
        if process.returncode != 0:
            tail = logs[rank].read_text()[-4000:]
            failures.append(f"rank {rank} exited {process.returncode}:\n{tail}")
    assert not failures, "\n".join(failures)
    print(f"2 gloo ranks, {len(plan['runs'])} oneshot runs each: "
          f"{time.perf_counter() - start:.1f} s (process start included)")
    return dict(
        checkpoints={run["name"]: load_saved_tensors(Path(run["output_dir"]))
                     for run in plan["runs"]},
        logs=[log.read_text() for log in logs],
    )


_SINGLE: dict[tuple[str, int], dict[str, torch.Tensor]] = {}


def single_process(model_dirs, tmp_path_factory, kind: str, batch_size: int) -> dict:
    """Stock GPTQ in this process on all samples, once per (model, batch size)."""
    key = (kind, batch_size)
    if key not in _SINGLE:
        out = tmp_path_factory.mktemp(f"single-{kind}-b{batch_size}")
        torch.manual_seed(0)
        oneshot(
            model=str(model_dirs[kind]), dataset=calibration_data(SAMPLES, SEQ_LEN),
            recipe=GPTQModifier(**ARGS[kind]), num_calibration_samples=SAMPLES,
            max_seq_length=SEQ_LEN, batch_size=batch_size,
            shuffle_calibration_samples=False, output_dir=str(out),
        )
        _SINGLE[key] = load_saved_tensors(out)
    return _SINGLE[key]


def differences(expected: dict, actual: dict) -> tuple[list[str], float]:
    """Names of tensors that differ, and the share of identical 4-bit integers."""
    assert expected.keys() == actual.keys()
    differ = [name for name in expected if not torch.equal(expected[name], actual[name])]
    same = total = 0
    for name, tensor in expected.items():
        if name.endswith("weight_packed"):
            a, b = unpack_int4(tensor), unpack_int4(actual[name])
            same += (a == b).sum().item()
            total += a.numel()
    return differ, same / max(total, 1)


@pytest.mark.parametrize("kind, batch_size", CASES, ids=[f"{k}-b{b}" for k, b in CASES])
def test_ours_under_ddp_equals_stock_ddp(ddp, model_dirs, tmp_path_factory, kind, batch_size):
    prefix = f"{kind}-b{batch_size}"
    stock_ddp = ddp["checkpoints"][f"{prefix}-stock_ddp"]
    single = single_process(model_dirs, tmp_path_factory, kind, batch_size)
    gap, identical = differences(single, stock_ddp)
    print(f"{prefix}: stock-DDP vs single process: {len(gap)} of {len(single)} tensors "
          f"differ, {identical:.4%} of the 4-bit integers identical")
    ours = [name for name in ddp["checkpoints"] if name.startswith(f"{prefix}-ours")]
    assert ours
    for name in ours:
        differ, _ = differences(stock_ddp, ddp["checkpoints"][name])
        print(f"{name}: {len(differ)} of {len(stock_ddp)} tensors differ from stock-DDP")
        assert not differ, f"{name} differs from stock-DDP in {differ[:5]}"
    if batch_size == 8:
        # one batch per rank: stock-DDP's sums are the single process's, and so are ours
        assert not gap, f"stock-DDP differs from the single process in {gap[:5]}"


def test_each_rank_spreads_its_work_over_its_devices(ddp):
    for rank, log in enumerate(ddp["logs"]):
        assert f"rank {rank}: data-parallel over 2 devices: cpu, cpu" in log
        runs = log.split("=== run ")[1:]
        for run in runs:
            name = run.splitlines()[0]
            if "-ours" not in name:
                continue
            updates = [line for line in run.splitlines() if "GPTQ updates:" in line]
            assert updates and all("worker" in line for line in updates), (rank, name)
            if name.endswith("parallel_calibration"):
                assert "calibration 2 of 3 subgraphs; propagation 2 of 3 subgraphs" in run, (
                    rank, name
                )
