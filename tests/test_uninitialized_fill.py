"""NaN fills of new tensors are skipped while auto-round's tuning loop runs, and only then."""

import pytest
import torch
import torch.utils.deterministic as deterministic
import auto_round.compressors.orchestrator as orchestrator
from auto_round.algorithms.quantization.sign_round.quantizer import SignRoundQuantizer

from llmcompressor import oneshot
from llmcompressor_parallel import DataParallelAutoRoundModifier
from llmcompressor_parallel.engine.uninitialized_fill import skipping_uninitialized_fill
from oneshot_runs import AUTOROUND_ARGS
from tiny_models import calibration_data, save_tiny_model


def test_the_setting_is_off_inside_and_restored_after_an_error():
    before = deterministic.fill_uninitialized_memory
    with pytest.raises(ValueError, match="inside"):
        with skipping_uninitialized_fill():
            assert deterministic.fill_uninitialized_memory is False
            raise ValueError("inside")
    assert deterministic.fill_uninitialized_memory == before


def test_new_tensors_stay_unfilled_inside():
    """What the setting changes: under deterministic algorithms torch.empty is NaN-filled."""
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        with torch.profiler.profile() as outside:
            torch.empty(64)
        with skipping_uninitialized_fill(), torch.profiler.profile() as inside:
            torch.empty(64)
    finally:
        torch.use_deterministic_algorithms(previous)
    fills = [[e.key for e in run.key_averages() if e.key == "aten::fill_"] for run in (outside, inside)]
    assert fills == [["aten::fill_"], []]


@pytest.mark.parametrize("nan_fill", [False, True])
def test_tuning_runs_with_the_knob_and_the_setting_comes_back(tmp_path, monkeypatch, nan_fill):
    """Inside the tuning loop the knob's setting; in the rest of auto-round's per-layer
    call (its move of the layer to host memory) and after, stock's."""
    tuning: list[bool] = []
    moving: list[bool] = []
    original, original_move = SignRoundQuantizer.quantize_block, orchestrator.mv_module_from_gpu

    def spy(self, *args, **kwargs):
        tuning.append(deterministic.fill_uninitialized_memory)
        return original(self, *args, **kwargs)

    def spy_move(module):
        moving.append(deterministic.fill_uninitialized_memory)
        return original_move(module)

    monkeypatch.setattr(SignRoundQuantizer, "quantize_block", spy)
    monkeypatch.setattr(orchestrator, "mv_module_from_gpu", spy_move)
    before = deterministic.fill_uninitialized_memory
    modifier = DataParallelAutoRoundModifier(iters=2, nan_fill_new_tensors=nan_fill, **AUTOROUND_ARGS)
    oneshot(model=str(save_tiny_model("moe", tmp_path / "model")), dataset=calibration_data(8, 16),
            recipe=modifier, num_calibration_samples=8, max_seq_length=16)
    assert tuning and all(value is nan_fill for value in tuning)
    assert moving and all(value == before for value in moving)
    assert deterministic.fill_uninitialized_memory == before
