"""Grouped MoE experts wired into `ParallelGPTQExpertModifier` (issue 3, section 4).

What runs grouped, and when (with `grouped_experts=True`):
- Every llm-compressor linearised experts module (`LinearExperts2D`) that the grouped
  engine reproduces exactly (`engine.grouped_experts.unsupported_reason` is None) gets
  a small dispatcher as its instance `forward` at calibration start. Nothing else is
  built up front.
- Serial passes (stock "sequential" pipeline, or a pass of "parallel_sequential" that
  runs serially): at the first call of a layer's experts in a pass, the dispatcher
  builds that module's stacked weights (`GroupedExperts`) and Hessian accumulator
  (`GroupedExpertHessians`) on the execution device and enters `grouped_forward`,
  which routes the remaining calls of the pass straight to the grouped forward.
  Hessians are accumulated only while hooks are enabled, so the propagation pass
  adds nothing, as stock's disabled hooks add nothing.
- Data-parallel passes ("parallel_sequential"): the pipeline hands every pass's
  replicas to `parallel_pass`; each part (replica) gets its own pair on its device;
  after the pass the parts' accumulators are merged in part order onto the home
  device (`merge_`; valid because each part ran whole batches) and exported into
  stock's statistics, after the Hessian partials of the other modules.
- `on_sequential_epoch_end`: the layer's accumulators are exported into GPTQ's
  `_hessians` / `_num_samples` before stock's update, at the place in the dicts where
  stock's hooks would have put them (so `assign_batches` forms stock's batches), and
  the stacks are dropped (GPTQ is about to write new weights). The propagation pass
  builds fresh stacks from the quantized weights; those are dropped when the next
  layer's experts build theirs, at the next epoch end, or at calibration end.

Failures: under any pipeline but "parallel_sequential" nothing of ours sees an
exception leave a layer's forward, so `install` puts an always-called forward hook on
every module whose forward raising ends the run (the experts' ancestors and the
decoder layers beside them; `engine.forward_error_hooks`). When one raises, every
experts module gets its own forward back, the stacks are freed and the owner's
device workers stop (`close_workers`), and the error goes on unchanged.
"parallel_sequential" does the
same from its own `except`; there no hook is registered (it would make every pass
serial, and part 0 runs the home layer in a worker thread, which cannot stop the pool).

Stock's per-expert loop runs instead, with one log line per experts module and
reason, when the module is not supported, when a hook other than this modifier's own
Hessian hook would fire on an expert or one of its Linears (or a global module hook
is registered), or when quantization is enabled on an expert Linear during the
forward (stock would fake-quantize there). Stock's hooks stay registered throughout;
the grouped path never calls the expert Linears, so they do not fire.

With share (the default) gate and up of an expert, and in all-experts mode the gate
and up of every expert, get one shared Hessian tensor in GPTQ's dicts; under
torch.distributed (GPTQ reduces the entries in place) each gets its own copy.
"""

from __future__ import annotations

import contextlib
import itertools
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping, Sequence

import torch
from compressed_tensors.offload.dist_utils import is_distributed
from compressed_tensors.utils import get_execution_device, getattr_chain
from loguru import logger
from torch import nn

from llmcompressor.modeling.moe.linear_experts import LinearExperts2D
from llmcompressor.modifiers.utils.hooks import HooksMixin
from llmcompressor_parallel.engine.calibration_hooks import firing_hooks
from llmcompressor_parallel.engine.forward_error_hooks import ForwardErrorHooks
from llmcompressor_parallel.engine.hooks import global_hooks
from llmcompressor_parallel.engine.grouped_experts import (
    GroupedExperts,
    grouped_forward,
    unsupported_reason,
)
from llmcompressor_parallel.engine.grouped_hessians import GroupedExpertHessians

if TYPE_CHECKING:
    from llmcompressor_parallel.modifiers.gptq import ParallelGPTQExpertModifier

__all__ = ["GroupedExpertsWiring"]

_MISSING = object()
# (entries of GPTQ's dicts before the experts' first accumulating call, tie-breaker)
Position = tuple[int, int]


