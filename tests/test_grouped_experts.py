"""Grouped MoE experts vs llm-compressor's stock linearised experts (CPU).

Stock reference: a tiny Qwen3-MoE block linearised with `LinearExperts2D` (as
`oneshot` does), its expert Linears hooked with the stock `GPTQModifier.calibrate_module`.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from tiny_models import (
    calibration_data,
    load_saved_tensors,
    moe_config,
    save_tiny_model,
    unpack_int4,
)
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

from llmcompressor import oneshot
from llmcompressor.modeling.moe.context import moe_calibration_context
from llmcompressor.modeling.moe.linear_experts import LinearExperts2D
from llmcompressor.modifiers.gptq import GPTQModifier
from llmcompressor.modifiers.utils.hooks import HooksMixin
from llmcompressor_parallel.engine.grouped_experts import (
    GroupedExperts,
    grouped_forward,
    unsupported_reason,
)
from llmcompressor_parallel.engine.grouped_hessians import GroupedExpertHessians

BACKENDS = ["grouped_mm", "bmm"]


pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


def tiny_block(
    dtype: torch.dtype = torch.float32, intermediate: int = 96, seed: int = 0
) -> Qwen3MoeSparseMoeBlock:
    """A Qwen3-MoE block (8 experts, top-2, intermediate != hidden) with linearised experts."""
    config = moe_config()
    config.num_experts, config.moe_intermediate_size, config.norm_topk_prob = 8, intermediate, True
    torch.manual_seed(seed)
    block = Qwen3MoeSparseMoeBlock(config)
    for param in block.parameters():
        torch.nn.init.normal_(param, std=0.1)
    linear_cls = LinearExperts2D.get_linear_experts_cls(type(block.experts))
    block.experts = linear_cls.from_experts_module(block.experts, config)
    return block.to(dtype).eval()


def batches(n: int, dtype: torch.dtype, seed: int = 1) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(1 + i % 2, 7 + 5 * i, 128, generator=generator).to(dtype) for i in range(n)]


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30)).item()


def expert_linears(experts: LinearExperts2D) -> list[torch.nn.Module]:
    return [
        getattr(experts[e], name)
        for e in range(experts.num_experts)
        for name in ("gate_proj", "up_proj", "down_proj")
    ]


def stock_hessians(block, inputs, all_experts: bool) -> GPTQModifier:
    """Run stock forwards with the stock GPTQ hook on every expert Linear."""
    modifier = GPTQModifier(targets="Linear", scheme="W4A16")
    handles = [
        linear.register_forward_hook(modifier.calibrate_module)
        for linear in expert_linears(block.experts)
    ]
    try:
        with torch.no_grad(), _mode(all_experts):
            for x in inputs:
                block(x)
    finally:
        for handle in handles:
            handle.remove()
    return modifier


def _mode(all_experts: bool):
    return moe_calibration_context() if all_experts else contextlib.nullcontext()


@pytest.mark.parametrize("all_experts", [False, True], ids=["routed", "all_experts"])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_forward_matches_stock(dtype, backend, all_experts):
    block = tiny_block(dtype)
    grouped = GroupedExperts(block.experts, backend=backend)
    errors = []
    with torch.no_grad(), _mode(all_experts):
        for x in batches(3, dtype):
            expected = block(x)
            with grouped_forward(block.experts, grouped):
                actual = block(x)
            assert actual.dtype == expected.dtype and actual.shape == expected.shape
            errors.append(relative_error(actual, expected))
    print(f"forward {dtype} {backend} all_experts={all_experts}: max rel err {max(errors):.2e}")
    assert max(errors) < (1e-5 if dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize("all_experts", [False, True], ids=["routed", "all_experts"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_hessians_match_stock(backend, all_experts):
    block = tiny_block()
    inputs = batches(4, torch.float32)
    stock = stock_hessians(block, inputs, all_experts)

    grouped = GroupedExperts(block.experts, backend=backend)
    accumulator = GroupedExpertHessians(grouped, backend=backend)
    with torch.no_grad(), _mode(all_experts), grouped_forward(block.experts, grouped, accumulator):
        for x in inputs:
            block(x)
    hessians, counts = {}, {}
    written = accumulator.export(hessians, counts)

    linears = expert_linears(block.experts)
    assert written == linears  # stock's hook order: gate, up, down per expert
    errors = [
        relative_error(hessians[m] / counts[m], stock._hessians[m] / stock._num_samples[m])
        for m in linears
    ]
    print(f"hessians fp32 {backend} all_experts={all_experts}: max rel err {max(errors):.2e}")
    assert max(errors) < 1e-5
    for m in linears:
        assert counts[m].item() == stock._num_samples[m].item() == len(inputs)
        assert counts[m].dtype == stock._num_samples[m].dtype
    # gate and up share one Hessian; in all-experts mode every expert's gate/up does
    pointers = {hessians[m].data_ptr() for e in range(8) for m in linears[3 * e : 3 * e + 2]}
    assert len(pointers) == (1 if all_experts else 8)


def test_hessians_bf16_within_tolerance():
    block = tiny_block(torch.bfloat16)
    inputs = batches(3, torch.bfloat16)
    stock = stock_hessians(block, inputs, all_experts=False)
    grouped = GroupedExperts(block.experts)
    accumulator = GroupedExpertHessians(grouped)
    with torch.no_grad(), grouped_forward(block.experts, grouped, accumulator):
        for x in inputs:
            block(x)
    hessians, counts = {}, {}
    accumulator.export(hessians, counts)
    linears = expert_linears(block.experts)
    errors = [relative_error(hessians[m], stock._hessians[m]) for m in linears]
    print(f"hessians bf16 model (fp32 accumulation): max rel err {max(errors):.2e}")
    assert max(errors) < 2e-2


@pytest.mark.parametrize("backend", BACKENDS)
def test_expert_without_tokens_is_counted_like_stock(backend):
    """Stock calls every expert, an unrouted one on [0, in]: count += 1, Hessian stays 0."""
    block = tiny_block()
    experts = block.experts
    generator = torch.Generator().manual_seed(3)
    calls = []
    for tokens in (5, 9):
        x = torch.randn(tokens, 128, generator=generator)
        index = torch.randint(0, 6, (tokens, 2), generator=generator)  # experts 6, 7 never
        index[:, 1] = (index[:, 0] + 1) % 6
        weights = torch.rand(tokens, 2, generator=generator)
        calls.append((x, index, weights))

    modifier = GPTQModifier(targets="Linear", scheme="W4A16")
    handles = [m.register_forward_hook(modifier.calibrate_module) for m in expert_linears(experts)]
    with torch.no_grad():
        expected = [experts(*call) for call in calls]
    for handle in handles:
        handle.remove()

    grouped = GroupedExperts(experts, backend=backend)
    accumulator = GroupedExpertHessians(grouped, backend=backend)
    with torch.no_grad():
        actual = [grouped(*call, all_experts=False, hessians=accumulator) for call in calls]
    for a, e in zip(actual, expected):
        assert relative_error(a, e) < 1e-5
    hessians, counts = {}, {}
    accumulator.export(hessians, counts)
    for m in expert_linears(experts):
        assert counts[m].item() == modifier._num_samples[m].item() == 2
        assert relative_error(hessians[m], modifier._hessians[m]) < 1e-5
    for e in (6, 7):
        for name in ("gate_proj", "up_proj", "down_proj"):
            linear = getattr(experts[e], name)
            assert torch.count_nonzero(hessians[linear]) == 0
            assert torch.count_nonzero(modifier._hessians[linear]) == 0


def test_modes_mixed_like_stock():
    """An all-experts call, then routed ones: the shared gate/up Hessian is split per expert."""
    block = tiny_block()
    inputs = batches(3, torch.float32)
    modifier = GPTQModifier(targets="Linear", scheme="W4A16")
    linears = expert_linears(block.experts)
    handles = [m.register_forward_hook(modifier.calibrate_module) for m in linears]
    grouped = GroupedExperts(block.experts)
    accumulator = GroupedExpertHessians(grouped)
    with torch.no_grad():
        for index, x in enumerate(inputs):
            with _mode(index == 0):
                block(x)
                with grouped_forward(block.experts, grouped, accumulator):
                    block(x)
    for handle in handles:
        handle.remove()
    hessians, counts = {}, {}
    accumulator.export(hessians, counts)
    assert max(relative_error(hessians[m], modifier._hessians[m]) for m in linears) < 1e-5
    assert all(counts[m].item() == modifier._num_samples[m].item() == 3 for m in linears)


def test_grouped_forward_restores_and_respects_switch():
    block = tiny_block()
    experts = block.experts
    before = experts.__dict__.get("forward")
    grouped = GroupedExperts(experts)
    accumulator = GroupedExpertHessians(grouped)
    enabled = [False]
    with torch.no_grad(), grouped_forward(experts, grouped, accumulator, lambda: enabled[0]):
        block(batches(1, torch.float32)[0])  # like the propagation pass: hooks disabled
        assert accumulator.num_samples == 0
        enabled[0] = True
        block(batches(1, torch.float32)[0])
        assert accumulator.num_samples == 1
    assert experts.__dict__.get("forward") is before


def test_refresh_follows_weight_changes_and_export_rules():
    block = tiny_block()
    grouped = GroupedExperts(block.experts)
    x = batches(1, torch.float32)[0]
    with torch.no_grad():
        block.experts[2].down_proj.weight.mul_(0.5)  # as GPTQ writes quantized weights
        grouped.refresh()
        expected = block(x)
        with grouped_forward(block.experts, grouped):
            assert relative_error(block(x), expected) < 1e-5

    accumulator = GroupedExpertHessians(grouped)
    with torch.no_grad(), grouped_forward(block.experts, grouped, accumulator):
        block(x)
    only = {block.experts[0].down_proj}
    hessians, counts = {}, {}
    assert accumulator.export(hessians, counts, modules=only, share=False) == list(only)
    assert accumulator.export(hessians, counts) == []  # export consumed the sums


@pytest.mark.parametrize("all_experts", [False, True], ids=["routed", "all_experts"])
def test_partials_merge_and_add_to_stock_entries(all_experts):
    """Batches 0-1 by stock hooks, 2 and 3 by two grouped replicas: sums equal stock's 0-3."""
    block = tiny_block()
    inputs = batches(4, torch.float32)
    reference = stock_hessians(block, inputs, all_experts)
    mixed = stock_hessians(block, inputs[:2], all_experts)

    grouped = GroupedExperts(block.experts)
    replicas = [GroupedExpertHessians(grouped) for _ in range(2)]
    with torch.no_grad(), _mode(all_experts):
        for x, replica in zip(inputs[2:], replicas):
            with grouped_forward(block.experts, grouped, replica):
                block(x)
    order_before = list(mixed._hessians)
    replicas[0].merge_(replicas[1]).export(mixed._hessians, mixed._num_samples)
    assert list(mixed._hessians) == order_before
    errors = []
    for m in expert_linears(block.experts):
        assert mixed._num_samples[m].item() == reference._num_samples[m].item() == 4
        errors.append(relative_error(mixed._hessians[m], reference._hessians[m]))
    print(f"stock batches + merged grouped partials, all_experts={all_experts}: "
          f"max rel err {max(errors):.2e}")
    assert max(errors) < 1e-5


