"""The pipeline's input-capture pass with grouped experts vs stock (CPU).

`DataParallelAutoRoundModifier(grouped_experts=True)` runs each layer's calibration
forwards (where AutoRound's hook captures the decoder layer's inputs) with the
layer's linearised experts grouped. With error propagation off, layer k's captured
inputs are layer k-1's unquantized outputs of that pass, so they show what the
grouped experts change. Figures are printed (-s).
"""

from __future__ import annotations

import contextlib
import copy
import functools
from pathlib import Path
from typing import Iterator

import pytest
import torch
from compressed_tensors.offload import disable_offloading, set_onload_device
from oneshot_runs import AUTOROUND_ARGS, compare_checkpoints, log_lines, run_oneshot
from pydantic import ValidationError
from tiny_models import calibration_data, moe_config, save_tiny_model, word_tokenizer
from transformers import AutoModelForCausalLM
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

from llmcompressor.modeling.moe.context import moe_calibration_context
from llmcompressor.modeling.moe.linear_experts import LinearExperts2D
from llmcompressor.modifiers.autoround import AutoRoundModifier
from llmcompressor_parallel import DataParallelAutoRoundModifier
from llmcompressor_parallel.engine.offload_forward import offload_onload_device, same_device
from llmcompressor_parallel.modifiers.autoround_capture import GroupedCapture

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

SAMPLES, SEQ_LEN = 16, 32


# ------------------------------------------------------------------ helpers
def save_moe(folder: Path, dtype: torch.dtype, layers: int = 3) -> Path:
    """The tiny MoE of tiny_models.py with more layers and experts, saved in `dtype`."""
    config = moe_config()
    config.num_hidden_layers, config.num_experts = layers, 8
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).to(dtype).save_pretrained(folder)
    word_tokenizer().save_pretrained(folder)
    return folder


@contextlib.contextmanager
def captured_inputs() -> Iterator[dict[str, torch.Tensor]]:
    """Each decoder layer's captured hidden states, as stock's apply_autoround gets them."""
    captured: dict[str, torch.Tensor] = {}
    real = AutoRoundModifier.apply_autoround

    def record(self, state, modules):
        for module in modules or []:
            if self._is_decoding_layer(module):
                calls = self._all_module_input[module._tmp_name]
                captured[module._tmp_name] = torch.cat([args[0] for args, _ in calls])
        return real(self, state, modules)

    AutoRoundModifier.apply_autoround = record
    try:
        yield captured
    finally:
        AutoRoundModifier.apply_autoround = real



def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


@functools.lru_cache(maxsize=None)
def _offloaded_block() -> Qwen3MoeSparseMoeBlock:
    config = moe_config()
    config.num_experts = 8
    torch.manual_seed(0)
    block = Qwen3MoeSparseMoeBlock(config)
    for param in block.parameters():
        torch.nn.init.normal_(param, std=0.1)
    cls = LinearExperts2D.get_linear_experts_cls(type(block.experts))
    block.experts = cls.from_experts_module(block.experts, config)
    block.requires_grad_(False)
    return block


def offloaded_block() -> Qwen3MoeSparseMoeBlock:
    """A linearised MoE block with every module offloaded, as the sequential pipeline has it."""
    block = copy.deepcopy(_offloaded_block())
    set_onload_device(block, "cpu")
    return block


def block_input() -> torch.Tensor:
    return torch.randn(2, 24, 128, generator=torch.Generator().manual_seed(1))


