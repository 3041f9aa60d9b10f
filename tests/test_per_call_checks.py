"""The per-call checks of grouped experts and replicas see every change between calls.

`GroupedAutoRoundExperts` asks at each call of an experts module whether it may run
grouped (hooks, patched forwards, offload devices) and whether its stacks are stale
(weights replaced or written in place); `ReplicaSet.sync` whether the home layer's
structure or frozen tensors changed. Those checks are built for speed; here each kind
of change is made between two calls and must be seen at the next one.
"""

from __future__ import annotations

import functools
import types
from collections import OrderedDict

import pytest
import torch
from torch import nn
from compressed_tensors.offload import disable_offloading, disable_onloading
from test_autoround_capture import block_input, calibration_call, offloaded_block
from test_grouped_autoround import inputs, wrapped_block, wrappers
from tiny_models import decoder_layer_and_inputs
from torch.nn.modules import module as torch_module

from auto_round.wrapper import WrapperLinear
from llmcompressor.modeling.moe.context import moe_calibration_context
from llmcompressor_parallel.engine import grouped_autoround
from llmcompressor_parallel.engine.grouped_autoround import GroupedAutoRoundExperts
from llmcompressor_parallel.engine.hooks import any_hooks, has_hooks
from llmcompressor_parallel.engine.offload_forward import offload_onload_device, parameter_values
from llmcompressor_parallel.engine.hooks import foreign_hooks
from llmcompressor_parallel.engine.module_walk import walk_modules
from llmcompressor_parallel.engine.replicate import ReplicaSet, _tensor_attributes

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


# ------------------------------------------------------------------ grouped experts
def _counts(context: GroupedAutoRoundExperts) -> tuple[int, int]:
    return context.grouped_calls, context.stock_calls


def _hook(*args, **kwargs) -> None:
    return None


# each: (what it does to the offloaded block, how it is undone); `block.experts` is the
# LinearExperts2D, `[3]` an expert MLP, `.up_proj` one of its Linears
def _forward_hook(block):
    handle = block.experts[3].up_proj.register_forward_hook(_hook)
    return handle.remove


def _pre_hook_with_kwargs(block):
    handle = block.experts[5].register_forward_pre_hook(_hook, with_kwargs=True)
    return handle.remove


def _backward_hook(block):
    handle = block.experts[0].down_proj.register_full_backward_hook(_hook)
    return handle.remove


def _hook_put_in_the_dict(block):
    """No `register_*`: no RemovableHandle id is drawn."""
    hooks = block.experts[7].gate_proj._forward_hooks
    hooks[-1] = _hook
    return lambda: hooks.pop(-1)


def _hook_dict_replaced(block):
    linear = block.experts[2].up_proj
    saved = linear._forward_pre_hooks
    linear._forward_pre_hooks = OrderedDict({-1: _hook})
    return lambda: setattr(linear, "_forward_pre_hooks", saved)


def _global_hook(block):
    handle = torch_module.register_module_forward_hook(_hook)
    return handle.remove


def _forward_patched(block):
    linear = block.experts[1].down_proj
    saved = linear.__dict__["forward"]
    linear.forward = functools.partial(type(linear).forward, linear)
    return lambda: setattr(linear, "forward", saved)


def _offload_moved(block):
    """The wrapper of one Linear would now onload its inputs to another device."""
    cache = block.experts[4].up_proj._parameters
    saved = cache.onload_device
    cache.onload_device = torch.device("meta")
    return lambda: setattr(cache, "onload_device", saved)


CHANGES = [
    _forward_hook, _pre_hook_with_kwargs, _backward_hook, _hook_put_in_the_dict,
    _hook_dict_replaced, _global_hook, _forward_patched, _offload_moved,
]


@pytest.mark.parametrize("change", CHANGES, ids=lambda f: f.__name__.strip("_"))
def test_a_change_between_calls_takes_the_stock_loop_at_the_next_call(change):
    block = offloaded_block()
    x = block_input()
    stock = calibration_call(block, x)
    with GroupedAutoRoundExperts(block, "block") as context:
        first = calibration_call(block, x)
        assert _counts(context) == (1, 0)
        undo = change(block)
        try:
            if change is _offload_moved:  # asked directly: a call would onload to meta
                plan = block.experts.__dict__[grouped_autoround._PLAN_ATTR]
                reason = grouped_autoround._call_reason(plan, x.flatten(0, 1))
                assert "onload their inputs to meta" in reason
            else:
                changed = calibration_call(block, x)
                assert _counts(context) == (1, 1)
                assert torch.equal(changed, stock)
        finally:
            undo()
        again = calibration_call(block, x)  # undone: grouped again
        assert context.grouped_calls == 2
    assert torch.equal(first, again)


def _scaled_in_place(linear):
    with torch.no_grad():
        linear.weight.mul_(0.5)


def _replaced_through_the_cache(linear):
    """compressed-tensors' assignment: the offloaded copy and the kept onloaded tensor
    are written in place."""
    linear.weight = torch.nn.Parameter(linear.weight.detach() * 0.5, requires_grad=False)


