"""The fan-out engine on CPU replicas: exact outputs, summed gradients, fault paths."""

import inspect
import threading

import pytest
import torch
from loguru import logger

from llmcompressor_parallel.engine import DeviceWorkerPool, FanOut, ReplicaError
from llmcompressor_parallel.engine.scatter_gather import split_sizes
from llmcompressor_parallel.engine.worker_pool import live_worker_threads
from tiny_models import decoder_layer_and_inputs

CPU = torch.device("cpu")


@pytest.fixture
def layer_and_inputs():
    return decoder_layer_and_inputs("cpu")


def _loss_and_grads(layer, inputs):
    output = layer(**inputs)
    loss = output.float().pow(2).mean()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in layer.named_parameters() if p.grad is not None}
    for param in layer.parameters():
        param.grad = None
    return output.detach(), grads


def test_split_sizes_are_even_and_ordered():
    assert split_sizes(5, 3) == [2, 2, 1]
    assert split_sizes(8, 2) == [4, 4]
    assert split_sizes(2, 2) == [1, 1]


@pytest.mark.parametrize("replicas", [2, 3])
def test_fan_out_matches_serial_forward_and_gradients(layer_and_inputs, replicas):
    layer, inputs = layer_and_inputs
    serial_out, serial_grads = _loss_and_grads(layer, inputs)
    with DeviceWorkerPool([CPU] * replicas) as pool, FanOut(layer, pool) as fan_out:
        parallel_out, parallel_grads = _loss_and_grads(layer, inputs)
    assert fan_out.parallel_calls == 1
    assert torch.equal(parallel_out, serial_out)  # forward rows do not depend on the split
    for name, grad in serial_grads.items():
        relative = ((parallel_grads[name] - grad).norm() / grad.norm()).item()
        print(f"{replicas} replicas, grad {name}: relative difference {relative:.2e}")
        assert relative < 1e-5  # only the order of the batch summation differs


def test_signature_is_preserved_and_restored(layer_and_inputs):
    layer, _ = layer_and_inputs
    before = inspect.signature(layer.forward)
    with DeviceWorkerPool([CPU, CPU]) as pool, FanOut(layer, pool):
        assert inspect.signature(layer.forward) == before
        assert "forward" in layer.__dict__
    assert "forward" not in layer.__dict__