def calibration_call(block: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """One call as in the pipeline's calibration pass (no grad, weights kept onloaded)."""
    with torch.no_grad(), disable_offloading(), moe_calibration_context():
        return block(x)


# ------------------------------------------------------------------ unit level
def test_offloaded_experts_run_grouped_and_get_their_forwards_back():
    block = offloaded_block()
    assert offload_onload_device(block.experts) is not None  # the pipeline's wrapper is on
    saved = block.experts.__dict__["forward"]
    x = block_input()
    stock = calibration_call(block, x)
    capture = GroupedCapture()
    capture.opened(block)
    assert block.experts.__dict__["forward"] is not saved
    grouped = [calibration_call(block, x) for _ in range(2)]
    capture.close([block])
    assert block.experts.__dict__["forward"] is saved and not block._forward_hooks
    assert capture.counts[type(block).__name__] == (2, 0)
    print(f"\noffloaded block, grouped vs stock: rel {rel(grouped[0], stock):.2e}, "
          f"bit-identical {torch.equal(grouped[0], stock)}")
    assert rel(grouped[0], stock) < 1e-6 and torch.equal(grouped[0], grouped[1])


def test_hook_on_an_expert_keeps_the_stock_loop_with_one_log_line():
    block = offloaded_block()
    seen = []
    block.experts[3].up_proj.register_forward_hook(lambda m, a, out: seen.append(out.shape))
    x = block_input()
    stock = calibration_call(block, x)
    stock_calls = len(seen)
    capture = GroupedCapture()
    with log_lines() as lines:
        capture.opened(block)
        outputs = [calibration_call(block, x) for _ in range(2)]
        capture.close()
    assert stock_calls > 0 and len(seen) == 3 * stock_calls  # the hook ran every time
    assert all(torch.equal(out, stock) for out in outputs)
    assert capture.counts[type(block).__name__] == (0, 2)
    loop_lines = [line for line in lines if "per-expert loop: a hook" in line]
    print("\n" + loop_lines[0].strip())
    assert len(loop_lines) == 1


def test_a_failing_forward_gives_the_experts_their_forwards_back():
    block = offloaded_block()
    saved = block.experts.__dict__["forward"]
    capture = GroupedCapture()
    capture.opened(block)
    with pytest.raises(RuntimeError):
        calibration_call(block, torch.zeros(2, 3, 7))  # wrong hidden size
    assert block.experts.__dict__["forward"] is saved
    assert not block._forward_hooks and not capture._open


def test_a_failing_forward_with_another_always_called_hook_keeps_its_error():
    """Another always-called hook follows the capture's on the block: the capture's
    removes itself while torch iterates the block's hooks, and the caller still gets
    the forward's own error (not "OrderedDict mutated during iteration"); the other
    hook runs and its handle still removes it."""
    bad_input = torch.zeros(2, 3, 7)  # wrong hidden size
    with pytest.raises(RuntimeError) as plain:
        calibration_call(offloaded_block(), bad_input)
    block = offloaded_block()
    saved = block.experts.__dict__["forward"]
    capture = GroupedCapture()
    capture.opened(block)
    calls = []
    other = block.register_forward_hook(lambda *_: calls.append("other"), always_call=True)
    with pytest.raises(RuntimeError) as error:
        calibration_call(block, bad_input)
    assert str(error.value) == str(plain.value)
    assert calls == ["other"] and not capture._open
    assert block.experts.__dict__["forward"] is saved
    other.remove()
    calibration_call(block, block_input())  # what is left of the capture's hook goes
    assert not block._forward_hooks and not block._forward_hooks_always_called


def test_offload_helpers():
    block = offloaded_block()
    assert same_device(offload_onload_device(block.experts[0].up_proj), "cpu")
    block.experts.forward = block.experts.__dict__["forward"].__func__.__get__(block)  # foreign
    assert offload_onload_device(block.experts) is None


# ------------------------------------------------------------------ through oneshot
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_grouped_capture_gives_stock_captured_inputs(tmp_path, dtype):
    model = save_moe(tmp_path / "model", dtype)
    data = calibration_data(SAMPLES, SEQ_LEN)
    runs = {}
    for label, modifier in (
        ("stock", AutoRoundModifier(iters=2, **AUTOROUND_ARGS)),
        ("grouped", DataParallelAutoRoundModifier(iters=2, **AUTOROUND_ARGS)),
    ):
        with captured_inputs() as captured:
            run_oneshot(model, modifier, tmp_path / label, SAMPLES, SEQ_LEN, dataset=data)
        runs[label] = (captured, modifier)
    stock, (grouped, ours) = runs["stock"][0], runs["grouped"]
    assert ours._capture.counts and all(
        calls == (SAMPLES, 0) for calls in ours._capture.counts.values()
    )
    assert stock.keys() == grouped.keys() and len(stock) == 3
    assert grouped["model.layers.0"].dtype == dtype
    figures = {}
    for name in stock:
        a, b = grouped[name], stock[name]
        figures[name] = (rel(a, b), (a == b).float().mean().item())
    print(f"\ncaptured inputs {dtype}, grouped vs stock (rel max error, share identical): "
          + "; ".join(f"{n} {r:.2e} {s:.2%}" for n, (r, s) in figures.items()))
    assert torch.equal(grouped["model.layers.0"], stock["model.layers.0"])  # embeddings
    tolerance = 1e-2 if dtype == torch.bfloat16 else 1e-5
    assert all(r < tolerance for r, _ in figures.values())


def test_oneshot_tiny_moe_ours_matches_stock(tmp_path):
    """Capture and tuning grouped, 20 iterations: >= 99% of the integers of stock."""
    model = save_tiny_model("moe", tmp_path / "model")
    stock = run_oneshot(model, AutoRoundModifier(iters=20, **AUTOROUND_ARGS), tmp_path / "stock")
    ours = DataParallelAutoRoundModifier(iters=20, **AUTOROUND_ARGS)
    grouped = run_oneshot(model, ours, tmp_path / "ours")
    figures = compare_checkpoints(stock, grouped)
    print(f"\noneshot tiny MoE, grouped capture + tuning, 20 iters: {figures}; "
          f"capture calls (grouped, loop) {ours._capture.counts}")
    assert all(calls == (16, 0) for calls in ours._capture.counts.values())
    assert figures["int_identical"] >= 0.99 and figures["other_tensors_equal"] == 1.0


def test_grouped_experts_off_captures_with_the_stock_loop(tmp_path):
    model = save_tiny_model("moe", tmp_path / "model")
    ours = DataParallelAutoRoundModifier(iters=1, grouped_experts=False, **AUTOROUND_ARGS)
    run_oneshot(model, ours, tmp_path / "ours", samples=4)
    assert ours._capture is None


@pytest.mark.parametrize("value", ["fast", True, None])
def test_bad_grouped_expert_tokens_fail_at_construction(value):
    with pytest.raises(ValidationError, match="allowed values: 'auto', 'all', 'routed'"):
        DataParallelAutoRoundModifier(scheme="W4A16", targets="Linear",
                                      grouped_expert_tokens=value)


# ------------------------------------------------------------------ data-parallel capture
def test_parallel_capture_gives_the_serial_run_bit_for_bit(tmp_path):
    """Under "parallel_sequential" each CPU replica captures its run of batches with the
    experts grouped; the captured inputs and the checkpoint equal the serial pipeline's."""
    model = save_moe(tmp_path / "model", torch.float32)
    data = calibration_data(SAMPLES, SEQ_LEN)
    runs = {}
    for pipeline in ("sequential", "parallel_sequential"):
        ours = DataParallelAutoRoundModifier(iters=2, data_parallel=["cpu", "cpu"], **AUTOROUND_ARGS)
        with captured_inputs() as captured, log_lines() as lines:
            saved = run_oneshot(model, ours, tmp_path / pipeline, SAMPLES, SEQ_LEN,
                                dataset=data, pipeline=pipeline)
        runs[pipeline] = (captured, saved, ours, lines)
    (serial, serial_saved, _, _), (parallel, parallel_saved, ours, lines) = runs.values()
    assert serial.keys() == parallel.keys() and len(serial) == 3
    for name in serial:
        assert torch.equal(serial[name], parallel[name]), name
    assert compare_checkpoints(serial_saved, parallel_saved)["int_identical"] == 1.0
    assert all(tensor.equal(parallel_saved[key]) for key, tensor in serial_saved.items())
    assert sum("input capture ran on 2 devices" in line for line in lines) == 3
    assert all(calls == (SAMPLES, 0) for calls in ours._capture.counts.values())
    assert ours._part_capture is None and ours._worker_guard is None
    assert not ours._in_parallel_pipeline  # forgotten at the end: a reused modifier asks again