def _replaced_by_another_shape_in_the_cache(linear):
    """A new offloaded tensor: the next read onloads (and keeps) a new tensor."""
    weight = torch.nn.Parameter(linear.weight.detach() * 0.5, requires_grad=False)
    del linear.weight
    linear.weight = weight


@pytest.mark.parametrize(
    "write", [_scaled_in_place, _replaced_through_the_cache, _replaced_by_another_shape_in_the_cache],
    ids=lambda f: f.__name__.strip("_"),
)
def test_offloaded_weights_written_between_calls_reach_the_stacks(write):
    block = offloaded_block()
    x = block_input()
    with GroupedAutoRoundExperts(block, "block") as context:
        # one offloading-disabled window over both calls, as the pipeline's pass
        with torch.no_grad(), disable_offloading(), moe_calibration_context():
            block(x)
            write(block.experts[6].gate_proj)
            grouped = block(x)
        assert _counts(context) == (2, 0)
    stock = calibration_call(block, x)
    assert torch.equal(grouped, stock)


def test_wrapped_weights_and_hooks_changed_between_calls():
    """The tuning layer (auto-round's wrappers): a hook on a wrapped Linear, then an
    in-place write of a wrapped weight, each seen at the next call."""
    block = wrapped_block()
    x = inputs()
    wrapper = wrappers(block)[5]
    assert isinstance(wrapper, WrapperLinear)
    with GroupedAutoRoundExperts(block, "block") as context, torch.no_grad():
        with moe_calibration_context():
            block(x)
            handle = wrapper.orig_layer.register_forward_hook(_hook)
            block(x)
            assert _counts(context) == (1, 1)
            handle.remove()
            block(x)
            assert _counts(context) == (2, 1)
            wrapper.orig_layer.weight.mul_(0.5)
            grouped = block(x)
    with torch.no_grad(), moe_calibration_context():
        stock = block(x)
    assert torch.equal(grouped, stock)


# ------------------------------------------------------------------ the helpers
def test_any_hooks_agrees_with_has_hooks():
    modules = [torch.nn.Linear(2, 2) for _ in range(4)]
    assert not any_hooks(modules)
    registrations = [
        lambda m: m.register_forward_hook(_hook),
        lambda m: m.register_forward_pre_hook(_hook),
        lambda m: m.register_full_backward_hook(_hook),
        lambda m: m.register_full_backward_pre_hook(_hook),
        lambda m: m.register_forward_hook(_hook, always_call=True),
    ]
    for register in registrations:
        handle = register(modules[2])
        assert any_hooks(modules) and any(map(has_hooks, modules))
        handle.remove()
        assert not any_hooks(modules) and not any(map(has_hooks, modules))


def test_forward_state_is_patched_forward_and_onload_device():
    """One look at each instance forward answers both questions as before."""
    block = offloaded_block()
    expert, linear = block.experts[0], block.experts[0].up_proj
    plain = torch.nn.Linear(2, 2)
    rebound = torch.nn.Linear(2, 2)
    rebound.forward = rebound.forward  # a bound method of the class's forward: harmless
    patched = torch.nn.Linear(2, 2)
    patched.forward = functools.partial(torch.nn.Linear.forward, patched)
    no_inner = offloaded_block().experts[1].down_proj  # the wrapper without its target
    del no_inner._original_forward_func
    moved = offloaded_block().experts[2].gate_proj
    moved._parameters.onload_device = torch.device("meta")
    cases = {
        "offloaded expert": (expert, (False, "cpu")),
        "offloaded Linear": (linear, (False, "cpu")),
        "plain": (plain, (False, None)),
        "rebound": (rebound, (False, None)),
        "patched": (patched, (True, None)),
        "wrapper without target": (no_inner, (True, None)),
        "moved": (moved, (False, "meta")),
    }
    for name, (module, (is_patched, device)) in cases.items():
        state = grouped_autoround._forward_state(module)
        old_patched = _old_patched_forward(module)
        assert state == (old_patched, offload_onload_device(module)), name
        assert (state[0], None if state[1] is None else str(state[1])) == (is_patched, device), name


def _old_patched_forward(module: torch.nn.Module) -> bool:
    """`grouped_autoround._patched_forward` as it was before `_forward_state`."""
    from llmcompressor_parallel.engine.offload_forward import offload_inner_forward

    forward = module.__dict__.get("forward")
    if forward is None:
        return False
    inner = offload_inner_forward(module)
    if inner is not None:
        return not grouped_autoround._runs_own_forward(module, inner)
    if not isinstance(forward, types.MethodType) or forward.__self__ is not module:
        return True
    return not grouped_autoround._runs_own_forward(module, forward.__func__)


def _reads(module: torch.nn.Module) -> list[torch.Tensor]:
    return [p for p in module._parameters.values() if p is not None]


