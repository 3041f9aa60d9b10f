"""ParallelGPTQExpertModifier with grouped MoE experts vs stock GPTQModifier (CPU).

Stock and ours run through `oneshot()` on the same model and data (samples not
shuffled) in the same test. What is compared: the saved checkpoint (share of
identical 4-bit ints, worst relative scale gap, every other tensor), GPTQ's
statistics as stock's update receives them (order of modules, sample counts,
Hessians), and how often the experts ran grouped.

Measured on this machine (2 CPU cores, torch 2.13; fp32 tiny MoE, bf16 demo model):
- checkpoints bit-identical to stock, serial and under "parallel_sequential" on 2 CPU
  devices, in both MoE calibration modes; demo-model KL equal to stock's;
- Hessians: stock's bits serially in all-experts mode (stock's own kernels); routed,
  the batched kernels round differently (worst 1.3e-7 relative); under the parallel
  pipeline the per-replica sums add in another grouping (worst 1.9e-7, as without
  grouped experts); modules, order and sample counts always stock's.
"""

from __future__ import annotations

import contextlib
import gc
import weakref
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch
from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme, QuantizationStatus
from loguru import logger
from torch import nn
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.models.qwen3_moe.modeling_qwen3_moe import (
    Qwen3MoeDecoderLayer,
    Qwen3MoeSparseMoeBlock,
)

from llmcompressor import oneshot
from llmcompressor.modeling.moe.linear_experts import LinearExperts2D
from llmcompressor.modifiers.gptq import GPTQModifier
from llmcompressor.modifiers.utils.hooks import HooksMixin
from llmcompressor_parallel.calibration_pipeline import PIPELINE_NAME
from llmcompressor_parallel.demo import (
    calibration_dataset,
    demo_model_path,
    kl_divergence,
    stdlib_texts,
)
from llmcompressor_parallel.engine.grouped_experts import GroupedExperts
from llmcompressor_parallel.engine.grouped_hessians import GroupedExpertHessians
from llmcompressor_parallel.engine.offload_forward import is_offload_wrapper
from llmcompressor_parallel.engine.worker_pool import ReplicaError, live_worker_threads
from llmcompressor_parallel.modifiers.gptq import ParallelGPTQExpertModifier
from llmcompressor_parallel.modifiers.gptq_grouped import GroupedExpertsWiring
from oneshot_runs import calibrate_in_order, compare_checkpoints
from tiny_models import calibration_data, load_saved_tensors, moe_config

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

ARGS = dict(targets="Linear", scheme="W4A16", ignore=["lm_head"])
SAMPLES = 16
MODES = pytest.mark.parametrize("all_experts", [True, False], ids=["all_experts", "routed"])
# issue 3: demo-model KL vs the unquantized model within 0.5% of stock GPTQ's (measured: equal)
MAX_KL_GAP = 0.005


# ---------------------------------------------------------------- runs
class Run:
    """A finished oneshot run and what was recorded during it."""

    def __init__(self) -> None:
        self.tensors: dict[str, torch.Tensor] = {}
        self.hessians: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self.order: list[str] = []  # modules in the order GPTQ's dicts held them
        self.opened: list[tuple[str, str, int]] = []  # (experts, pass, others still built)
        self.lines: list[str] = []
        self.model: nn.Module | None = None


@contextlib.contextmanager
def recording(run: Run) -> Iterator[None]:
    """GPTQ's statistics when stock's update starts; every build of grouped stacks; logs."""
    real_compress = GPTQModifier.compress_modules
    real_open = GroupedExpertsWiring._open

    def compress_modules(self):
        for module, hessian in self._hessians.items():
            name = self._module_names[module]
            run.order.append(name)
            run.hessians[name] = (hessian.clone(), self._num_samples[module].clone())
        return real_compress(self)

    def open_(self, slot):
        real_open(self, slot)
        others = sum(1 for s in self._slots.values() if s is not slot and s.stack is not None)
        kind = "propagation" if HooksMixin._HOOKS_DISABLED else "calibration"
        run.opened.append((slot.name, kind, others))

    sink = logger.add(lambda message: run.lines.append(str(message)), level="INFO")
    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(GPTQModifier, "compress_modules", compress_modules)
            patch.setattr(GroupedExpertsWiring, "_open", open_)
            yield
    finally:
        logger.remove(sink)


