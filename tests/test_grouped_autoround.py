"""Grouped AutoRound experts vs auto-round's per-expert wrapped loop (CPU).

Reference: a tiny Qwen3-MoE block, experts linearised as `oneshot` does
(`LinearExperts2D`), configured by auto-round's own `AutoRound.configure_layer_config`
(llm-compressor's call path) and wrapped by auto-round's `wrapper_block` with
SignRound's defaults, as `SignRoundQuantizer.quantize_block` wraps a block. Tuning
parameters are random and partly outside auto-round's [0, 1] scale bounds, so its
in-place clamps matter; one expert receives no token. Figures are printed (-s).
"""

from __future__ import annotations

import contextlib
import copy
import functools
from pathlib import Path

import pytest
import torch
from torch.profiler import ProfilerActivity, profile
from torch.utils._python_dispatch import TorchDispatchMode
from compressed_tensors.offload.cache.base import OffloadCache
from compressed_tensors.offload.module import remove_module_offload
from oneshot_runs import AUTOROUND_ARGS, log_lines
from tiny_models import (
    calibration_data,
    load_saved_tensors,
    moe_config,
    save_tiny_model,
    unpack_int4,
)
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeDecoderLayer

import llmcompressor.modifiers.autoround.base as stock_autoround
from auto_round import AutoRound
from auto_round.algorithms.quantization.sign_round.config import SignRoundConfig
from auto_round.compressors.utils import collect_best_params
from auto_round.wrapper import WrapperLinear, unwrapper_block, wrapper_block
from llmcompressor import oneshot
from llmcompressor.modeling.moe.context import moe_calibration_context
from llmcompressor.modeling.moe.linear_experts import LinearExperts2D
from llmcompressor.modifiers.autoround import AutoRoundModifier
from llmcompressor.modifiers.autoround.base import _wrap_decoding_layer
from llmcompressor_parallel import DataParallelAutoRoundModifier
from llmcompressor_parallel.engine import DeviceWorkerPool, FanOut
from llmcompressor_parallel.engine import expert_tokens
from llmcompressor_parallel.engine import grouped_autoround_forward as grouped_forward_module
from llmcompressor_parallel.engine.exact_weight_grads import ExactWeightGradients
from llmcompressor_parallel.engine.grouped_autoround_forward import ExpertStacks, experts_forward
from llmcompressor_parallel.engine.grouped_autoround import (
    GroupedAutoRoundExperts,
    wrapped_unsupported_reason,
)

NUM_EXPERTS, STARVED, HIDDEN = 8, 7, 128
PARAMS = ("value", "min_scale", "max_scale")
DIRECTION = torch.nn.functional.normalize(torch.ones(HIDDEN), dim=0)


pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


# ------------------------------------------------------------------ reference block
@functools.lru_cache(maxsize=None)
def configured_layer(
    scheme: str, top_k: int, ar_kwargs: tuple, num_experts: int = NUM_EXPERTS
) -> Qwen3MoeDecoderLayer:
    """A decoder layer whose expert Linears carry auto-round's layer config for `scheme`."""
    config = moe_config()
    config.num_experts, config.num_experts_per_tok = num_experts, top_k
    config.moe_intermediate_size, config.norm_topk_prob = 96, True
    torch.manual_seed(0)
    layer = Qwen3MoeDecoderLayer(config, 0)
    for param in layer.parameters():
        torch.nn.init.normal_(param, std=0.1)
    mlp = layer.mlp
    linear_cls = LinearExperts2D.get_linear_experts_cls(type(mlp.experts))
    mlp.experts = linear_cls.from_experts_module(mlp.experts, config)
    layer.requires_grad_(False)  # as AutoRoundModifier.on_initialize
    for module in layer.modules():  # as suspend_offloading, before auto-round gets the layer
        if isinstance(module._parameters, OffloadCache):
            remove_module_offload(module, onload_tensors=True)
    # every input leans on DIRECTION and the router's STARVED row points away from it
    mlp.gate.weight.data[STARVED % num_experts] = -20 * DIRECTION
    wrapped = _wrap_decoding_layer(layer)  # as AutoRoundModifier.apply_autoround
    wrapped.config, wrapped.name_or_path = config, ""
    autoround = AutoRound(
        model=wrapped, tokenizer="", scheme=scheme, iters=1, batch_size=1,
        enable_torch_compile=False, low_gpu_mem_usage=True, **dict(ar_kwargs),
    )
    autoround.configure_layer_config(enable_gguf_official_mixed=False)
    return layer


