"""A layer forward raising under the stock pipeline stops the worker pool (CPU).

`engine.forward_error_hooks` (always-called forward hooks, removed without breaking
torch's iteration over a module's hooks) and its use by both modifiers while they
hold a pool outside "parallel_sequential" (`modifiers.worker_guard`).
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM

from llmcompressor_parallel import DataParallelAutoRoundModifier
from llmcompressor_parallel.engine.forward_error_hooks import ForwardErrorHooks
from llmcompressor_parallel.engine.worker_pool import live_worker_threads
from llmcompressor_parallel.modifiers.gptq import ParallelGPTQExpertModifier
from oneshot_runs import AUTOROUND_ARGS, calibrate_in_order

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

SAMPLES = 8


class _Failing(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() < 0:
            raise ValueError("injected")
        return x + 1


def _ours(module: nn.Module) -> list[Any]:
    return [
        hook for hook in module._forward_hooks.values()
        if isinstance(getattr(hook, "__self__", None), ForwardErrorHooks)
    ]


@pytest.mark.parametrize("ours_first", [True, False])
def test_removing_itself_on_error_keeps_the_error_and_other_hooks(ours_first):
    """on_error removes the hooks while torch iterates them; another always-called hook
    comes after (or before) ours: the forward's own error reaches the caller, the other
    hook runs, its handle still removes it, and what is left of ours goes at the next
    successful forward."""
    module, calls = _Failing(), []
    errors = ForwardErrorHooks(lambda m, name, error: (calls.append((name, str(error))),
                                                      errors.remove()))
    other = lambda *_: calls.append("other")  # noqa: E731
    if ours_first:
        errors.add({module: "failing"})
        handle = module.register_forward_hook(other, always_call=True)
    else:
        handle = module.register_forward_hook(other, always_call=True)
        errors.add({module: "failing"})
    with pytest.raises(ValueError, match="^injected$"):
        module(-torch.ones(2))
    expected = [("failing", "injected"), "other"] if ours_first else ["other", ("failing", "injected")]
    assert calls == expected and len(errors) == 0 and not _ours(module)
    assert torch.equal(module(torch.ones(2)), torch.full((2,), 2.0))  # normal call: cleans up
    assert list(module._forward_hooks.values()) == [other] and calls[-1] == "other"
    handle.remove()
    assert not module._forward_hooks and not module._forward_hooks_always_called


def test_paused_hooks_call_nothing_and_normal_forwards_call_nothing():
    module, calls = _Failing(), []
    errors = ForwardErrorHooks(lambda *args: calls.append(args))
    errors.add({module: "failing"})
    module(torch.ones(2))
    with errors.paused(), pytest.raises(ValueError):
        module(-torch.ones(2))
    assert calls == []
    with pytest.raises(ValueError):
        module(-torch.ones(2))
    assert [(m, name, str(e)) for m, name, e in calls] == [(module, "failing", "injected")]
    errors.remove()
    assert not module._forward_hooks


# ------------------------------------------------------------------ through oneshot
def _fail_in_layer_1(monkeypatch, model: nn.Module, fail_at: int) -> list[int]:
    """Layer 1's forward raises at its `fail_at`-th call (its calibration pass)."""
    failing = model.model.layers[1]
    layer_cls = type(failing)
    real_forward, calls = layer_cls.forward, [0]

    @functools.wraps(real_forward)  # the fan-out reads the layer's signature
    def forward(self, *args, **kwargs):
        if self is failing:
            calls[0] += 1
            if calls[0] == fail_at:
                assert len(live_worker_threads()) == 2  # the pool is up
                raise RuntimeError("injected failure in model.layers.1")
        return real_forward(self, *args, **kwargs)

    monkeypatch.setattr(layer_cls, "forward", forward)
    return calls


def _assert_oneshot_raises_the_injected_failure(model: nn.Module, recipe: Any) -> None:
    with pytest.raises(RuntimeError) as error:
        calibrate_in_order(model, recipe, SAMPLES)
    assert type(error.value) is RuntimeError
    assert str(error.value) == "injected failure in model.layers.1"


def _assert_nothing_left(model: nn.Module, recipe: Any) -> None:
    assert live_worker_threads() == []
    assert recipe._pool is None and recipe._worker_guard is None
    assert not any(_ours(module) for module in model.modules())


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_gptq_layer_forward_raising_under_stock_pipeline_stops_the_workers(
    model_dirs, monkeypatch, kind
):
    model = AutoModelForCausalLM.from_pretrained(model_dirs[kind], dtype=torch.float32)
    recipe = ParallelGPTQExpertModifier(
        data_parallel=["cpu", "cpu"], grouped_experts=False,
        targets="Linear", scheme="W4A16", ignore=["lm_head"],
    )
    calls = _fail_in_layer_1(monkeypatch, model, fail_at=3)
    _assert_oneshot_raises_the_injected_failure(model, recipe)
    assert calls[0] == 3
    _assert_nothing_left(model, recipe)


def test_autoround_layer_forward_raising_in_input_capture_stops_the_workers(
    model_dirs, monkeypatch
):
    """Layer 0 is tuned on the pool (the guard paused meanwhile); layer 1's
    input-capture pass raises."""
    model = AutoModelForCausalLM.from_pretrained(model_dirs["dense"], dtype=torch.float32)
    recipe = DataParallelAutoRoundModifier(
        iters=2, data_parallel=["cpu", "cpu"], grouped_experts=False, **AUTOROUND_ARGS
    )
    calls = _fail_in_layer_1(monkeypatch, model, fail_at=2)
    _assert_oneshot_raises_the_injected_failure(model, recipe)
    assert calls[0] == 2
    _assert_nothing_left(model, recipe)


def test_gptq_reused_after_a_failed_parallel_run_forgets_the_pipeline(model_dirs, monkeypatch):
    """A failed parallel_sequential run, then the same instance under the stock pipeline:
    the second run must install its guard again (it is skipped under parallel_sequential)."""
    model = AutoModelForCausalLM.from_pretrained(model_dirs["dense"], dtype=torch.float32)
    recipe = ParallelGPTQExpertModifier(
        data_parallel=["cpu", "cpu"], grouped_experts=False,
        targets="Linear", scheme="W4A16", ignore=["lm_head"],
    )
    _fail_in_layer_1(monkeypatch, model, fail_at=1)
    with pytest.raises(Exception):
        calibrate_in_order(model, recipe, SAMPLES, pipeline="parallel_sequential")
    assert not recipe._in_parallel_pipeline
    assert live_worker_threads() == []