def quantize(model: Any, recipe: Any, out: Path, all_experts: bool = True,
             pipeline: str | None = None, batch_size: int = 1, dataset: Any = None,
             samples: int = SAMPLES, seq_len: int = 32) -> Run:
    run = Run()
    extra = {} if pipeline is None else {"pipeline": pipeline}
    with recording(run):
        run.model = oneshot(
            model=model if isinstance(model, nn.Module) else str(model),
            dataset=dataset if dataset is not None else calibration_data(samples, seq_len),
            recipe=recipe,
            num_calibration_samples=samples,
            max_seq_length=seq_len,
            batch_size=batch_size,
            shuffle_calibration_samples=False,
            moe_calibrate_all_experts=all_experts,
            output_dir=str(out),
            **extra,
        )
    run.tensors = load_saved_tensors(out)
    return run


_STOCK: dict[tuple[bool, int], Run] = {}


def stock(model_dirs, tmp_path_factory, all_experts: bool, batch_size: int = 1) -> Run:
    key = (all_experts, batch_size)
    if key not in _STOCK:
        out = tmp_path_factory.mktemp(f"stock_{int(all_experts)}_{batch_size}")
        _STOCK[key] = quantize(model_dirs["moe"], GPTQModifier(**ARGS), out, all_experts,
                               batch_size=batch_size)
    return _STOCK[key]


def agreement(expected: Run, actual: Run, label: str) -> dict[str, float]:
    """Print and return how far `actual` is from `expected`."""
    result = compare_checkpoints(expected.tensors, actual.tensors)
    differing = [
        n for n, t in expected.tensors.items() if not torch.equal(t, actual.tensors[n])
    ]
    gap = max(
        ((actual.hessians[n][0] - h).abs().max() / h.abs().max().clamp_min(1e-30)).item()
        for n, (h, _count) in expected.hessians.items()
    )
    result.update(differing=len(differing), hessian_gap=gap)
    print(
        f"{label}: {len(differing)} of {len(expected.tensors)} tensors differ; ints identical "
        f"{result['int_identical']:.6f} of {result['ints']}; worst scale gap "
        f"{result['worst_scale_rel']:.2e}; worst Hessian gap {gap:.2e}"
    )
    return result


def summary(run: Run) -> str:
    lines = [line for line in run.lines if "MoE experts grouped in" in line]
    assert len(lines) == 1, lines
    return lines[0]


def assert_same_statistics(expected: Run, actual: Run) -> None:
    assert actual.order == expected.order, "modules reach GPTQ's update in another order"
    for name, (_h, count) in expected.hessians.items():
        assert torch.equal(actual.hessians[name][1], count), f"sample count of {name}"


# ---------------------------------------------------------------- against stock
@MODES
def test_serial_grouped_experts_equal_stock(model_dirs, tmp_path_factory, tmp_path, all_experts):
    """Stock sequential pipeline: each layer's stacks built lazily, dropped after propagation."""
    expected = stock(model_dirs, tmp_path_factory, all_experts)
    actual = quantize(model_dirs["moe"], ParallelGPTQExpertModifier(**ARGS), tmp_path / "ours",
                      all_experts)
    result = agreement(expected, actual, f"serial, all_experts={all_experts}")

    assert "grouped in 2 calibration and 2 propagation passes; stock expert loop in 0 and 0" in (
        summary(actual)
    )
    layers = [f"model.layers.{i}.mlp.experts" for i in range(2)]
    assert actual.opened == [
        (layers[0], "calibration", 0),
        (layers[0], "propagation", 0),  # dropped at the epoch end, rebuilt from new weights
        (layers[1], "calibration", 0),  # layer 0's propagation stacks dropped first
        (layers[1], "propagation", 0),
    ]
    assert_same_statistics(expected, actual)
    # all-experts: stock's very kernels; routed: batched kernels, fp32 rounding only
    assert result["hessian_gap"] == 0.0 if all_experts else result["hessian_gap"] <= 1e-6
    assert result["differing"] == 0