def wrapped_block(
    scheme: str = "W4A16",
    top_k: int = 2,
    dtype: torch.dtype = torch.float32,
    num_experts: int = NUM_EXPERTS,
    **ar_kwargs,
) -> torch.nn.Module:
    """The MoE block with auto-round-wrapped experts and random tuning parameters.

    auto-round itself converts the layer to its amp dtype (bf16 on CPU and for bf16
    models); `dtype` float32 undoes that, to check the fp32 math too.
    """
    layer = configured_layer(scheme, top_k, tuple(sorted(ar_kwargs.items())), num_experts)
    block = copy.deepcopy(layer.mlp).to(dtype)
    defaults = SignRoundConfig()
    wrapper_block(  # SignRoundQuantizer.quantize_block's call
        block, defaults.enable_minmax_tuning, defaults.enable_norm_bias_tuning,
        enable_torch_compile=False, device="cpu",
    )
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for wrapper in wrappers(block):
            if "value" not in wrapper._parameters:
                continue
            wrapper.value.copy_(torch.rand(wrapper.value.shape, generator=generator) - 0.5)
            for name in ("min_scale", "max_scale"):  # partly outside [0, 1]: clamps matter
                scale = torch.rand(wrapper.min_scale.shape, generator=generator) * 1.3 - 0.1
                getattr(wrapper, name).copy_(scale)
    block.start_params = [
        tuple(getattr(w, n).detach().clone() for n in PARAMS) for w in wrappers(block)
    ]
    return block


def wrappers(block: torch.nn.Module) -> list[WrapperLinear]:
    return [m for m in block.modules() if isinstance(m, WrapperLinear)]


def inputs(batch: int = 2, seq: int = 24) -> torch.Tensor:
    generator = torch.Generator().manual_seed(5)
    return torch.randn(batch, seq, HIDDEN, generator=generator) + 3 * DIRECTION


# ------------------------------------------------------------------ running both ways
def run(block, x, *, grouped=None, all_experts=True, amp=True, grad=True, pool=None,
        fan_outs=None, exact=False):
    """One call (+ backward of a fixed random probe) from the block's starting parameters.

    :param grouped: None for the stock loop, else GroupedAutoRoundExperts keyword args
    :param fan_outs: a list that receives the `FanOut` (with `pool`), to read its counts
    :param exact: with `pool`, wrapped Linears' weight gradients gathered on the home
        (ExactWeightGradients, as the modifier's default)
    :returns: (output, {param: [grads]}, {param: [values after the call]}, context)
    """
    with torch.no_grad():
        for wrapper, start in zip(wrappers(block), block.start_params):
            for name, value in zip(PARAMS, start):
                getattr(wrapper, name).copy_(value)
                getattr(wrapper, name).grad = None
    x = x.detach().to(block.gate.weight.dtype).requires_grad_(grad)  # attention trains too
    with contextlib.ExitStack() as stack:
        context = None
        if grouped is not None:
            context = stack.enter_context(GroupedAutoRoundExperts(block, "block", **grouped))
        if pool is not None:
            fan_out = stack.enter_context(FanOut(block, pool, "block"))
            if fan_outs is not None:
                fan_outs.append(fan_out)
        if exact:  # as the modifier: after the grouped experts, leaving them their stacks
            leave_to = context.grouped_modules if context is not None else tuple
            stack.enter_context(ExactWeightGradients(block, "block", leave_to))
        if all_experts:  # oneshot's default moe_calibrate_all_experts=True
            stack.enter_context(moe_calibration_context())
        if amp:  # auto-round's block_forward: autocast bf16, on CPU too
            stack.enter_context(torch.autocast("cpu", dtype=torch.bfloat16))
        if not grad:
            stack.enter_context(torch.no_grad())
        out = block(x)
    grads = {}
    if grad:
        probe = torch.randn(out.shape, generator=torch.Generator().manual_seed(9))
        (out.float() * probe).sum().backward()
        grads = {name: [getattr(w, name).grad for w in wrappers(block)] for name in PARAMS}
        grads["input"] = [x.grad]
    values = {name: [getattr(w, name).detach().clone() for w in wrappers(block)] for name in PARAMS}
    return out.detach(), grads, values, context


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30)).item()


