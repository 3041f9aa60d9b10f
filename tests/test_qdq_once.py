"""AutoRound fan-out with grouped experts: qdq once on the home, quantized stacks shipped.

During a fanned-out call, the home computes the experts' fake-quantized stacks once
and each replica receives them through one differentiable copy per stack, instead
of receiving every expert's tuning parameters and recomputing the qdq. CPU replicas
(two "cpu" devices) run all of it. Figures are printed (-s).
"""

from __future__ import annotations

import statistics
import time

import pytest
import torch
from test_grouped_autoround import (
    HIDDEN,
    NUM_EXPERTS,
    PARAMS,
    PRECISIONS,
    compare,
    inputs,
    run,
    show,
    wrapped_block,
)

from auto_round.wrapper import WrapperLinear
from llmcompressor_parallel.engine import DeviceWorkerPool, FanOut
from llmcompressor_parallel.engine import grouped_autoround
from llmcompressor_parallel.engine.grouped_autoround import GroupedAutoRoundExperts
from llmcompressor_parallel.engine.grouped_autoround_experts import ShippedGroupedExperts
from llmcompressor_parallel.engine.grouped_autoround_qdq import StackedQdq
from llmcompressor_parallel.engine.replicate import ReplicaSet

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

CPU2 = [torch.device("cpu"), torch.device("cpu")]


@pytest.fixture
def pool():
    workers = DeviceWorkerPool(CPU2)
    yield workers
    workers.close()


@pytest.fixture
def counts(monkeypatch):
    """How many qdq's ran, and how many trainables each fan-out skipped."""
    seen = {"qdq": 0, "skipped": []}
    raw = StackedQdq.raw

    def counted_raw(self, *args, **kwargs):
        seen["qdq"] += 1
        return raw(self, *args, **kwargs)

    install = ReplicaSet.install_trainable_copies

    def recorded_install(self, parts, skip=frozenset()):
        seen["skipped"].append(len(skip))
        return install(self, parts, skip)

    monkeypatch.setattr(StackedQdq, "raw", counted_raw)
    monkeypatch.setattr(ReplicaSet, "install_trainable_copies", recorded_install)
    return seen


def _grad_errors(figures: dict[str, float]) -> dict[str, float]:
    return {k: v for k, v in figures.items() if k.startswith("grad ")}


@pytest.mark.parametrize("precision", ["fp32", "bf16_autocast"])
def test_qdq_once_matches_fan_out_and_serial(precision, pool, counts):
    """Forward bit for bit equal to today's fan-out and to the serial grouped forward;
    gradients within fp32 order of the serial grouped path.

    auto-round's scale factors pass through an fp16 scale (`scale_dtype`), so the
    min/max_scale gradients are rounded to fp16 inside the qdq backward: any change in
    the order the batch's weight gradients are summed before that point (fan-out vs
    serial) moves them by up to an fp16 ulp (~5e-4 relative). Under bf16 autocast
    each share's weight gradient is a bf16 matmul result, so any fan-out differs
    from the serial path by bf16 rounding; there qdq once matches today's fan-out.
    """
    dtype, amp = PRECISIONS[precision]
    block = wrapped_block(dtype=dtype)
    x = inputs(batch=4)
    serial = run(block, x, grouped={}, amp=amp)
    counts["qdq"] = 0
    fan_outs: list[FanOut] = []
    today = run(block, x, grouped={"qdq_once": False}, amp=amp, pool=pool, fan_outs=fan_outs)
    qdq_today = counts["qdq"]
    counts["qdq"] = 0
    once = run(block, x, grouped={}, amp=amp, pool=pool, fan_outs=fan_outs)
    qdq_once = counts["qdq"]
    assert [f.parallel_calls for f in fan_outs] == [1, 1]
    assert once[3].shipped_calls == 1 and today[3].shipped_calls == 0
    assert once[3].grouped_calls == 2 and once[3].stock_calls == 0
    assert (qdq_today, qdq_once) == (4, 2)  # two stacks per part vs two in all
    tuning_params = 3 * len(PARAMS) * NUM_EXPERTS
    assert counts["skipped"] == [0, tuning_params]  # no expert parameter broadcast

    assert torch.equal(once[0], today[0]) and torch.equal(once[0], serial[0])
    vs_serial = compare(serial, once)
    show(f"{precision} qdq once vs serial grouped", vs_serial)
    show(f"{precision} today's fan-out vs serial grouped", compare(serial, today))
    vs_today = compare(today, once)
    show(f"{precision} qdq once vs today's fan-out", vs_today)
    errors = _grad_errors(vs_serial)
    print(f"{precision}: max relative gradient error vs serial grouped: "
          f"{max(errors.values()):.2e} ({max(errors, key=errors.get)}); value "
          f"{errors['grad value']:.2e}")
    assert vs_serial["grad input"] == 0
    if precision == "fp32":
        assert vs_serial["grad value"] < 1e-5
        assert max(vs_serial["grad min_scale"], vs_serial["grad max_scale"]) < 2e-3  # fp16 ulp
    else:
        assert vs_today["grad value"] < 1e-5
        assert max(_grad_errors(vs_serial).values()) < 5e-2
    for name in ("min_scale", "max_scale"):
        assert vs_serial[f"{name} signs equal %"] > 99