@MODES
def test_parallel_pipeline_grouped_experts_equal_stock(
    model_dirs, tmp_path_factory, tmp_path, all_experts
):
    """2 CPU devices, 8 batches each: one grouped pair per replica, merged in order."""
    expected = stock(model_dirs, tmp_path_factory, all_experts)
    recipe = ParallelGPTQExpertModifier(data_parallel=["cpu", "cpu"], **ARGS)
    actual = quantize(model_dirs["moe"], recipe, tmp_path / "ours", all_experts, PIPELINE_NAME)
    label = f"parallel_sequential 2 CPU devices, all_experts={all_experts}"
    result = agreement(expected, actual, label)

    assert any("calibration 2 of 3 subgraphs; propagation 2 of 3" in l for l in actual.lines)
    assert "grouped in 2 calibration and 2 propagation passes; stock expert loop in 0 and 0" in (
        summary(actual)
    )
    assert actual.opened == []  # no serial pass: nothing built on the home layer alone
    assert_same_statistics(expected, actual)
    # only the grouping of the fp32 sums differs from stock (measured: none here)
    assert result["hessian_gap"] <= 1e-6
    assert result["differing"] == 0
    assert live_worker_threads() == []


@pytest.mark.parametrize(
    "pipeline, devices, batch_size",
    [(None, "off", 1), (PIPELINE_NAME, ["cpu", "cpu"], 8)],
    ids=["stock-pipeline", "parallel-pipeline-one-batch-per-device"],
)
def test_grouped_experts_off_is_stock(
    model_dirs, tmp_path_factory, tmp_path, pipeline, devices, batch_size
):
    expected = stock(model_dirs, tmp_path_factory, True, batch_size)
    recipe = ParallelGPTQExpertModifier(data_parallel=devices, grouped_experts=False, **ARGS)
    actual = quantize(model_dirs["moe"], recipe, tmp_path / "ours", True, pipeline, batch_size)
    result = agreement(expected, actual, f"grouped_experts=False, {pipeline or 'sequential'}")
    assert not any("MoE experts grouped in" in line for line in actual.lines)
    assert actual.opened == []
    assert_same_statistics(expected, actual)
    assert result["hessian_gap"] == 0.0 and result["differing"] == 0


# ---------------------------------------------------------------- demo model quality
@pytest.fixture(scope="module")
def demo():
    model_dir = demo_model_path()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return model_dir, tokenizer, reference, calibration_dataset(tokenizer, 16, 128)


def _demo_run(demo, recipe, out: Path, pipeline: str | None = None) -> tuple[Run, float]:
    model_dir, tokenizer, reference, data = demo
    run = quantize(model_dir, recipe, out, pipeline=pipeline, dataset=data, samples=16,
                   seq_len=128)
    quantized = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    return run, kl_divergence(reference, quantized, tokenizer, stdlib_texts("heldout"), 128, 8)


DEMO_ARGS = dict(targets="Linear", scheme="W4A16", ignore=["lm_head", "re:.*mlp.gate$"])


