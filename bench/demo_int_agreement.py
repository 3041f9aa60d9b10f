"""Why data-parallel AutoRound with per-replica gradient sums does not reproduce stock's
integers, measured on the demo model.

Stock `AutoRoundModifier` and ours with 2 and 3 CPU replicas (per-expert loop, so only
the batch split differs; `exact_gradients=False`: each replica sums its own rows' weight
gradients, the mode that `exact_gradients=True`, the default, replaces), same data and seed, with auto-round's mixed precision on
(bf16, its default) and off (fp32 throughout). Prints the share of identical quantized
integers per iteration count, and, for one run, how the signs of the tuning gradients
agree step by step (the first few parameters of each layer): the split changes only
the order of the gradient sums, and SignSGD amplifies the last-bit differences.

    OMP_NUM_THREADS=1 python bench/demo_int_agreement.py --iters 6 8 10 50 --trace-iters 10
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path
from typing import Any, Callable

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent / "tests"))

from auto_round.algorithms.quantization.sign_round.sign_sgd import SignSGD  # noqa: E402
from llmcompressor.modifiers.autoround import AutoRoundModifier  # noqa: E402

from llmcompressor_parallel import DataParallelAutoRoundModifier  # noqa: E402
from llmcompressor_parallel.demo import calibration_dataset, demo_model_path  # noqa: E402
from demo_noise_band import autoround_kwargs  # noqa: E402
from phases import patched  # noqa: E402
from oneshot_runs import AUTOROUND_ARGS, compare_checkpoints, run_oneshot  # noqa: E402

SAMPLES, SEQ_LEN = 16, 64


def gradient_steps(steps: list[list[torch.Tensor]], keep: int = 3) -> contextlib.AbstractContextManager:
    """Record the first `keep` gradients SignSGD sees at every step."""

    def make(real: Callable) -> Callable:
        def step(self, *args: Any, **kwargs: Any) -> Any:
            grads = [p.grad for g in self.param_groups for p in g["params"] if p.grad is not None]
            steps.append([g.detach().clone() for g in grads[:keep]])
            return real(self, *args, **kwargs)

        return step

    return patched(SignSGD, "step", make)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--iters", type=int, nargs="+", default=[6, 8, 10, 50])
    parser.add_argument("--replicas", type=int, nargs="+", default=[2, 3])
    parser.add_argument("--trace-iters", type=int, default=10,
                        help="record per-step gradient signs for this iteration count")
    parser.add_argument("--work", default="/tmp/llmc-int-agreement")
    args = parser.parse_args()
    work = Path(args.work)
    model_dir = work / "demo-fp32"  # auto-round casts to bf16 itself when amp is on
    AutoModelForCausalLM.from_pretrained(demo_model_path(), dtype=torch.float32).save_pretrained(model_dir)
    AutoTokenizer.from_pretrained(demo_model_path()).save_pretrained(model_dir)
    data = calibration_dataset(AutoTokenizer.from_pretrained(demo_model_path()), SAMPLES, SEQ_LEN)

    def run(recipe: Any, name: str, steps: list | None = None) -> dict:
        with gradient_steps(steps) if steps is not None else contextlib.nullcontext():
            return run_oneshot(model_dir, recipe, work / name, SAMPLES, SEQ_LEN, dataset=data)

    for amp_on in (True, False):
        with autoround_kwargs(amp=amp_on):
            for iters in args.iters:
                traced = iters == args.trace_iters
                stock_steps: list = []
                stock = run(AutoRoundModifier(iters=iters, **AUTOROUND_ARGS), f"stock-{amp_on}-{iters}",
                            stock_steps if traced else None)
                for replicas in args.replicas:
                    our_steps: list = []
                    recipe = DataParallelAutoRoundModifier(
                        iters=iters, data_parallel=["cpu"] * replicas, grouped_experts=False,
                        exact_gradients=False, **AUTOROUND_ARGS,
                    )
                    ours = run(recipe, f"ours-{amp_on}-{iters}-{replicas}",
                               our_steps if traced and replicas == args.replicas[0] else None)
                    figures = compare_checkpoints(stock, ours)
                    print(json.dumps({"amp": amp_on, "iters": iters, "replicas": replicas,
                                      "int_identical": round(figures["int_identical"], 5)}), flush=True)
                    if our_steps:
                        agreement = [
                            round(sum((torch.sign(a) == torch.sign(b)).sum().item() for a, b in zip(s, o))
                                  / sum(a.numel() for a in s), 5)
                            for s, o in zip(stock_steps, our_steps)
                        ]
                        print(json.dumps({"amp": amp_on, "iters": iters, "replicas": replicas,
                                          "sign_agreement_per_step": agreement}), flush=True)


if __name__ == "__main__":
    main()