@dataclass(eq=False)
class _Slot:
    """One home `LinearExperts2D` and what the serial path holds for it."""

    name: str
    experts: LinearExperts2D
    linears: list[nn.Module]  # the expert Linears, in stock's hook order
    accumulate: bool  # some of them carry this modifier's Hessian hook
    previous: Any = _MISSING  # the instance forward before the dispatcher
    dispatcher: Callable[..., torch.Tensor] | None = None
    stack: contextlib.ExitStack | None = None  # open while grouped_forward is entered
    hessians: GroupedExpertHessians | None = None
    position: Position | None = None
    finished: bool = False  # its layer's epoch end has passed
    decisions: dict[bool, str | None] = field(default_factory=dict)  # hooks disabled -> reason

    def call_previous(self, *args: Any, **kwargs: Any) -> Any:
        if self.previous is _MISSING:
            return type(self.experts).forward(self.experts, *args, **kwargs)
        return self.previous(*args, **kwargs)


@dataclass(eq=False)
class _PartsToMerge:
    """One experts module's per-part accumulators of a data-parallel calibration pass."""

    slot: _Slot
    accumulators: list[GroupedExpertHessians]
    to_home: dict[nn.Module, nn.Module]  # part 0's modules -> home modules
    position: Position | None = None  # in part 0's order of first accumulation