def test_demo_model_kl_equals_stock(demo, tmp_path):
    """bf16 demo MoE (4 layers, 8 experts), 16 x 128 tokens, KL on 8 held-out chunks."""
    stock_run, stock_kl = _demo_run(demo, GPTQModifier(**DEMO_ARGS), tmp_path / "stock")
    ours_run, ours_kl = _demo_run(demo, ParallelGPTQExpertModifier(**DEMO_ARGS), tmp_path / "ours")
    result = compare_checkpoints(stock_run.tensors, ours_run.tensors)
    print(
        f"demo model KL vs unquantized: stock GPTQ {stock_kl:.6e}, grouped {ours_kl:.6e} "
        f"(ratio {ours_kl / stock_kl:.6f}); ints identical {result['int_identical']:.6f}, "
        f"worst scale gap {result['worst_scale_rel']:.2e}"
    )
    assert "grouped in 4 calibration and 4 propagation passes" in summary(ours_run)
    assert abs(ours_kl / stock_kl - 1) <= MAX_KL_GAP
    assert result["int_identical"] == 1.0  # measured


def test_demo_model_grouping_adds_nothing_under_data_parallel(demo, tmp_path):
    """Under "parallel_sequential" on 2 CPU devices grouped and stock experts give one checkpoint.

    (That checkpoint is not stock's bits on this bf16 model: the pipeline's fp32
    Hessian sums are grouped per replica, which flips a few ints in layer 0, and
    bf16 propagation spreads that to later layers; grouping adds nothing to it.)
    """
    runs = {}
    for grouped in (False, True):
        recipe = ParallelGPTQExpertModifier(data_parallel=["cpu", "cpu"], grouped_experts=grouped,
                                            **DEMO_ARGS)
        runs[grouped] = _demo_run(demo, recipe, tmp_path / str(grouped), PIPELINE_NAME)
    (plain, plain_kl), (grouped, grouped_kl) = runs[False], runs[True]
    result = compare_checkpoints(plain.tensors, grouped.tensors)
    print(
        f"demo model, 2 CPU devices: KL stock experts {plain_kl:.6e}, grouped {grouped_kl:.6e}; "
        f"ints identical {result['int_identical']:.6f}"
    )
    assert "grouped in 4 calibration and 4 propagation passes" in summary(grouped)
    assert all(torch.equal(t, grouped.tensors[n]) for n, t in plain.tensors.items())


# ---------------------------------------------------------------- where stock's loop runs
class _WithHooks(ParallelGPTQExpertModifier):
    """Puts a plain hook on one expert Linear of layer 0 and one on layer 1's experts module."""

    def on_calibration_start(self, state, event, **kwargs):
        super().on_calibration_start(state, event, **kwargs)
        model = state.model
        linear = model.get_submodule("model.layers.0.mlp.experts.1.up_proj")
        linear.register_forward_hook(lambda *_: _CALLS.append("expert linear"))
        experts = model.get_submodule("model.layers.1.mlp.experts")
        experts.register_forward_hook(lambda *_: _CALLS.append("experts module"))


_CALLS: list[str] = []


def test_foreign_hook_on_an_expert_runs_that_layer_as_stock(model_dirs, tmp_path_factory, tmp_path):
    """A hook the grouped forward would skip: stock's loop, one log line, same calls and bits.

    A hook on the experts module itself sees the same call either way: still grouped.
    """
    expected = stock(model_dirs, tmp_path_factory, True)
    _CALLS.clear()
    actual = quantize(model_dirs["moe"], _WithHooks(**ARGS), tmp_path / "ours")
    fallbacks = [line for line in actual.lines if "experts run as llm-compressor's loop" in line]
    print("\n".join(fallbacks))
    assert len(fallbacks) == 1
    assert " - model.layers.0.mlp.experts: experts run as" in fallbacks[0]
    assert "hook" in fallbacks[0] and "on model.layers.0.mlp.experts.1.up_proj" in fallbacks[0]
    assert "grouped in 1 calibration and 1 propagation passes; stock expert loop in 1 and 1" in (
        summary(actual)
    )
    # a plain hook fires in both passes, once per batch, as in stock
    assert _CALLS.count("expert linear") == 2 * SAMPLES
    assert _CALLS.count("experts module") == 2 * SAMPLES
    assert agreement(expected, actual, "foreign hook on layer 0")["differing"] == 0
    experts = [m for m in actual.model.modules() if isinstance(m, LinearExperts2D)]
    assert experts and not any(_is_dispatcher(m.__dict__.get("forward")) for m in experts)