def test_grad_mode_and_autocast_reach_the_workers(layer_and_inputs, monkeypatch):
    layer, inputs = layer_and_inputs
    seen = []
    mlp_class = type(layer.mlp)
    original = mlp_class.forward

    def recording_forward(self, x):
        seen.append((threading.current_thread().name, torch.is_grad_enabled(),
                     torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu")))
        return original(self, x)

    monkeypatch.setattr(mlp_class, "forward", recording_forward)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        serial = layer(**inputs)
        seen.clear()
        with DeviceWorkerPool([CPU, CPU]) as pool, FanOut(layer, pool):
            parallel = layer(**inputs)
    assert torch.equal(serial, parallel)
    assert not parallel.requires_grad
    threads = sorted(name.split("-")[2] for name, *_ in seen)
    assert threads == ["0", "1"]  # one share on each worker
    print(seen)
    assert all(tuple(state) == (False, True, torch.bfloat16) for _, *state in seen)


def test_batch_of_one_runs_on_home_only(layer_and_inputs):
    layer, inputs = layer_and_inputs
    single = {**inputs, "hidden_states": inputs["hidden_states"][:1], "attention_mask": inputs["attention_mask"][:1]}
    with DeviceWorkerPool([CPU, CPU]) as pool, FanOut(layer, pool) as fan_out:
        layer(**single)
    assert fan_out.calls == 1 and fan_out.parallel_calls == 0


def test_hook_inside_layer_forces_serial_with_a_reason(layer_and_inputs):
    layer, inputs = layer_and_inputs
    calls = []
    handle = layer.mlp.down_proj.register_forward_hook(lambda m, a, o: calls.append(a[0].shape[0]))
    messages = []
    sink = logger.add(lambda message: messages.append(str(message)), level="INFO")
    try:
        with DeviceWorkerPool([CPU, CPU]) as pool, FanOut(layer, pool, "L0") as fan_out:
            layer(**inputs)
            layer(**inputs)
    finally:
        logger.remove(sink)
        handle.remove()
    assert fan_out.parallel_calls == 0
    assert calls == [5, 5]  # the hook saw the whole batch each time: its statistics are exact
    reasons = [m for m in messages if "running serially" in m]
    assert len(reasons) == 1 and "mlp.down_proj" in reasons[0]  # logged once per layer


def test_replicas_follow_changes_of_the_home_layer(layer_and_inputs):
    layer, inputs = layer_and_inputs
    with torch.no_grad(), DeviceWorkerPool([CPU, CPU]) as pool, FanOut(layer, pool):
        layer(**inputs)
        layer.mlp.gate_proj.weight.mul_(0.5)  # in-place write: version counter moves
        layer.mlp.down_proj.weight = torch.nn.Parameter(  # new tensor object
            torch.randn_like(layer.mlp.down_proj.weight), requires_grad=False
        )
        layer.mlp.act_fn = torch.nn.ReLU()  # structure change: replica rebuilt
        parallel = layer(**inputs)
    serial = layer(**inputs)
    assert torch.equal(parallel, serial)


def test_failure_in_one_replica_names_the_device_and_stops_cleanly(
    layer_and_inputs, linear_fails_on_worker_1
):
    layer, inputs = layer_and_inputs
    before = {n: p.clone() for n, p in layer.state_dict().items()}
    pool = DeviceWorkerPool([CPU, CPU])
    try:
        with pytest.raises(ReplicaError, match=r"worker 1 on device cpu failed: RuntimeError: injected"):
            with FanOut(layer, pool):
                layer(**inputs)
    finally:
        pool.close()
    assert not live_worker_threads()
    assert "forward" not in layer.__dict__
    for name, tensor in layer.state_dict().items():
        assert torch.equal(tensor, before[name])


def test_pool_threads_are_persistent_and_end_on_close():
    pool = DeviceWorkerPool([CPU, CPU, CPU])
    first = pool.run([threading.get_ident for _ in range(3)])
    second = pool.run([threading.get_ident for _ in range(3)])
    assert first == second and len(set(first)) == 3
    assert len(live_worker_threads()) == 3
    pool.close()
    assert not live_worker_threads()
    with pytest.raises(RuntimeError, match="closed"):
        pool.run([lambda: None])


def test_bf16_autocast_gradients_differ_only_by_rounding_of_partials(layer_and_inputs):
    """Under autocast each replica's weight-gradient partial is rounded to bf16 before
    the partials are added; stock rounds the whole-batch sum once. DESIGN.md measured
    99.92% equal gradient signs on H200; this is the CPU counterpart."""
    layer, inputs = layer_and_inputs
    with torch.autocast("cpu", dtype=torch.bfloat16):
        serial_out, serial_grads = _loss_and_grads(layer, inputs)
        with DeviceWorkerPool([CPU, CPU]) as pool, FanOut(layer, pool):
            parallel_out, parallel_grads = _loss_and_grads(layer, inputs)
    assert torch.equal(parallel_out, serial_out)
    for name, grad in serial_grads.items():
        same_sign = (torch.sign(parallel_grads[name]) == torch.sign(grad)).float().mean().item()
        relative = ((parallel_grads[name].float() - grad.float()).norm() / grad.float().norm()).item()
        print(f"bf16 grad {name}: {same_sign:.4%} signs equal, relative difference {relative:.2e}")
        assert same_sign >= 0.995  # tiny layer, 80 tokens; DESIGN.md: 99.92% at Llama-8B shape
        assert relative < 1e-2  # bf16 rounding of two partials, not a wrong gradient


def test_interrupt_while_waiting_stops_cleanly():
    """Ctrl-C in the caller while workers run: they finish their job, then it propagates."""
    import _thread
    import time

    pool = DeviceWorkerPool([CPU, CPU])
    finished = []

    def slow(index):
        def job():
            if index == 0:
                _thread.interrupt_main()
            time.sleep(0.3)
            finished.append(index)
        return job

    with pytest.raises(KeyboardInterrupt):
        pool.run([slow(0), slow(1)])
    assert sorted(finished) == [0, 1]  # nothing was left running behind the interrupt
    pool.close()
    assert not live_worker_threads()


def test_compiled_replicas_compile_each_share_once(layer_and_inputs, monkeypatch):
    layer, inputs = layer_and_inputs
    compiled = []

    def fake_compile(function):
        compiled.append(function)
        return function

    monkeypatch.setattr(torch, "compile", fake_compile)
    with torch.no_grad(), DeviceWorkerPool([CPU, CPU]) as pool, FanOut(layer, pool, compile_replicas=True):
        first = layer(**inputs)
        second = layer(**inputs)
    assert len(compiled) == 2  # one per share, reused by the second call
    assert torch.equal(first, second)