def test_unaligned_sizes_fall_back_to_bmm():
    """bf16 rows of 36 values are not 16-byte aligned: grouped_mm would refuse them."""
    block = tiny_block(torch.bfloat16, intermediate=36)
    inputs = batches(2, torch.bfloat16)
    stock = stock_hessians(block, inputs, all_experts=False)
    grouped = GroupedExperts(block.experts, backend="grouped_mm")
    accumulator = GroupedExpertHessians(grouped)
    with torch.no_grad():
        for x in inputs:
            expected = block(x)
            with grouped_forward(block.experts, grouped, accumulator):
                assert relative_error(block(x), expected) < 1e-2
    hessians, counts = {}, {}
    accumulator.export(hessians, counts)
    linears = expert_linears(block.experts)
    errors = [relative_error(hessians[m], stock._hessians[m]) for m in linears]
    assert max(errors) < 2e-2


def test_unsupported_modules_are_named():
    assert "not a LinearExperts2D" in unsupported_reason(torch.nn.Linear(4, 4))
    with pytest.raises(ValueError, match="cannot run these experts grouped"):
        GroupedExperts(torch.nn.Linear(4, 4))
    with pytest.raises(ValueError, match="allowed"):
        GroupedExperts(tiny_block().experts, backend="loop")
    block = tiny_block()
    with pytest.raises(RuntimeError, match="no-grad passes only"):
        with grouped_forward(block.experts, GroupedExperts(block.experts)):
            block(batches(1, torch.float32)[0])