def _is_dispatcher(forward: Any) -> bool:
    return "GroupedExpertsWiring" in getattr(forward, "__qualname__", "")


def test_failing_grouped_replica_leaves_the_model_unpatched(model_dirs, monkeypatch):
    def fail(self, *args):
        raise RuntimeError("injected")

    monkeypatch.setattr(GroupedExpertHessians, "accumulate_all_experts", fail)
    model = AutoModelForCausalLM.from_pretrained(model_dirs["moe"], dtype=torch.float32)
    recipe = ParallelGPTQExpertModifier(data_parallel=["cpu", "cpu"], **ARGS)
    with pytest.raises(ReplicaError, match="RuntimeError: injected"):
        calibrate_in_order(model, recipe, SAMPLES, pipeline=PIPELINE_NAME)
    assert live_worker_threads() == []
    assert recipe._grouped is None and recipe._hessians == {}
    experts = [m for m in model.modules() if isinstance(m, LinearExperts2D)]
    assert len(experts) == 2
    for module in experts:
        assert _own_forward(module) is type(module).forward


class _WithLayerHook(ParallelGPTQExpertModifier):
    """Another always-called hook on layer 1, registered after the wiring's own."""

    def on_calibration_start(self, state, event, **kwargs):
        super().on_calibration_start(state, event, **kwargs)
        layer = state.model.get_submodule("model.layers.1")
        layer.register_forward_hook(lambda *_: _CALLS.append("layer 1"), always_call=True)


@pytest.mark.parametrize("failing_pass", ["calibration", "propagation"])
def test_failing_layer_forward_under_stock_pipeline_leaves_nothing_grouped(
    model_dirs, monkeypatch, failing_pass
):
    """Stock "sequential" pipeline (it calls nothing of ours on an error): layer 1 raises
    in its third batch of the pass, its experts grouped since the first. The error
    reaches the caller as raised; every experts module has its own forward back, the
    stacks are freed, the device workers stopped, the wiring's hooks removed."""
    model = AutoModelForCausalLM.from_pretrained(model_dirs["moe"], dtype=torch.float32)
    failing = model.get_submodule("model.layers.1")
    fail_at = 3 if failing_pass == "calibration" else SAMPLES + 3
    recipe = _WithLayerHook(data_parallel=["cpu", "cpu"], **ARGS)
    calls, grouped_when_failing = [0], []
    real_forward = Qwen3MoeDecoderLayer.forward

    def fail_in_layer_1(self, *args, **kwargs):
        if self is failing:
            calls[0] += 1
            if calls[0] == fail_at:
                slots = recipe._grouped._slots.values()
                grouped_when_failing.append(any(s.stack is not None for s in slots))
                raise RuntimeError("injected failure in model.layers.1")
        return real_forward(self, *args, **kwargs)

    built: list[weakref.ref] = []
    real_init = GroupedExperts.__init__

    def recording_init(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        built.append(weakref.ref(self))

    monkeypatch.setattr(Qwen3MoeDecoderLayer, "forward", fail_in_layer_1)
    monkeypatch.setattr(GroupedExperts, "__init__", recording_init)
    _CALLS.clear()
    with pytest.raises(RuntimeError) as error:
        calibrate_in_order(model, recipe, SAMPLES)
    assert type(error.value) is RuntimeError
    assert str(error.value) == "injected failure in model.layers.1"
    assert grouped_when_failing == [True]
    assert _CALLS.count("layer 1") == fail_at  # the other hook still ran on the error

    assert live_worker_threads() == []
    assert recipe._grouped is None and recipe._pool is None
    experts = [m for m in model.modules() if isinstance(m, LinearExperts2D)]
    assert len(experts) == 2
    assert all(_own_forward(module) is type(module).forward for module in experts)
    ours = [
        hook for module in model.modules() for hook in module._forward_hooks.values()
        if isinstance(getattr(hook, "__self__", None), GroupedExpertsWiring)
    ]
    assert not ours, "the wiring's error hooks were left behind"
    del error
    gc.collect()
    assert built and all(ref() is None for ref in built), "grouped stacks still alive"


def _own_forward(module: nn.Module) -> Any:
    """The function a call of `module` ends in (through an offloading wrapper)."""
    forward = module.__dict__.get("forward")
    if forward is None:
        return type(module).forward
    if is_offload_wrapper(module, forward):
        return module.__dict__.get("_original_forward_func")
    return forward


def _tiny_block() -> Qwen3MoeSparseMoeBlock:
    config = moe_config()
    torch.manual_seed(0)
    block = Qwen3MoeSparseMoeBlock(config)
    for param in block.parameters():  # the experts' weights are created uninitialised
        nn.init.normal_(param, std=0.1)
    linear_cls = LinearExperts2D.get_linear_experts_cls(type(block.experts))
    block.experts = linear_cls.from_experts_module(block.experts, config)
    return block.eval()


@contextlib.contextmanager
def _wired(block: nn.Module) -> Iterator[tuple[ParallelGPTQExpertModifier, GroupedExpertsWiring]]:
    """The wiring on a bare block, expert Linears hooked as stock's on_calibration_start does."""
    modifier = ParallelGPTQExpertModifier(**ARGS)
    scheme = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(num_bits=4))
    linears = [m for m in block.experts.modules() if isinstance(m, nn.Linear)]
    modifier._module_names = {m: n for n, m in block.named_modules() if m in linears}
    for linear in linears:
        linear.quantization_scheme = scheme
        modifier.register_hook(linear, modifier.calibrate_module, "forward")
    wiring = GroupedExpertsWiring(modifier)
    wiring.install(block)
    try:
        yield modifier, wiring
    finally:
        wiring.close(export_pending=False)
        modifier.remove_hooks()


