"""Host-side work of AutoRound that the modifier trims without touching the numbers.

- `ForeachSignSGD`: auto-round's SignSGD step as multi-tensor kernels; the same
  parameters bit for bit after several scheduled steps, and used in real runs.
- `young_objects_gc`: auto-round's per-layer full collections traverse only the
  layer's new objects; cycles are still collected and the freeze is undone.
The full-run equality with stock (tests/test_autoround_fidelity.py) covers both too.
"""

import gc
import weakref

import pytest
import torch
from auto_round.algorithms.quantization.sign_round.quantizer import SignRoundQuantizer
from auto_round.algorithms.quantization.sign_round.sign_sgd import SignSGD

from llmcompressor_parallel import DataParallelAutoRoundModifier
from llmcompressor_parallel.engine.foreach_sign_sgd import ForeachSignSGD
from llmcompressor_parallel.engine.gc_scope import young_objects_gc
from oneshot_runs import AUTOROUND_ARGS, run_oneshot
from tiny_models import save_tiny_model

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


def _params(seed: int) -> list[torch.Tensor]:
    """auto-round-like tuning tensors: offsets and scale factors, fp32 and bf16, with
    exact-zero gradients, negative zeros and one tensor without a gradient."""
    generator = torch.Generator().manual_seed(seed)
    shapes = [(8, 16), (8, 1), (4, 4), (), (3, 5, 7)]
    params = []
    for index, shape in enumerate(shapes * 2):
        dtype = torch.bfloat16 if index % 3 == 2 else torch.float32
        params.append(torch.randn(shape, generator=generator).to(dtype).requires_grad_())
    return params


def _grads(params: list[torch.Tensor], step: int) -> None:
    generator = torch.Generator().manual_seed(100 + step)
    for index, p in enumerate(params):
        if index == 4:
            p.grad = None
            continue
        grad = torch.randn(p.shape, generator=generator).to(p.dtype)
        grad[grad.abs() < 0.3] = 0.0
        grad[(grad.abs() > 0.3) & (grad.abs() < 0.4)] = -0.0
        p.grad = grad


def _optimizer(kind: type, params: list[torch.Tensor], **extra) -> torch.optim.Optimizer:
    """As auto-round builds it: groups with tensor learning rates, a LinearLR schedule."""
    groups = [
        {"params": params[:6], "lr": torch.tensor(0.005)},
        {"params": params[6:], "lr": torch.tensor(1.0 / 3)},
    ]
    return kind(groups, lr=torch.tensor(0.005), weight_decay=0, **extra)


@pytest.mark.parametrize("extra", [{}, {"momentum": 0.9}], ids=["plain", "momentum"])
def test_foreach_step_equals_stock_step(extra):
    stock_params, ours_params = _params(0), _params(0)
    stock_opt, ours_opt = _optimizer(SignSGD, stock_params, **extra), _optimizer(ForeachSignSGD, ours_params, **extra)
    schedules = [torch.optim.lr_scheduler.LinearLR(o, 1.0, 0.0, total_iters=5) for o in (stock_opt, ours_opt)]
    for step in range(5):
        for params, opt, schedule in zip((stock_params, ours_params), (stock_opt, ours_opt), schedules):
            _grads(params, step)
            opt.step()
            opt.zero_grad()
            schedule.step()
    changed = 0
    for before, stock, ours in zip(_params(0), stock_params, ours_params):
        assert stock.dtype == ours.dtype
        assert torch.equal(stock, ours)
        changed += int(not torch.equal(before, stock))
    assert changed >= 8  # the steps did move the parameters


def test_young_objects_gc_collects_and_unfreezes():
    class Node:
        pass

    def cycle() -> None:
        a, b = Node(), Node()
        a.other, b.other = b, a

    before = gc.get_freeze_count()  # Python 3.12 may start with a few frozen objects
    cycle()  # garbage from before the block: collected on entry
    with young_objects_gc():
        assert gc.get_freeze_count() > before
        cycle()
        assert gc.collect() >= 2  # the block's own cycles are still found
    if before == 0:
        assert gc.get_freeze_count() == 0


def test_young_objects_gc_keeps_an_earlier_freeze():
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        with young_objects_gc():
            assert gc.get_freeze_count() >= frozen
        assert gc.get_freeze_count() >= frozen
    finally:
        gc.unfreeze()


def test_young_objects_gc_collects_the_blocks_garbage_on_exit():
    class Node:
        pass

    collected = []
    with young_objects_gc():
        a, b = Node(), Node()
        a.other, b.other = b, a
        ref = weakref.ref(a, lambda _ref: collected.append(True))
        del a, b
    assert collected and ref() is None


def test_run_uses_foreach_steps_and_frozen_collections(tmp_path, monkeypatch):
    steps, freezes = [], []
    real_step, real_block = ForeachSignSGD.step, SignRoundQuantizer.quantize_block

    def counted_step(self, *args, **kwargs):
        steps.append(type(self))
        return real_step(self, *args, **kwargs)

    def observed_block(self, *args, **kwargs):
        freezes.append(gc.get_freeze_count())
        return real_block(self, *args, **kwargs)

    frozen_before = gc.get_freeze_count()
    monkeypatch.setattr(ForeachSignSGD, "step", counted_step)
    monkeypatch.setattr(SignRoundQuantizer, "quantize_block", observed_block)
    model = save_tiny_model("moe", tmp_path / "model")
    run_oneshot(model, DataParallelAutoRoundModifier(iters=3, data_parallel="off", **AUTOROUND_ARGS),
                tmp_path / "out", samples=8)
    layers = len(freezes)
    assert layers >= 2 and all(count > frozen_before for count in freezes)
    assert steps == [ForeachSignSGD] * (3 * layers)
    if frozen_before == 0:
        assert gc.get_freeze_count() == 0
