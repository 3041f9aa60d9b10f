"""Exact weight gradients under the fan-out vs auto-round's wrapped Linears run whole.

The block is test_grouped_autoround's MoE block with auto-round-wrapped experts run
by llm-compressor's per-expert loop (every wrapper a Linear the exact path covers),
random tuning parameters partly outside auto-round's clamp bounds. One call and one
backward of a fixed probe, the batch whole (stock) and split over CPU parts: the
gradients of every tuning parameter must be stock's bit for bit.
"""

from __future__ import annotations

import pytest
import torch

from llmcompressor_parallel.engine import DeviceWorkerPool, FanOut
from llmcompressor_parallel.engine import grouped_autoround
from llmcompressor_parallel.engine.exact_weight_grads import ExactWeightGradients
from llmcompressor_parallel.engine.gathered_weight import GatheredWeight
from oneshot_runs import log_lines
from llmcompressor_parallel.engine.gathered_weight import RoutedRows
from llmcompressor_parallel.engine.grouped_autoround_experts import QuantizedGroupedExperts
from test_grouped_autoround import NUM_EXPERTS, PARAMS, inputs, run, wrapped_block, wrappers

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


def _identical_share(stock: dict, ours: dict) -> dict[str, float]:
    return {
        name: sum(torch.equal(a, b) for a, b in zip(stock[name], ours[name])) / len(stock[name])
        for name in stock
    }


@pytest.mark.parametrize("amp", [True, False], ids=["bf16-autocast", "fp32"])
@pytest.mark.parametrize("parts,batch", [(2, 4), (3, 4)], ids=["2-even", "3-uneven"])
def test_split_batch_gradients_are_stock_bits(amp, parts, batch):
    block = wrapped_block(dtype=torch.bfloat16 if amp else torch.float32)
    x = inputs(batch=batch)
    stock = run(block, x, amp=amp)
    with DeviceWorkerPool([torch.device("cpu")] * parts) as pool:
        with ExactWeightGradients(block, "block") as exact:
            ours = run(block, x, amp=amp, pool=pool)
    shares = _identical_share(stock[1], ours[1])
    print(f"\n{parts} parts, batch {batch}, amp={amp}: share of bit-identical gradients {shares}")
    assert exact.exact_calls == 1
    assert torch.equal(stock[0], ours[0])
    assert shares == {name: 1.0 for name in (*PARAMS, "input")}


def _stock_and_split(block, x, amp: bool, parts: int, monkeypatch) -> tuple:
    """Stock's call, then ours with grouped experts over `parts` CPU parts (exact, all
    tokens); returns (stock, ours, the expert ranges each call was cut into, the share
    of bit-identical gradients per tuning parameter)."""
    stock = run(block, x, amp=amp)
    ranges = []
    by_range = QuantizedGroupedExperts.qdq_rows_by_range

    def spied(self, bounds, devices):
        ranges.append(list(bounds))
        return by_range(self, bounds, devices)

    monkeypatch.setattr(QuantizedGroupedExperts, "qdq_rows_by_range", spied)
    with DeviceWorkerPool([torch.device("cpu")] * parts) as pool:
        ours = run(block, x, amp=amp, pool=pool, grouped=dict(all_tokens="auto", exact=True))
    return stock, ours, ranges, _identical_share(stock[1], ours[1])


@pytest.mark.parametrize("amp", [True, False], ids=["bf16-autocast", "fp32"])
@pytest.mark.parametrize("parts,batch", [(2, 4), (3, 4)], ids=["2-even", "3-uneven"])
def test_grouped_experts_split_batch_gradients_are_stock_bits(amp, parts, batch, monkeypatch):
    """Experts grouped on all tokens with qdq once: the experts are cut into one range
    per part, whose qdq and stacks' gradients (gathered from every part's rows,
    gathered_weight.py, "bmm" layouts) run on that part's device."""
    block = wrapped_block(dtype=torch.bfloat16 if amp else torch.float32)
    stock, ours, ranges, shares = _stock_and_split(block, inputs(batch=batch), amp, parts, monkeypatch)
    print(f"\ngrouped, {parts} parts, amp={amp}: expert ranges {ranges}; "
          f"share of bit-identical gradients {shares}")
    assert NUM_EXPERTS == 8
    assert ranges == [{2: [(0, 4), (4, 8)], 3: [(0, 3), (3, 6), (6, 8)]}[parts]]
    assert ours[3].shipped_calls == 1 and ours[3].stock_calls == 0
    assert torch.equal(stock[0], ours[0])
    assert shares == {name: 1.0 for name in (*PARAMS, "input")}


def test_experts_that_fall_back_to_the_per_expert_loop_are_gathered_too(monkeypatch):
    """Grouped experts refused (here by a patched check): the replicas run stock's loop
    with the experts' wrapped Linears, whose gradients the dense path then gathers."""
    monkeypatch.setattr(grouped_autoround, "wrapped_unsupported_reason", lambda *a, **k: "refused")
    block = wrapped_block(dtype=torch.bfloat16)
    x = inputs(batch=4)
    stock = run(block, x)
    with DeviceWorkerPool([torch.device("cpu")] * 2) as pool:
        ours = run(block, x, pool=pool, grouped=dict(all_tokens="auto", exact=True), exact=True)
    shares = _identical_share(stock[1], ours[1])
    print(f"\ngrouped experts refused, 2 parts: share of bit-identical gradients {shares}")
    assert ours[3].shipped_calls == 0 and ours[3].grouped_calls == 0
    assert shares == {name: 1.0 for name in (*PARAMS, "input")}