def test_quantization_enabled_in_the_forward_runs_stock_loop():
    block = _tiny_block()
    x = torch.randn(1, 9, 128, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = block(x)
    linear = block.experts[2].down_proj
    with _wired(block) as (modifier, wiring), torch.no_grad():
        linear.quantization_status = QuantizationStatus.CALIBRATION  # enabled by default
        lines: list[str] = []
        sink = logger.add(lambda message: lines.append(str(message)), level="INFO")
        try:
            assert torch.equal(block(x), expected)
        finally:
            logger.remove(sink)
        assert any("quantization is enabled during the forward on 1 expert" in l for l in lines)
        assert wiring.counts["calibration", "stock"] == 1
        assert len(modifier._hessians) == len(modifier._module_names)  # stock's hooks ran

        wiring.epoch_end([block.experts])  # the next layer's pass decides again
        modifier._hessians.clear(), modifier._num_samples.clear()
        linear.quantization_enabled = False  # what the pipelines' DisableQuantization does
        grouped = block(x)
        assert (grouped - expected).abs().max() <= 1e-5 * expected.abs().max()
        assert wiring.counts["calibration", "grouped"] == 1 and not modifier._hessians
        wiring.epoch_end([block.experts])  # the layer's statistics reach GPTQ's dicts
        assert set(modifier._hessians) == set(modifier._module_names)


def test_unsupported_experts_keep_stock_forward():
    block = _tiny_block()
    def forward(self, *args):
        return LinearExperts2D.forward(self, *args)

    custom = type("CustomExperts", (type(block.experts),), {"forward": forward})
    block.experts.__class__ = custom
    lines: list[str] = []
    sink = logger.add(lambda message: lines.append(str(message)), level="INFO")
    try:
        with _wired(block) as (_modifier, wiring):
            assert not _is_dispatcher(block.experts.__dict__.get("forward"))
            assert not wiring._slots
    finally:
        logger.remove(sink)
    assert any("CustomExperts overrides LinearExperts2D.forward" in line for line in lines)