def compare(stock, grouped) -> dict[str, float]:
    """Relative max errors of the output and of every gradient (all experts together).

    Also asserts that auto-round's in-place clamps left the same parameter values.
    """
    figures = {"output": rel(grouped[0], stock[0])}
    for name in stock[1]:  # the tuning parameters', and the block input's (attention's)
        reference = torch.cat([g.flatten() for g in stock[1][name]])
        actual = torch.cat([g.flatten() for g in grouped[1][name]])
        figures[f"grad {name}"] = rel(actual, reference)
        same_sign = (actual.sign() == reference.sign()).float().mean().item()
        figures[f"{name} signs equal %"] = 100 * same_sign
    for name in stock[2]:
        for a, b in zip(stock[2][name], grouped[2][name]):
            assert torch.equal(a, b), f"{name} clamped differently"
    return figures


def show(title: str, figures: dict[str, float]) -> None:
    print(f"\n{title}: " + ", ".join(
        f"{k} {v:.2f}" if "%" in k else f"{k} {v:.2e}" for k, v in figures.items()
    ))


def gradient_errors(figures: dict[str, float]) -> float:
    return max(v for k, v in figures.items() if k.startswith("grad "))



# ------------------------------------------------------------------ tests
PRECISIONS = {  # name: (weight dtype, autocast bf16)
    "fp32": (torch.float32, False),
    "fp32_autocast": (torch.float32, True),
    "bf16_autocast": (torch.bfloat16, True),  # what auto-round runs, on CPU and GPU
}


@pytest.mark.parametrize("top_k", [2, 4], ids=["top2", "top4"])
@pytest.mark.parametrize("backend", ["bmm", "grouped_mm"])
@pytest.mark.parametrize("all_experts", [False, True], ids=["routed", "all_experts"])
@pytest.mark.parametrize("precision", list(PRECISIONS))
def test_forward_and_gradients_match_wrapped_loop(precision, all_experts, backend, top_k):
    dtype, amp = PRECISIONS[precision]
    block = wrapped_block(top_k=top_k, dtype=dtype)
    x = inputs()
    _, _, routed = block.gate(x.reshape(-1, HIDDEN).to(dtype))
    assert not (routed == STARVED).any()
    stock = run(block, x, all_experts=all_experts, amp=amp)
    grouped = run(block, x, grouped={"backend": backend}, all_experts=all_experts, amp=amp)
    assert grouped[3].grouped_calls == 1 and grouped[3].stock_calls == 0
    figures = compare(stock, grouped)
    show(f"{precision} {backend} top{top_k} all_experts={all_experts}", figures)
    starved = [
        m for n, m in block.named_modules()
        if n.startswith(f"experts.{STARVED}.") and isinstance(m, WrapperLinear)
    ]
    assert len(starved) == 3  # routed no token: zero gradients (in both modes), as stock
    assert all(torch.count_nonzero(getattr(w, p).grad) == 0 for w in starved for p in PARAMS)
    assert figures["output"] < (1e-2 if amp else 1e-5)
    assert gradient_errors(figures) < (5e-2 if amp else 1e-4)


@pytest.mark.parametrize("precision", ["fp32", "bf16_autocast"])
def test_routed_tokens_only_in_all_experts_mode(precision):
    """all_tokens=False: routed tokens only; same math, floating-point order differs."""
    dtype, amp = PRECISIONS[precision]
    block = wrapped_block(top_k=4, dtype=dtype)
    x = inputs()
    stock = run(block, x, amp=amp)
    grouped = run(block, x, grouped={"all_tokens": False}, amp=amp)
    figures = compare(stock, grouped)
    show(f"all_tokens=False {precision}", figures)
    assert figures["output"] < (1e-2 if amp else 1e-5)
    assert gradient_errors(figures) < (5e-2 if amp else 1e-4)


class _PerExpertInput(torch.autograd.Function):
    """The full all-token path's input: `hidden` cast once, expanded to every expert's
    projections; backward adds experts descending, last projection first."""

    @staticmethod
    def forward(ctx, hidden, experts, count, dtype):
        ctx.dtype = hidden.dtype
        ctx.set_materialize_grads(False)
        shared = hidden.to(dtype)
        return tuple(shared.unsqueeze(0).expand(experts, *hidden.shape) for _ in range(count))

    @staticmethod
    def backward(ctx, *grads):
        total = None
        for expert in reversed(range(grads[0].shape[0])):
            for grad in reversed(grads):
                if total is None:
                    total = grad[expert].to(ctx.dtype, copy=True)
                else:
                    total.add_(grad[expert])
        return total, None, None, None