def test_without_it_the_split_sums_differ():
    """The control: the same split with per-replica sums is not stock's bits."""
    block = wrapped_block(dtype=torch.bfloat16)
    x = inputs(batch=4)
    stock = run(block, x)
    with DeviceWorkerPool([torch.device("cpu")] * 2) as pool:
        ours = run(block, x, pool=pool)
    shares = _identical_share(stock[1], ours[1])
    print(f"\nper-replica sums: share of bit-identical gradients {shares}")
    assert shares["value"] < 1.0


def test_patches_end_with_the_call_and_replicas_get_no_tuning_copies():
    block = wrapped_block(dtype=torch.bfloat16)
    home_state = [dict(w.__dict__) for w in wrappers(block)]
    x = inputs(batch=4).to(torch.bfloat16)
    with DeviceWorkerPool([torch.device("cpu")] * 2) as pool:
        with ExactWeightGradients(block, "block"), FanOut(block, pool, "block") as fan_out:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = block(x)
            for wrapper in wrappers(block):
                copy = fan_out._replicas.counterparts(wrapper, 2)[1]
                assert copy is not wrapper
                assert not set(PARAMS) & set(copy._parameters)
                assert not set(PARAMS) & set(copy.__dict__)
            out.float().sum().backward()
    assert fan_out.parallel_calls == 1
    assert [dict(w.__dict__) for w in wrappers(block)] == home_state
    assert all(w.value.grad is not None for w in wrappers(block))


def test_a_part_whose_output_gradient_never_came_is_named():
    """Unreachable through a fan-out (its gather hands every part a gradient, zeros
    included), hence driven by hand: the weight gradient is refused, not partial."""
    weight = torch.randn(3, 4, requires_grad=True)
    gathered = GatheredWeight(weight * 1, [torch.device("cpu"), torch.device("meta")], "layer.q_proj")
    x = torch.randn(2, 4)
    output = gathered.record(0, x, x @ weight.detach().t())
    with pytest.raises(RuntimeError, match=r"layer\.q_proj: no output gradient from the "
                                           r"part\(s\) on meta"):
        output.sum().backward()


def test_unsupported_wrapper_keeps_split_sums_with_a_reason():
    block = wrapped_block(dtype=torch.bfloat16)
    first = wrappers(block)[0]
    first.orig_forward = lambda x, weight, bias: torch.nn.functional.linear(x, weight, bias)
    with DeviceWorkerPool([torch.device("cpu")] * 2) as pool, log_lines() as lines:
        with ExactWeightGradients(block, "block") as exact:
            run(block, inputs(batch=4), pool=pool)
    assert exact.exact_calls == 1  # the others still gather
    assert any("block.experts.0.up_proj: weight gradients summed per replica: its "
               "orig_forward is <function" in line for line in lines)


@pytest.mark.parametrize("layout", ["experts", "experts_shared"])
def test_expert_ranges_give_the_whole_stacks_gradient(layout):
    """`first_expert`: a range's gradient is the whole stack's rows of those experts,
    bit for bit, also where the parts' rows mix experts of every range."""
    generator = torch.Generator().manual_seed(0)
    experts, width, out_width, tokens = 5, 16, 12, [6, 4]
    rows, places = [], []
    for count in tokens:  # each part: every token routed to 2 of the experts
        expert = torch.stack([torch.randperm(experts, generator=generator)[:2] for _ in range(count)]).flatten()
        places.append(RoutedRows(expert, torch.arange(count).repeat_interleave(2), count))
        rows.append(torch.randn(expert.numel(), out_width, generator=generator))
    if layout == "experts_shared":
        inputs_ = [torch.randn(count, width, generator=generator) for count in tokens]
    else:
        inputs_ = [torch.randn(r.shape[0], width, generator=generator) for r in rows]
    weight = torch.zeros(experts, width, out_width, requires_grad=True)

    def gradient(first: int | None, stop: int) -> torch.Tensor:
        start = 0 if first is None else first
        part_weight = weight[start:stop].detach().requires_grad_()
        gathered = GatheredWeight(part_weight, [torch.device("cpu")] * 2, "stack", layout, first)
        total = 0
        for part, (x, y, place) in enumerate(zip(inputs_, rows, places)):
            output = torch.zeros_like(y, requires_grad=True)
            total = total + (gathered.record(part, x, output, place) * y).sum()
        total.backward()
        return part_weight.grad

    whole = gradient(None, experts)
    pieces = torch.cat([gradient(0, 2), gradient(2, 5)])
    assert whole.abs().sum() > 0
    assert torch.equal(pieces, whole)


def test_more_parts_than_experts_cut_one_expert_per_range(monkeypatch):
    """2 experts over 3 parts: two ranges of one expert; the third part runs its rows
    over the assembled qdq and still hands its rows to both ranges' gradients. Expert 1
    is starved (top-1 routing never picks it): its range's gradient comes from zeros, as
    stock's all-token one does."""
    block = wrapped_block(dtype=torch.float32, num_experts=2, top_k=1)
    stock, ours, ranges, shares = _stock_and_split(block, inputs(batch=3), False, 3, monkeypatch)
    print(f"\n2 experts, 3 parts: expert ranges {ranges}; share of bit-identical gradients {shares}")
    assert ranges == [[(0, 1), (1, 2)]]
    assert ours[3].shipped_calls == 1 and ours[3].stock_calls == 0
    assert torch.equal(stock[0], ours[0])
    assert shares == {name: 1.0 for name in (*PARAMS, "input")}