class _GroupedGPTQ(GPTQModifier):
    """The least wiring that puts stock GPTQ on the grouped path (a reference for the
    modifier, not the modifier): experts patched for the whole calibration, Hessians
    exported before stock compresses a layer, stacks refreshed before propagation."""

    def on_calibration_start(self, state, event, **kwargs):
        super().on_calibration_start(state, event, **kwargs)
        self._patches, self._grouped = contextlib.ExitStack(), {}
        for module in state.model.modules():
            if isinstance(module, LinearExperts2D) and unsupported_reason(module) is None:
                grouped = GroupedExperts(module)
                self._grouped[module] = (grouped, GroupedExpertHessians(grouped))
                self._patches.enter_context(
                    grouped_forward(
                        module, *self._grouped[module], lambda: not HooksMixin._HOOKS_DISABLED
                    )
                )

    def on_sequential_epoch_end(self, state, event, modules, **kwargs):
        modules = list(modules)
        layer = [self._grouped[m] for m in modules if m in self._grouped]
        for _, hessians in layer:
            hessians.export(self._hessians, self._num_samples, modules=self._module_names)
        super().on_sequential_epoch_end(state, event, modules, **kwargs)
        for grouped, _ in layer:
            grouped.refresh()

    def on_calibration_end(self, state, event, **kwargs):
        self._patches.close()
        super().on_calibration_end(state, event, **kwargs)


