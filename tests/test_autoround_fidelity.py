"""Stock AutoRoundModifier vs DataParallelAutoRoundModifier, same model, data and seed.

The demo model (a trained MoE, so tuning has real signal) and a tiny random dense
model are quantized by both in the same test and the saved checkpoints are compared.
With parallelism off the modifier is stock, bit for bit. With replicas, every
forward is exact row for row, and with `exact_gradients` (the default) each wrapped
Linear's weight gradient is one matmul over the whole batch on the home, as stock's:
stock's checkpoint, bit for bit, grouped experts included (tuned on all tokens, their
stacks' gradients gathered the same way). Where weight gradients are summed per
replica (`exact_gradients=False`, or experts tuned on routed tokens), SignSGD turns the
other summation order into other rounding decisions within a few iterations
(bench/demo_int_agreement.py): those tests print the share of identical integers and
assert that the layers' losses agree with stock.
"""

import pytest

from llmcompressor.modifiers.autoround import AutoRoundModifier
from llmcompressor_parallel import DataParallelAutoRoundModifier
from llmcompressor_parallel.demo import calibration_dataset, demo_model_path
from oneshot_runs import AUTOROUND_ARGS, block_losses, compare_checkpoints, run_oneshot
from tiny_models import save_tiny_model

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

SAMPLES, SEQ_LEN, ITERS = 16, 64, 10


@pytest.fixture(scope="module")
def calibration():
    from transformers import AutoTokenizer

    return calibration_dataset(AutoTokenizer.from_pretrained(demo_model_path()), SAMPLES, SEQ_LEN)


@pytest.fixture(scope="module")
def stock(tmp_path_factory, calibration):
    """Stock AutoRound at batch_size 4 on the demo model: the reference for every test."""
    with block_losses() as losses:
        tensors = run_oneshot(
            demo_model_path(), AutoRoundModifier(iters=ITERS, **AUTOROUND_ARGS),
            tmp_path_factory.mktemp("stock"), SAMPLES, SEQ_LEN, dataset=calibration,
        )
    return tensors, list(losses)


@pytest.fixture(scope="module")
def two_replicas(tmp_path_factory, calibration):
    return _ours(tmp_path_factory.mktemp("two"), calibration, data_parallel=["cpu", "cpu"])


def _ours(tmp_path, calibration, **knobs):
    args = {**AUTOROUND_ARGS, **knobs.pop("override", {})}
    with block_losses() as losses:
        tensors = run_oneshot(
            demo_model_path(), DataParallelAutoRoundModifier(iters=ITERS, **args, **knobs),
            tmp_path, SAMPLES, SEQ_LEN, dataset=calibration,
        )
    return tensors, list(losses)


def _assert_losses_agree(stock_losses, our_losses, label):
    print(f"{label}: block losses (first, best) stock {stock_losses} ours {our_losses}")
    assert len(our_losses) == len(stock_losses) == 4
    # layer 0 starts from identical inputs and weights: its first loss is exact
    assert our_losses[0][0] == stock_losses[0][0]
    for (stock_first, stock_best), (our_first, our_best) in zip(stock_losses, our_losses):
        # later layers start from the previous quantized layers' outputs, which differ
        assert our_first == pytest.approx(stock_first, rel=0.1)
        assert our_best == pytest.approx(stock_best, rel=0.1)
        assert our_best <= our_first
    stock_total = sum(best for _, best in stock_losses)
    our_total = sum(best for _, best in our_losses)
    assert our_total == pytest.approx(stock_total, rel=0.05)


def test_off_without_grouped_experts_is_bit_identical(stock, tmp_path, calibration):
    ours, losses = _ours(tmp_path, calibration, data_parallel="off", grouped_experts=False)
    figures = compare_checkpoints(stock[0], ours)
    print(f"off, per-expert loop: {figures}")
    assert figures["int_identical"] == 1.0 and figures["worst_scale_rel"] == 0.0
    assert figures["other_tensors_equal"] == 1.0
    assert losses == stock[1]


def test_off_with_grouped_experts_agrees_with_stock(stock, tmp_path, calibration):
    """Grouped matmuls sum in stock's order but run other kernels than one Linear per
    expert; at this size the bits happen to match, at larger ones they need not."""
    ours, losses = _ours(tmp_path, calibration, data_parallel="off", grouped_experts=True)
    figures = compare_checkpoints(stock[0], ours)
    print(f"off, grouped experts: {figures}")
    assert figures["other_tensors_equal"] == 1.0
    _assert_losses_agree(stock[1], losses, "off, grouped experts")