def _replica_wrappers(fan_out: FanOut) -> list[WrapperLinear]:
    replica = fan_out._replicas._replicas[1]
    return [m for m in replica.modules if isinstance(m, WrapperLinear)]


def test_replicas_hold_no_tuning_parameters(pool):
    """After a qdq-once call the replica's wrappers have no (stale) tuning parameters;
    a call with qdq once off copies fresh ones again."""
    block = wrapped_block()
    x = inputs(batch=4)
    for qdq_once in (True, False, True):
        with GroupedAutoRoundExperts(block, "block", qdq_once=qdq_once), \
                FanOut(block, pool, "block") as fan_out:
            out = block(x)
            out.float().sum().backward()
            copies = _replica_wrappers(fan_out)
            assert len(copies) == 3 * NUM_EXPERTS
            present = {name in w._parameters for w in copies for name in PARAMS}
            assert present == {not qdq_once}
            assert fan_out.parallel_calls == 1


def test_serial_when_a_replica_cannot_run_grouped(pool, monkeypatch):
    """A replica whose experts would take the stock loop (which would need the tuning
    parameters qdq once does not send): the whole call runs serially, same result."""
    block = wrapped_block()
    x = inputs(batch=4)
    serial = run(block, x, grouped={}, amp=False)
    real = grouped_autoround._module_reason

    def refuse_replicas(plan, device_type):
        if isinstance(plan.runner, ShippedGroupedExperts):
            return "refused by the test"
        return real(plan, device_type)

    monkeypatch.setattr(grouped_autoround, "_module_reason", refuse_replicas)
    fan_outs: list[FanOut] = []
    fanned = run(block, x, grouped={}, amp=False, pool=pool, fan_outs=fan_outs)
    assert fan_outs[0].calls == 1 and fan_outs[0].parallel_calls == 0
    assert fanned[3].shipped_calls == 0 and fanned[3].grouped_calls == 1
    assert torch.equal(fanned[0], serial[0])
    for name in PARAMS:
        assert all(torch.equal(a, b) for a, b in zip(fanned[1][name], serial[1][name]))


def test_cpu_timing_128_experts(pool):
    """One fwd+bwd of the fanned-out block, each replica its own qdq vs qdq once
    (printed, not asserted; CPU figures say little about GPUs)."""
    experts = 128
    block = wrapped_block(dtype=torch.bfloat16, num_experts=experts)
    x = inputs(batch=4, seq=64)
    timings: dict[str, float] = {}
    for label, grouped, workers in (
        ("serial grouped", {}, None),
        ("fan-out x2, qdq per replica", {"qdq_once": False}, pool),
        ("fan-out x2, qdq once", {}, pool),
    ):
        runs = []
        for _ in range(4):
            start = time.perf_counter()
            result = run(block, x, grouped=grouped, pool=workers)
            runs.append(time.perf_counter() - start)
        timings[label] = statistics.median(runs[1:]) * 1e3
        if label.endswith("qdq once"):
            assert result[3].shipped_calls == 1
    print(f"\nCPU, {experts} experts, hidden {HIDDEN}, {x.shape[0] * x.shape[1]} tokens, "
          "bf16 autocast, fwd+bwd ms (median of 3): "
          + ", ".join(f"{k} {v:.0f}" for k, v in timings.items()))