def full_all_tokens(hidden, routing, ranks, stacks, activation, backend):
    """The reference: every expert on every token in `torch.bmm` (stock's per-expert
    Linears as one batched call; the all-tokens path before routed rows), autograd
    computing every gradient; the routed rows kept, in `routing`'s order."""
    assert stacks.recorder is None and stacks.first_bias is None
    experts, tokens = stacks.down_t.shape[0], hidden.shape[0]
    dtype = grouped_forward_module._compute_dtype(hidden)
    inputs = _PerExpertInput.apply(hidden, experts, len(stacks.first), dtype)
    projected = [torch.bmm(x, w_t) for x, w_t in zip(inputs, stacks.first)]  # [E, T, I]
    h = activation(torch.cat(projected, dim=-1).reshape(experts * tokens, -1))
    y = torch.bmm(h.view(experts, tokens, -1), stacks.down_t)
    return y[routing.expert, routing.token]


class _MatmulFlops(TorchDispatchMode):
    """Counts the FLOPs of `bmm` and `_grouped_mm` (torch's FlopCounterMode registers
    global module hooks, which send the experts to stock's loop)."""

    def __init__(self) -> None:
        super().__init__()
        self.flops = {"bmm": 0, "grouped_mm": 0}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.bmm.default:
            batch, rows, inner = args[0].shape
            self.flops["bmm"] += 2 * batch * rows * inner * args[1].shape[-1]
        elif func is torch.ops.aten._grouped_mm.default:  # [N, in] by [E, in, out]
            rows, inner = args[0].shape
            self.flops["grouped_mm"] += 2 * rows * inner * args[1].shape[-1]
        return func(*args, **(kwargs or {}))


def _counted_run(monkeypatch, *args, **kwargs):
    """`run`, with the matmul FLOPs counted and the call's routings kept."""
    routings = []
    real_route = grouped_forward_module.route

    def kept_route(*route_args):
        routings.append(real_route(*route_args))
        return routings[-1]

    monkeypatch.setattr(grouped_forward_module, "route", kept_route)
    with _MatmulFlops() as counter:
        result = run(*args, **kwargs)
    monkeypatch.setattr(grouped_forward_module, "route", real_route)
    return result, counter.flops, routings


@pytest.mark.parametrize("backend", ["bmm", "grouped_mm"])
@pytest.mark.parametrize("precision", list(PRECISIONS))
def test_all_tokens_on_routed_rows_are_the_full_all_token_bits(precision, backend, monkeypatch):
    """The all-tokens path (forward and input gradients on the routed rows, weight
    gradients over every token) vs every expert on every token in one bmm: the same
    output and gradients of every tuning parameter and of the input, bit for bit, at
    a fraction of the FLOPs (counted: the routed matmuls run the padded segments in bmm
    or the segments in `_grouped_mm`; the weight gradients are the only all-token
    bmm's)."""
    dtype, amp = PRECISIONS[precision]
    block = wrapped_block(top_k=2, dtype=dtype)
    x = inputs()
    calls = _all_tokens_calls(monkeypatch)
    routed, routed_flops, routings = _counted_run(
        monkeypatch, block, x, grouped={"backend": backend}, amp=amp
    )
    assert len(calls) == 1 and len(routings) == 1
    monkeypatch.setattr(grouped_forward_module, "_all_tokens", full_all_tokens)
    full, full_flops, _ = _counted_run(monkeypatch, block, x, grouped={"backend": backend}, amp=amp)
    stock = run(block, x, amp=amp)

    assert torch.equal(routed[0], full[0])
    for name in (*PARAMS, "input"):
        assert all(torch.equal(a, b) for a, b in zip(routed[1][name], full[1][name])), name
    figures = compare(stock, routed)
    show(f"routed rows vs stock {precision} {backend}", figures)
    assert figures["output"] == 0 and gradient_errors(figures) == 0

    tokens, pairs = x.shape[0] * x.shape[1], routings[0].token.numel()
    intermediate = block.experts[0].down_proj.orig_layer.in_features
    per_row = 3 * 2 * HIDDEN * intermediate  # gate, up, down on one row of one expert
    longest = routings[0].longest
    # fp32 weights under bf16 autocast take bmm (grouped_autoround._call_backend)
    padded = backend == "bmm" or routed_flops["grouped_mm"] == 0
    print(f"matmul FLOPs: full {full_flops}, routed rows {routed_flops} "
          f"(longest segment {longest} of {tokens} tokens, {pairs} pairs)")
    assert full_flops == {"bmm": 3 * per_row * NUM_EXPERTS * tokens, "grouped_mm": 0}
    weight_grads = per_row * NUM_EXPERTS * tokens  # all-token, stock's reduction
    assert routed_flops == (
        {"bmm": weight_grads + 2 * per_row * NUM_EXPERTS * longest, "grouped_mm": 0}
        if padded else {"bmm": weight_grads, "grouped_mm": 2 * per_row * pairs}
    )
    assert longest < tokens