def test_off_with_gpu_cache_setting_is_bit_identical(stock, tmp_path, calibration):
    ours, _ = _ours(tmp_path, calibration, data_parallel="off", keep_cache_on_gpu=True,
                    grouped_experts=False)
    figures = compare_checkpoints(stock[0], ours)
    assert figures["int_identical"] == 1.0 and figures["worst_scale_rel"] == 0.0


def _assert_bit_identical(stock_run, our_run, label: str) -> None:
    figures = compare_checkpoints(stock_run[0], our_run[0])
    print(f"{label}: {figures}")
    assert figures == {**figures, "int_identical": 1.0, "worst_scale_rel": 0.0,
                       "other_tensors_equal": 1.0}
    assert our_run[1] == stock_run[1]


@pytest.mark.parametrize("replicas", [2, 3], ids=["2-even", "3-uneven"])
def test_replicas_are_bit_identical_to_stock(stock, two_replicas, tmp_path, calibration, replicas):
    """The defaults (exact weight gradients, grouped experts on all tokens): stock's
    checkpoint."""
    if replicas == 2:
        ours = two_replicas
    else:
        ours = _ours(tmp_path, calibration, data_parallel=["cpu"] * replicas)
    split = "2+2" if replicas == 2 else "2+1+1"
    _assert_bit_identical(stock, ours, f"{replicas} CPU replicas (batch 4 split {split})")


def test_replicas_with_the_per_expert_loop_are_bit_identical_to_stock(stock, tmp_path, calibration):
    ours = _ours(tmp_path, calibration, data_parallel=["cpu", "cpu"], grouped_experts=False)
    _assert_bit_identical(stock, ours, "2 CPU replicas, per-expert loop")


def test_replicas_with_routed_expert_tokens_agree_with_stock(stock, tmp_path, calibration):
    """Experts tuned on their routed tokens only: the same math in another summation
    order, so other integers (printed); the losses agree."""
    ours, losses = _ours(tmp_path, calibration, data_parallel=["cpu", "cpu"],
                         grouped_expert_tokens="routed")
    figures = compare_checkpoints(stock[0], ours)
    print(f"2 CPU replicas, routed expert tokens: {figures}")
    assert figures["other_tensors_equal"] == 1.0 and figures["int_identical"] < 1.0
    _assert_losses_agree(stock[1], losses, "2 replicas, routed expert tokens")


def test_replicas_with_split_gradient_sums_agree_with_stock(stock, tmp_path, calibration):
    """exact_gradients=False: each replica sums its rows' weight gradients; SignSGD turns
    the other summation order into other integers (printed), the losses agree."""
    ours, losses = _ours(tmp_path, calibration, data_parallel=["cpu", "cpu"],
                         grouped_experts=False, exact_gradients=False)
    figures = compare_checkpoints(stock[0], ours)
    print(f"2 CPU replicas, per-replica gradient sums: {figures}")
    assert figures["other_tensors_equal"] == 1.0 and figures["int_identical"] < 1.0
    _assert_losses_agree(stock[1], losses, "2 replicas, per-replica sums")


def test_per_replica_batch_is_stock_with_the_global_batch(stock, tmp_path, calibration):
    """2 replicas x batch_size 2 each is stock's batch_size 4: bit for bit."""
    ours = _ours(
        tmp_path, calibration, data_parallel=["cpu", "cpu"], parallel_batch="per_replica",
        override={"batch_size": 2},
    )
    _assert_bit_identical(stock, ours, "per_replica 2 x 2 vs stock batch 4")


@pytest.mark.parametrize("replicas", [2, 3], ids=["2-even", "3-uneven"])
def test_dense_model_replicas_are_bit_identical_to_stock(tmp_path, replicas):
    """A tiny random Llama (batch 4 of 16 samples: splits 2+2 and 2+1+1)."""
    model = save_tiny_model("dense", tmp_path / "model")
    runs = []
    for label, recipe in [
        ("stock", AutoRoundModifier(iters=ITERS, **AUTOROUND_ARGS)),
        ("ours", DataParallelAutoRoundModifier(iters=ITERS, data_parallel=["cpu"] * replicas,
                                               **AUTOROUND_ARGS)),
    ]:
        with block_losses() as losses:
            tensors = run_oneshot(model, recipe, tmp_path / label)
        runs.append((tensors, list(losses)))
    _assert_bit_identical(runs[0], runs[1], f"tiny dense, {replicas} CPU replicas")
