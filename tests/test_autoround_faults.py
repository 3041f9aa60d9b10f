"""A replica failing in the middle of a real oneshot() run."""

import threading

import pytest
import torch
from auto_round.wrapper import WrapperLinear
from transformers import AutoModelForCausalLM

from llmcompressor import oneshot
from llmcompressor_parallel import DataParallelAutoRoundModifier
from llmcompressor_parallel.engine.worker_pool import live_worker_threads
from oneshot_runs import AUTOROUND_ARGS
from tiny_models import calibration_data, save_tiny_model


def test_failing_replica_stops_the_run_naming_the_device(tmp_path, monkeypatch):
    model_dir = save_tiny_model("dense", tmp_path / "model")
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    original = WrapperLinear.forward

    def fail_on_second_worker(self, x):
        if threading.current_thread().name.startswith("llmc-parallel-1"):
            raise RuntimeError("injected failure")
        return original(self, x)

    monkeypatch.setattr(WrapperLinear, "forward", fail_on_second_worker)
    modifier = DataParallelAutoRoundModifier(iters=3, data_parallel=["cpu", "cpu"], **AUTOROUND_ARGS)
    with pytest.raises(Exception) as error:
        oneshot(model=model, dataset=calibration_data(8, 16), recipe=modifier,
                num_calibration_samples=8, max_seq_length=16)
    chain = []
    current = error.value
    while current is not None:
        chain.append(str(current))
        current = current.__cause__ or current.__context__
    assert any("worker 1 on device cpu failed: RuntimeError: injected failure" in m for m in chain)
    assert not live_worker_threads()
    layer = model.model.layers[0]
    assert not any(isinstance(m, WrapperLinear) for m in layer.modules())
    for name, tensor in model.state_dict().items():
        if name in before:
            assert torch.equal(tensor.to(before[name].dtype), before[name]), name