def _all_tokens_calls(monkeypatch) -> list[int]:
    """Counts the grouped forward's all-tokens path (every expert on every token)."""
    calls: list[int] = []
    real = grouped_forward_module._all_tokens

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(grouped_forward_module, "_all_tokens", counted)
    return calls


def test_auto_token_mode_follows_free_memory(monkeypatch):
    """all_tokens="auto": all tokens where the estimate fits free memory, else routed
    with one log line; each is bit for bit the fixed mode it picked."""
    block = wrapped_block(top_k=4, dtype=torch.bfloat16)
    x = inputs()
    fixed = {mode: run(block, x, grouped={"all_tokens": mode}) for mode in (True, False)}
    calls = _all_tokens_calls(monkeypatch)
    figures = {}
    for free, expected in ((2**40, True), (0, False)):
        monkeypatch.setattr(expert_tokens, "free_bytes", lambda device, free=free: free)
        calls.clear()
        with log_lines() as lines:
            picked = run(block, x, grouped={"all_tokens": "auto"})
        assert bool(calls) is expected
        assert torch.equal(picked[0], fixed[expected][0])
        assert all(
            torch.equal(a, b) for name in PARAMS
            for a, b in zip(picked[1][name], fixed[expected][1][name])
        )
        routed_lines = [line for line in lines if "routed tokens only" in line]
        assert len(routed_lines) == (0 if expected else 1)
        figures[free] = routed_lines
    print("\n" + figures[0][0].strip())
    with pytest.raises(ValueError, match="allowed"):
        GroupedAutoRoundExperts(block, all_tokens="routed")


def test_all_tokens_estimate_bounds_the_measured_peak():
    """The estimate errs high, by less than 2x, against the call's measured CPU peak."""
    experts, tokens, hidden, intermediate, top_k = 8, 8192, 256, 128, 2
    generator = torch.Generator().manual_seed(0)

    def weights(*shape):
        return (torch.randn(*shape, generator=generator) * 0.05).bfloat16().requires_grad_()

    stacks = ExpertStacks(
        [weights(experts, hidden, intermediate), weights(experts, hidden, intermediate)],
        weights(experts, intermediate, hidden),
    )
    x = torch.randn(tokens, hidden, generator=generator).bfloat16().requires_grad_()
    index = torch.stack([torch.randperm(experts, generator=generator)[:top_k]
                         for _ in range(tokens)])
    routing_weights = torch.rand(tokens, top_k, generator=generator).bfloat16()

    def activation(gate_up):
        gate, up = gate_up.chunk(2, dim=-1)
        return torch.nn.functional.silu(gate) * up

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = experts_forward(x, index, routing_weights, stacks, activation, "bmm", True, True)
        out.float().sum().backward()
    records = sorted(
        (event.start_ns(), event.nbytes())
        for event in prof.profiler.kineto_results.events()
        if event.name() == "[memory]"
    )
    current = peak = 0
    for _, change in records:
        current += change
        peak = max(peak, current)
    estimate = expert_tokens.all_tokens_bytes(experts, tokens, hidden, intermediate, True, 2, top_k)
    print(f"\nall-tokens call: measured peak {peak / 2**20:.1f} MiB, "
          f"estimate {estimate / 2**20:.1f} MiB")
    assert peak <= estimate < 2 * peak