def _same_tensors(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(x is y for x, y in zip(a, b))


def test_parameter_values_reads_what_the_offload_cache_returns():
    block = offloaded_block()
    linear = block.experts[0].up_proj
    linear._parameters.onload_device = torch.device("meta")  # each onload: a new tensor
    plain = torch.nn.Linear(3, 2)
    assert _same_tensors(parameter_values([plain]), _reads(plain))
    with disable_offloading():
        first = parameter_values([linear])  # nothing kept yet: read through the cache
        assert [p.device.type for p in first] == ["meta"]
        assert _same_tensors(_reads(linear), first)  # kept by that read
        assert _same_tensors(parameter_values([linear]), first)  # the kept tensor
    with disable_onloading():
        assert _same_tensors(parameter_values([linear]), _reads(linear))  # the offloaded one
    assert [p.device.type for p in parameter_values([linear])] == ["meta"]  # onloaded anew


# ------------------------------------------------------------------ replicas
def _old_structure(home: torch.nn.Module) -> tuple:
    """`ReplicaSet._current_structure` as it was before it was made fast."""
    return tuple(
        (
            id(module),
            tuple((name, id(child)) for name, child in module._modules.items()),
            tuple(
                (name, None if p is None else (id(p), p.requires_grad))
                for name, p in module._parameters.items()
            ),
            tuple((name, id(b)) for name, b in module._buffers.items()),
            tuple(name for name, value in module.__dict__.items() if isinstance(value, torch.Tensor)),
        )
        for module in home.modules()
    )


def test_walk_is_modules_order_with_shared_and_missing_children():
    layer, _ = decoder_layer_and_inputs("cpu")
    layer.mlp.shared = layer.self_attn.q_proj  # seen twice: listed once, where first met
    layer.mlp.missing = None
    layer.self_attn.register_module("nothing", None)
    assert [id(m) for m in walk_modules(layer)] == [id(m) for m in layer.modules()]


class _TensorSubclass(torch.Tensor):
    pass


def test_tensor_attributes_are_those_isinstance_finds():
    linear = torch.nn.Linear(2, 2)
    linear.plain = torch.zeros(1)
    linear.__dict__["param_attr"] = torch.nn.Parameter(torch.zeros(1))  # not registered
    linear.subclass = torch.zeros(1).as_subclass(_TensorSubclass)
    linear.number, linear.none, linear.dtype, linear.flags = 1.0, None, torch.float32, (1,)
    expected = tuple(n for n, v in linear.__dict__.items() if isinstance(v, torch.Tensor))
    assert _tensor_attributes(linear) == expected == ("plain", "param_attr", "subclass")


STRUCTURE_CHANGES = {
    "child replaced": lambda layer: setattr(layer.mlp, "act_fn", torch.nn.ReLU()),
    "child added": lambda layer: layer.mlp.add_module("extra", torch.nn.Identity()),
    "parameter replaced": lambda layer: setattr(
        layer.mlp.up_proj, "weight", torch.nn.Parameter(layer.mlp.up_proj.weight.detach().clone())
    ),
    "parameter set to None": lambda layer: setattr(layer.mlp.up_proj, "bias", None)
    if layer.mlp.up_proj.bias is not None
    else layer.mlp.up_proj.register_parameter("bias", torch.nn.Parameter(torch.zeros(1))),
    "trainable flag": lambda layer: layer.mlp.down_proj.weight.requires_grad_(
        not layer.mlp.down_proj.weight.requires_grad
    ),
    "buffer added": lambda layer: layer.mlp.register_buffer("seen", torch.zeros(2)),
    "tensor attribute set": lambda layer: setattr(layer.mlp.gate_proj, "weight_min", torch.zeros(2)),
}


@pytest.mark.parametrize("name", list(STRUCTURE_CHANGES))
def test_replica_set_rebuilds_exactly_when_the_structure_changes(name):
    layer, _ = decoder_layer_and_inputs("cpu")
    replicas = ReplicaSet(layer, [torch.device("cpu"), torch.device("cpu")], None)
    replicas.sync()
    replicas.sync()
    assert replicas.rebuilds == 1  # nothing changed: no rebuild
    before = _old_structure(layer)
    STRUCTURE_CHANGES[name](layer)
    assert _old_structure(layer) != before  # the change is one the old walk saw
    replicas.sync()
    assert replicas.rebuilds == 2
    replicas.sync()
    assert replicas.rebuilds == 2


def test_foreign_hooks_names_hooks_inside_the_layer_only_and_global_ones():
    layer = nn.Sequential(nn.Linear(2, 2), nn.Sequential(nn.ReLU(), nn.Linear(2, 2)))
    layer.register_forward_hook(lambda *args: None)  # on the layer itself: not foreign
    assert foreign_hooks(layer) == []
    handle = layer[1][1].register_forward_pre_hook(lambda *args: None)
    assert len(found := foreign_hooks(layer)) == 1 and found[0].endswith("on 1.1")
    handle.remove()
    handle = nn.modules.module.register_module_forward_hook(lambda *args: None)
    try:
        assert len(foreign_hooks(layer)) == 1
    finally:
        handle.remove()
    assert foreign_hooks(layer) == []