class GroupedExpertsWiring:
    """The grouped experts path of one `ParallelGPTQExpertModifier` calibration."""

    def __init__(self, owner: "ParallelGPTQExpertModifier"):
        self.owner = owner
        self._slots: dict[nn.Module, _Slot] = {}
        self._to_merge: list[_PartsToMerge] = []
        self._hooked: set[nn.Module] = set()
        self._logged: set[tuple[str, str]] = set()
        self._sequence = itertools.count()
        self._error_hooks = ForwardErrorHooks(self._close_on_error)
        self._closed = False
        self.counts: Counter[tuple[str, str]] = Counter()  # (pass kind, "grouped"/"stock")

    # ------------------------------------------------------------ lifecycle
    def install(self, model: nn.Module) -> None:
        """Put a dispatcher on every supported experts module (nothing is built yet)."""
        # the modules stock's `on_calibration_start` hooks for Hessians
        self._hooked = {
            module
            for module in self.owner._module_names
            if getattr_chain(module, "quantization_scheme.weights", None) is not None
            and not isinstance(module, nn.Embedding)
        }
        for name, module in model.named_modules():
            if not isinstance(module, LinearExperts2D):
                continue
            reason = unsupported_reason(module)
            if reason is not None:
                self._log_stock(name, "all passes", reason)
                continue
            names = ("gate_proj", "up_proj", "down_proj") if module.has_gate else (
                "up_proj", "down_proj"
            )
            linears = [
                getattr(module[index], attr)
                for index in range(module.num_experts)
                for attr in names
            ]
            slot = _Slot(name, module, linears, any(m in self._hooked for m in linears))
            slot.previous = module.__dict__.get("forward", _MISSING)
            slot.dispatcher = self._dispatcher(slot)
            module.forward = slot.dispatcher
            self._slots[module] = slot
        if self._slots and not self.owner._in_parallel_pipeline:
            self._guard_layers(model)

    def _guard_layers(self, model: nn.Module) -> None:
        """Hook every module whose failing forward ends the run: close everything then.

        Those are the experts modules' ancestors and, where an ancestor is a
        ModuleList (the decoder layers), each of its members, dense layers included:
        an error in any of them, before or while its experts run grouped, must not
        leave dispatchers, stacks or worker threads behind.
        """
        names = dict(model.named_modules())
        targets: dict[nn.Module, str] = {}
        for slot in self._slots.values():
            path = slot.name.split(".")
            for depth in range(len(path)):
                prefix = ".".join(path[:depth])
                ancestor = names[prefix]
                if isinstance(ancestor, nn.ModuleList):
                    for index, member in enumerate(ancestor):
                        targets.setdefault(member, f"{prefix}.{index}")
                else:
                    targets.setdefault(ancestor, prefix or "<root>")
        self._error_hooks.add(targets)

    def _close_on_error(self, module: nn.Module, name: str, error: BaseException) -> None:
        """A guarded module's forward raised: close everything."""
        if self._closed:
            return
        logger.warning(
            "{}: forward raised {}: MoE experts get their own forwards back, grouped "
            "stacks are freed, device workers stop",
            name,
            type(error).__name__,
        )
        self.close(export_pending=False)
        self.owner.close_workers()

    def epoch_end(self, modules: Sequence[nn.Module]) -> None:
        """Export the layer's statistics at stock's place in GPTQ's dicts; drop its stacks."""
        if self._to_merge:  # not merged by the pipeline (should not happen): keep them
            self.merge_parallel(merge=True, offset=len(self.owner._hessians))
        members = set(modules)
        exports = []
        for slot in self._slots.values():
            if slot.experts in members:
                exports.append(self._take(slot, share=not is_distributed()))
                self._drop(slot)
                slot.finished, slot.position = True, None
                slot.decisions.clear()
            elif slot.finished:
                self._drop(slot)
        self._splice([export for export in exports if export is not None])

    def close(self, export_pending: bool) -> None:
        """Restore every experts module's forward; export what is pending (or discard it).

        Idempotent: after a failure closed it, the owner's cleanup finds nothing to do.
        """
        if self._closed:
            return
        self._closed = True
        self._error_hooks.remove()
        if export_pending and self._to_merge:
            self.merge_parallel(merge=True, offset=len(self.owner._hessians))
        self._to_merge = []
        slots, self._slots = list(self._slots.values()), {}
        exports = []
        for slot in slots:
            if export_pending:
                exports.append(self._take(slot, share=False))
            slot.hessians = None
            self._drop(slot)
            if slot.experts.__dict__.get("forward") is not slot.dispatcher:
                # someone else replaced it meanwhile (our own parallel passes restore
                # it, on error too: `calibration_onload`)
                (logger.warning if export_pending else logger.debug)(
                    "{}: its forward was replaced after calibration started; left as it is",
                    slot.name,
                )
            elif slot.previous is _MISSING:
                del slot.experts.forward
            else:
                slot.experts.forward = slot.previous
        if export_pending:
            self._splice([export for export in exports if export is not None])
        if self.counts:
            logger.info(
                "{}: MoE experts grouped in {} calibration and {} propagation passes; "
                "stock expert loop in {} and {}",
                type(self.owner).__name__,
                self.counts["calibration", "grouped"],
                self.counts["propagation", "grouped"],
                self.counts["calibration", "stock"],
                self.counts["propagation", "stock"],
            )

    # ------------------------------------------------------------ serial passes
    def _dispatcher(self, slot: _Slot) -> Callable[..., torch.Tensor]:
        def forward(*args: Any, **kwargs: Any) -> torch.Tensor:
            if self._serial_reason(slot) is None:
                self._open(slot)  # the module's forward is now grouped_forward's
                return slot.experts.forward(*args, **kwargs)
            return slot.call_previous(*args, **kwargs)

        return forward

    def _serial_reason(self, slot: _Slot) -> str | None:
        """Why this pass runs stock's loop (decided once per pass kind), or None."""
        disabled = HooksMixin._HOOKS_DISABLED
        if disabled not in slot.decisions:
            reason = self._reason(slot)
            slot.decisions[disabled] = reason
            if reason is not None:
                self.counts[_kind(not disabled), "stock"] += 1
                self._log_stock(slot.name, f"{_kind(not disabled)} pass", reason)
        return slot.decisions[disabled]

    def _open(self, slot: _Slot) -> None:
        """Build the stacks on the execution device and enter `grouped_forward`."""
        for other in self._slots.values():
            if other is not slot and other.finished:
                self._drop(other)
        device = torch.device(get_execution_device(slot.linears[0]))
        grouped = GroupedExperts(slot.experts, device=device)
        if slot.accumulate and slot.hessians is None:
            slot.hessians = GroupedExpertHessians(grouped)

        def should_accumulate() -> bool:
            if HooksMixin._HOOKS_DISABLED:
                return False
            if slot.position is None:
                slot.position = (len(self.owner._hessians), next(self._sequence))
            return True

        stack = contextlib.ExitStack()
        stack.enter_context(
            grouped_forward(slot.experts, grouped, slot.hessians, should_accumulate)
        )
        slot.stack = stack
        self.counts[_kind(not HooksMixin._HOOKS_DISABLED), "grouped"] += 1

    def _drop(self, slot: _Slot) -> None:
        """Leave `grouped_forward` (the dispatcher is back) and free the stacks."""
        if slot.stack is not None:
            stack, slot.stack = slot.stack, None
            stack.close()
        if slot.hessians is not None and slot.hessians.down is None:
            slot.hessians = None  # keeps a reference to the stacks

    def _take(self, slot: _Slot, share: bool) -> tuple | None:
        """The slot's accumulated statistics as (position, hessians, counts), or None."""
        accumulator, slot.hessians = slot.hessians, None
        if accumulator is None or accumulator.down is None:
            return None
        hessians: dict[nn.Module, torch.Tensor] = {}
        counts: dict[nn.Module, torch.Tensor] = {}
        accumulator.export(hessians, counts, modules=self._hooked, share=share)
        return slot.position, hessians, counts

    # ------------------------------------------------------------ data-parallel passes
    @contextlib.contextmanager
    def parallel_pass(
        self,
        parts: Sequence[Mapping[nn.Module, nn.Module]],
        devices: Sequence[torch.device],
        calibrating: bool,
    ) -> Iterator[None]:
        """Each part's experts run grouped on its device for the duration of one pass."""
        kind = _kind(calibrating)
        to_merge = []
        with contextlib.ExitStack() as stack:
            for experts, slot in self._slots.items():
                if experts not in parts[0]:
                    continue  # not in this pass's layers
                reason = self._reason(slot)
                if reason is None and slot.stack is not None:
                    reason = "its stacks from a serial pass are still in use"
                if reason is not None:
                    self.counts[kind, "stock"] += 1
                    self._log_stock(slot.name, f"{kind} pass", reason)
                    continue
                accumulate = calibrating and slot.accumulate
                record = _PartsToMerge(slot, [], {})
                for part, (mapping, device) in enumerate(zip(parts, devices)):
                    module = mapping[experts]
                    grouped = GroupedExperts(module, device=device)
                    accumulator = GroupedExpertHessians(grouped) if accumulate else None
                    stack.enter_context(
                        grouped_forward(
                            module, grouped, accumulator, self._part_switch(record, part)
                        )
                    )
                    if accumulator is not None:
                        record.accumulators.append(accumulator)
                if accumulate:
                    record.to_home = {parts[0][m]: m for m in slot.linears}
                    to_merge.append(record)
                self.counts[kind, "grouped"] += 1
            yield
        self._to_merge.extend(to_merge)

    def _part_switch(self, record: _PartsToMerge, part: int) -> Callable[[], bool]:
        def should_accumulate() -> bool:
            if HooksMixin._HOOKS_DISABLED:
                return False
            if part == 0 and record.position is None:  # runs in part 0's worker only
                partials = self.owner._partials
                seen = 0 if partials is None else partials.seen(0)
                record.position = (seen, next(self._sequence))
            return True

        return should_accumulate

    def merge_parallel(self, merge: bool, offset: int) -> None:
        """Merge the last pass's per-part accumulators onto home and export them.

        Called after the other modules' Hessian partials were merged (`offset`: the
        entries GPTQ's dicts held before that merge), so the shared gate/up entries
        exported here are never added into in place.
        """
        records, self._to_merge = self._to_merge, []
        if not merge:
            return
        exports = []
        for record in records:
            if not record.accumulators:
                continue
            device = torch.device(get_execution_device(record.slot.linears[0]))
            home = GroupedExpertHessians(record.accumulators[0].grouped, device=device)
            for accumulator in record.accumulators:
                home.merge_(accumulator)
            hessians: dict[nn.Module, torch.Tensor] = {}
            counts: dict[nn.Module, torch.Tensor] = {}
            home.export(hessians, counts, share=not is_distributed())
            hessians = {record.to_home[m]: h for m, h in hessians.items()}
            counts = {record.to_home[m]: n for m, n in counts.items()}
            keep = [m for m in hessians if m in self._hooked]
            position = record.position
            if position is not None:
                position = (offset + position[0], position[1])
            exports.append(
                (position, {m: hessians[m] for m in keep}, {m: counts[m] for m in keep})
            )
        self._splice(exports)

    # ------------------------------------------------------------ shared
    def _reason(self, slot: _Slot) -> str | None:
        """Why the experts cannot run grouped right now (None: they can)."""
        reason = unsupported_reason(slot.experts)
        if reason is not None:
            return reason
        quantizing = [m for m in slot.linears if _quantization_active(m)]
        if quantizing:
            return (
                f"quantization is enabled during the forward on {len(quantizing)} expert "
                "Linear(s) (stock would fake-quantize them)"
            )
        found = global_hooks()
        if found:
            return "global module hooks are registered: " + "; ".join(found)
        named = ((f"{slot.name}.{n}", m) for n, m in slot.experts.named_modules() if n)
        foreign = [h for h in firing_hooks(named) if not self.owner.merges_hook(h.target)]
        if foreign:
            more = f" (+{len(foreign) - 3} more)" if len(foreign) > 3 else ""
            return (
                "hooks the grouped forward would skip: "
                + "; ".join(h.describe() for h in foreign[:3])
                + more
            )
        return None

    def _splice(self, exports: list[tuple[Position | None, dict, dict]]) -> None:
        """Add exported statistics to GPTQ's dicts, new modules at their stock position.

        A module already in the dicts (stock's hook ran for it too) keeps its place
        and gets the sums added, out of place. New modules are inserted after the
        first `position[0]` entries the dicts held before (in stock's order of
        first hook call), or appended when the position is unknown.
        """
        hessians, counts = self.owner._hessians, self.owner._num_samples
        old_keys = list(hessians)
        inserted: dict[int, list[nn.Module]] = {}
        new_h: dict[nn.Module, torch.Tensor] = {}
        new_n: dict[nn.Module, torch.Tensor] = {}
        ordered = sorted(exports, key=lambda e: (1, 0) if e[0] is None else (0, *e[0]))
        for position, export_h, export_n in ordered:
            at = len(old_keys) if position is None else min(position[0], len(old_keys))
            for module, hessian in export_h.items():
                count = export_n[module]
                if module in hessians:
                    target = hessians[module]
                    hessians[module] = target + hessian.to(target.device)
                    counts[module] = counts[module] + count.to(counts[module].device)
                else:
                    new_h[module], new_n[module] = hessian, count
                    inserted.setdefault(at, []).append(module)
        if not new_h:
            return
        old_h, old_n = dict(hessians), dict(counts)
        order: list[nn.Module] = []
        for index in range(len(old_keys) + 1):
            order.extend(inserted.get(index, []))
            if index < len(old_keys):
                order.append(old_keys[index])
        hessians.clear()
        counts.clear()
        for module in order:
            hessians[module] = new_h[module] if module in new_h else old_h[module]
            if module in new_n or module in old_n:
                counts[module] = new_n[module] if module in new_n else old_n[module]
        for module, count in old_n.items():  # counts without a Hessian (none in stock)
            counts.setdefault(module, count)

    def _log_stock(self, name: str, where: str, reason: str) -> None:
        if (name, reason) in self._logged:
            return
        self._logged.add((name, reason))
        logger.info("{}: experts run as llm-compressor's loop ({}): {}", name, where, reason)


def _kind(calibrating: bool) -> str:
    return "calibration" if calibrating else "propagation"


def _quantization_active(linear: nn.Module) -> bool:
    """What compressed-tensors' quantized forward checks before it fake-quantizes."""
    return (
        getattr(linear, "quantization_enabled", True)
        and getattr(linear, "quantization_scheme", None) is not None
        and getattr(linear, "quantization_status", None) is not None
    )