def test_modifier_token_modes_reach_the_tuning_forward(monkeypatch, tmp_path):
    """grouped_expert_tokens: "routed" never runs all tokens, "all" does, "auto" with
    no free memory falls back to routed (logged)."""
    model = save_tiny_model("moe", tmp_path / "model")
    calls = _all_tokens_calls(monkeypatch)
    monkeypatch.setattr(expert_tokens, "free_bytes", lambda device: 0)
    counts = {}
    for mode in ("all", "routed", "auto"):
        calls.clear()
        with log_lines() as lines:
            oneshot(
                model=str(model), dataset=calibration_data(8, 16),
                output_dir=str(tmp_path / mode), num_calibration_samples=8, max_seq_length=16,
                recipe=DataParallelAutoRoundModifier(
                    iters=2, grouped_expert_tokens=mode, **AUTOROUND_ARGS
                ),
            )
        counts[mode] = (len(calls), sum("routed tokens only" in line for line in lines))
    print(f"\nall-tokens calls, routed-fallback log lines per mode: {counts}")
    assert counts["all"][0] > 0 and counts["routed"][0] == 0 and counts["auto"] == (0, 2)


@pytest.mark.parametrize(
    "ar_kwargs", [{"sym": False}, {"group_size": 64}], ids=["asym", "g64_padded"]
)
def test_other_int_schemes_match(ar_kwargs):
    block = wrapped_block(**ar_kwargs)
    assert wrapped_unsupported_reason(block.experts) is None
    x = inputs()
    stock = run(block, x, amp=False)
    grouped = run(block, x, grouped={}, amp=False)
    figures = compare(stock, grouped)
    show(f"W4A16 {ar_kwargs}", figures)
    assert grouped[3].grouped_calls == 1
    assert figures["output"] < 1e-5 and gradient_errors(figures) < 1e-4


def test_no_grad_passes_plain_wrapped_and_unwrapped():
    """Reference outputs (plain Linears), a no-grad wrapped call, the quantized-input chain."""
    x = inputs()
    plain = copy.deepcopy(configured_layer("W4A16", 4, ()).mlp)  # bf16, as auto-round has it
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16), moe_calibration_context():
        reference = plain(x.bfloat16())
        with GroupedAutoRoundExperts(plain, "plain") as context:
            reference_grouped = plain(x.bfloat16())
    assert context.grouped_calls == 1 and context.stock_calls == 0
    block = wrapped_block(top_k=4, dtype=torch.bfloat16)
    stock = run(block, x, grad=False)
    grouped = run(block, x, grouped={}, grad=False)
    assert grouped[3].grouped_calls == 1
    # one context across unwrapping, as around quantize_block: the stacks follow (fp32)
    block.float()
    with GroupedAutoRoundExperts(block, "block") as context, torch.no_grad():
        wrapped_output = block(x)
        # best = current parameters: writes their qdq weights in place, Linears back
        unwrapper_block(block, collect_best_params(block, "cpu"))
        chain_grouped = block(x)
    chain_stock = block(x)
    assert context.grouped_calls == 2 and context.stock_calls == 0
    figures = {
        "reference (plain, bf16 autocast)": rel(reference_grouped, reference),
        "wrapped no-grad (bf16 autocast)": rel(grouped[0], stock[0]),
        "quantized-input chain after unwrap": rel(chain_grouped, chain_stock),
        "wrapped vs unwrapped": rel(wrapped_output, chain_stock),
    }
    show("no-grad passes", figures)
    assert figures["reference (plain, bf16 autocast)"] < 1e-2
    assert figures["wrapped no-grad (bf16 autocast)"] < 1e-2
    assert figures["quantized-input chain after unwrap"] < 1e-5
    assert figures["wrapped vs unwrapped"] < 1e-5


def test_fan_out_replicas_run_grouped():
    """Entered before FanOut, the grouped forward reaches each replica's own experts.

    The reference is FanOut over the stock loop: same split, same gradient sums (each
    replica its own qdq: qdq_once=False; qdq once: tests/test_qdq_once.py).
    """
    block = wrapped_block()
    x = inputs(batch=4)
    serial = run(block, x, amp=False)
    pool = DeviceWorkerPool([torch.device("cpu"), torch.device("cpu")])
    try:
        stock = run(block, x, amp=False, pool=pool)
        fanned = run(block, x, grouped={"qdq_once": False}, amp=False, pool=pool)
    finally:
        pool.close()
    assert fanned[3].grouped_calls == 2 and fanned[3].stock_calls == 0  # home + replica
    figures = compare(stock, fanned)
    show("FanOut x2, grouped vs stock loop", figures)
    show("  (FanOut x2 grouped vs serial stock: the fan-out's own summation order)",
         compare(serial, fanned))
    assert figures["output"] < 1e-5 and gradient_errors(figures) < 1e-4