@pytest.mark.parametrize("all_experts", [False, True], ids=["routed", "all_experts"])
def test_stock_gptq_on_grouped_experts_writes_stock_checkpoint(tmp_path, all_experts):
    model_dir = save_tiny_model("moe", tmp_path / "model")
    args = dict(targets="Linear", scheme="W4A16", ignore=["lm_head"], batched_quantization=4)
    saved = {}
    for name, recipe in (("stock", GPTQModifier(**args)), ("grouped", _GroupedGPTQ(**args))):
        torch.manual_seed(0)
        oneshot(
            model=str(model_dir),
            dataset=calibration_data(16, 32),
            recipe=recipe,
            num_calibration_samples=16,
            max_seq_length=32,
            batch_size=4,
            moe_calibrate_all_experts=all_experts,
            output_dir=str(tmp_path / name),
        )
        saved[name] = load_saved_tensors(tmp_path / name)
    stock, grouped = saved["stock"], saved["grouped"]
    assert stock.keys() == grouped.keys()
    differing = [k for k, v in stock.items() if not torch.equal(v, grouped[k])]
    packed = [k for k in stock if k.endswith("weight_packed")]
    same = sum((unpack_int4(stock[k]) == unpack_int4(grouped[k])).sum().item() for k in packed)
    total = sum(unpack_int4(stock[k]).numel() for k in packed)
    print(
        f"oneshot GPTQ W4A16 tiny MoE, all_experts={all_experts}: {len(differing)} of "
        f"{len(stock)} tensors differ from stock, ints identical {same / total:.6f}"
    )
    # bit-identical here (CPU, fp32); Hessians are equal to fp32 rounding, not bits,
    # so only a rare tie in rounding may flip an int
    assert same / total >= 0.999


def test_route_counts_and_order_match_stock_visits():
    """Counts as bincount gives them (experts without tokens included); each expert's
    segment holds stock's (slot-major, then token) pairs."""
    from llmcompressor_parallel.engine.grouped_ops import route

    generator = torch.Generator().manual_seed(0)
    experts, tokens, top_k = 8, 13, 2
    top_k_index = torch.stack([torch.randperm(experts - 2, generator=generator)[:top_k] for _ in range(tokens)])
    routing = route(top_k_index, experts)
    assert torch.equal(routing.counts, torch.bincount(top_k_index.reshape(-1), minlength=experts))
    assert routing.counts[-2:].tolist() == [0, 0]
    for expert in range(experts):
        slots, token_ids = torch.where(top_k_index.t() == expert)
        segment = routing.expert == expert
        assert torch.equal(routing.token[segment], token_ids)
        assert torch.equal(routing.slot[segment], slots)