def test_oneshot_two_cpu_replicas_qdq_once_vs_per_replica(tmp_path, monkeypatch):
    """oneshot on a tiny MoE, 2 CPU replicas: qdq once ships on every tuning call with
    wrapped experts, and tunes as well as each replica computing its own qdq.

    Not compared int by int: SignSGD runs differ from the first gradient sign that
    differs, and auto-round keeps the best iteration's parameters, so a run that beats
    the initial loss once (qdq once at layer 0 here, iter 9: 8.02e-6 < 8.30e-6, where
    serial and per-replica keep iter 0) quantizes half the ints differently.
    """
    from oneshot_runs import AUTOROUND_ARGS, block_losses, compare_checkpoints
    from tiny_models import calibration_data, load_saved_tensors, save_tiny_model

    from llmcompressor import oneshot
    from llmcompressor_parallel import DataParallelAutoRoundModifier

    model = save_tiny_model("moe", tmp_path / "model")
    shipped: list[bool] = []  # per fanned-out call with wrapped experts: qdq shipped
    plain_calls: list[bool] = []  # calls with plain experts (reference outputs, after unwrap)
    prepare = GroupedAutoRoundExperts.prepare_fan_out

    def recorded(self, replicas, parts, primary):
        result = prepare(self, replicas, parts, primary)
        if any(isinstance(m, WrapperLinear) for m in self.layer.modules()):
            shipped.append(result is not None)
        else:
            plain_calls.append(result is not None)
        return result

    monkeypatch.setattr(GroupedAutoRoundExperts, "prepare_fan_out", recorded)

    def quantize(output: str, qdq_once: bool) -> tuple[dict[str, torch.Tensor], list]:
        torch.manual_seed(0)
        with block_losses() as losses:
            oneshot(
                model=str(model), dataset=calibration_data(16, 32),
                output_dir=str(tmp_path / output),
                recipe=DataParallelAutoRoundModifier(
                    iters=10, data_parallel=["cpu", "cpu"], grouped_qdq_once=qdq_once,
                    **AUTOROUND_ARGS,
                ),
                num_calibration_samples=16, max_seq_length=32,
            )
        return load_saved_tensors(tmp_path / output), list(losses)

    per_replica, per_replica_losses = quantize("per_replica", False)
    assert not shipped  # not registered with qdq once off
    once, once_losses = quantize("once", True)
    assert shipped and all(shipped) and not any(plain_calls)
    figures = compare_checkpoints(per_replica, once)
    print(f"\noneshot tiny MoE, 2 CPU replicas, 10 iters, qdq once vs per replica: {figures}; "
          f"{len(shipped)} fanned-out calls with wrapped experts, all shipped; "
          f"{len(plain_calls)} with plain experts, none; block losses (first, best) per "
          f"replica {per_replica_losses}, qdq once {once_losses}")
    assert figures["other_tensors_equal"] == 1.0
    assert once_losses[0][0] == per_replica_losses[0][0]  # same inputs, same forward
    for first, best in once_losses:
        assert best <= first
    total_once = sum(best for _, best in once_losses)
    total_per_replica = sum(best for _, best in per_replica_losses)
    assert total_once <= 1.1 * total_per_replica


def test_plans_are_checked_once_per_fanned_call_and_forgotten_after(pool, monkeypatch):
    """Within one fanned-out call each experts module's plan is checked once (the
    preparation and the parts' forwards reuse it); after the call, and after a call
    that ran serially, nothing is remembered: the next call checks again and sees an
    in-place write to a wrapped weight made in between."""
    refreshes: list[int] = []
    refresh = grouped_autoround._Plan.refresh_if_changed

    def counted(self):
        refreshes.append(id(self.module))
        return refresh(self)

    monkeypatch.setattr(grouped_autoround._Plan, "refresh_if_changed", counted)
    block = wrapped_block()
    x = inputs(batch=4)
    with GroupedAutoRoundExperts(block, "block") as grouped, FanOut(block, pool, "block") as fan_out:
        block(x).float().sum().backward()  # builds the plans
        refreshes.clear()
        block(x).float().sum().backward()
        assert fan_out.parallel_calls == 2 and grouped.shipped_calls == 2
        assert len(refreshes) == len(set(refreshes)) == 2, "home and replica, once each"
        assert grouped.call_plans is None
        wrapper = next(m for m in block.modules() if isinstance(m, WrapperLinear))
        stacks = grouped._sites[0].plan_for(grouped._sites[0].home).runner.gate_up_qdq.weight
        with torch.no_grad():
            wrapper.orig_layer.weight.mul_(2)  # an in-place write between two calls
        block(x).float().sum().backward()
        rebuilt = grouped._sites[0].plan_for(grouped._sites[0].home).runner.gate_up_qdq.weight
        assert rebuilt is not stacks, "the write between the calls was not seen"
        assert grouped.call_plans is None