def test_unsupported_falls_back_to_stock_with_reason():
    """An unsupported scheme, a hook, a replaced forward: the stock loop, same output."""
    mxfp4 = wrapped_block("MXFP4")
    reason = wrapped_unsupported_reason(mxfp4.experts)
    print(f"\nMXFP4: {reason}")
    assert reason is not None and "mx_fp" in reason
    hooked = wrapped_block()
    handle = hooked.experts[2].up_proj.register_forward_hook(lambda *args: None)
    patched = wrapped_block()
    down = patched.experts[1].down_proj
    down.forward = functools.partial(WrapperLinear.forward, down)
    x = inputs()
    for block in (mxfp4, hooked, patched):
        stock = run(block, x, amp=False)
        fallback = run(block, x, grouped={}, amp=False)
        assert fallback[3].grouped_calls == 0 and fallback[3].stock_calls == 1
        assert torch.equal(stock[0], fallback[0])
    handle.remove()


@contextlib.contextmanager
def grouped_quantize_block(counts: list[tuple[int, int]]):
    """Stock AutoRoundModifier with its layer's experts grouped during quantize_block."""
    real = stock_autoround.AutoRound

    def factory(*args, **kwargs):
        autoround = real(*args, **kwargs)
        quantize_block = autoround.quantize_block

        def grouped(block, *q_args, **q_kwargs):
            with GroupedAutoRoundExperts(block, "layer") as context:
                result = quantize_block(block, *q_args, **q_kwargs)
            counts.append((context.grouped_calls, context.stock_calls))
            return result

        autoround.quantize_block = grouped
        return autoround

    stock_autoround.AutoRound = factory
    try:
        yield
    finally:
        stock_autoround.AutoRound = real


def test_oneshot_tiny_moe_matches_stock(tmp_path: Path):
    """Stock AutoRoundModifier on a tiny MoE model, experts stock vs grouped."""
    model = save_tiny_model("moe", tmp_path / "model")

    def quantize(output: str) -> dict[str, torch.Tensor]:
        torch.manual_seed(0)
        oneshot(
            model=str(model), dataset=calibration_data(16, 32), output_dir=str(tmp_path / output),
            recipe=AutoRoundModifier(iters=20, **AUTOROUND_ARGS),
            num_calibration_samples=16, max_seq_length=32,
        )
        return load_saved_tensors(tmp_path / output)

    stock = quantize("stock")
    counts: list[tuple[int, int]] = []
    with grouped_quantize_block(counts):
        grouped = quantize("grouped")
    assert counts and all(g > 0 and s == 0 for g, s in counts)
    same = total = 0
    for name, tensor in stock.items():
        if name.endswith("weight_packed"):
            a, b = unpack_int4(tensor), unpack_int4(grouped[name])
            same += (a == b).sum().item()
            total += a.numel()
    print(f"\noneshot tiny MoE, 20 iters: {same / total:.4%} of {total} ints identical; "
          f"grouped/stock expert calls per layer {counts}")
    assert same / total >= 0.99


def test_gpu_cache_default_follows_grouped_experts():
    """keep_cache_on_gpu=None keeps auto-round's caches on the GPU for grouped MoE layers."""
    from llmcompressor_parallel import DataParallelAutoRoundModifier

    moe_layer = configured_layer("W4A16", 2, ())
    dense_layer = torch.nn.Sequential(torch.nn.Linear(8, 8))
    default = DataParallelAutoRoundModifier(scheme="W4A16", targets="Linear")
    assert default._keeps_cache_on_gpu(moe_layer)
    assert not default._keeps_cache_on_gpu(dense_layer)
    per_expert = DataParallelAutoRoundModifier(scheme="W4A16", targets="Linear", grouped_experts=False)
    assert not per_expert._keeps_cache_on_gpu(moe_layer)
    forced_off = DataParallelAutoRoundModifier(scheme="W4A16", targets="Linear", keep_cache_on_gpu=False)
    assert not forced_off._keeps_cache_on_gpu(moe_layer)
