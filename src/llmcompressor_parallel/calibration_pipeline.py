"""The "parallel_sequential" pipeline: stock sequential, with batches in flight on every device.

Why a pipeline of our own: llm-compressor's sequential pipeline feeds a layer one
calibration batch at a time from one loop, and picks itself by name
(`CalibrationPipeline._infer_pipeline` returns "sequential" for any modifier that
needs data); no modifier can change either without patching llm-compressor for the
whole process. So users opt in with `oneshot(..., pipeline="parallel_sequential")`;
`ParallelGPTQExpertModifier` logs once how to when it finds itself under another
pipeline. (llm-compressor then warns that "sequential" is recommended: expected.)

What it does: exactly the stock sequential pipeline (same tracing, cache, lifecycle
callbacks and order, reusing llm-compressor's own helpers), except that a pass over
a subgraph's batches may run data-parallel: each device of the modifier's
`DeviceWorkerPool` takes a contiguous run of the batches and runs the subgraph's
code on them, its layers replaced by that device's replicas
(`engine.calibration_replicas`). A pass runs in parallel only when that gives
stock's result:
- calibration pass: every hook that fires inside the subgraph is a hook that a
  participating modifier accumulates per replica and merges exactly (GPTQ's Hessian
  hook: `ParallelCalibrationParticipant`), and sits inside a replicated layer;
- propagation pass (hooks disabled): no hook fires at all (HooksMixin hooks are
  silenced; any other hook blocks);
- the layers can be replicated, and there are at least two batches.
Otherwise the pass runs as stock's loop and one line names the reason.
Around every data-parallel pass a participant may enter its own context with the
pass's replicas (`parallel_pass`; GPTQ runs MoE experts grouped on each replica).
Outputs are written to the intermediates cache in batch order per batch, as stock
writes them; the propagation pass's outputs are bit-identical to stock's on
devices of one kind, since each batch runs the same kernels on the same inputs.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Mapping, Protocol, Sequence, runtime_checkable

import torch
from compressed_tensors.offload import disable_offloading, set_onload_device
from compressed_tensors.utils.match import match_named_modules
from loguru import logger
from torch import nn
from torch.utils._pytree import tree_flatten
from torch.utils.data.dataloader import DataLoader
from tqdm import tqdm

from llmcompressor.core import LifecycleCallbacks, active_session
from llmcompressor.modifiers.utils.hooks import HooksMixin
from llmcompressor.pipelines.cache import IntermediatesCache, OverrideEqMode
from llmcompressor.pipelines.registry import CalibrationPipeline
from llmcompressor.pipelines.sequential.helpers import (
    Subgraph,
    handle_sequential_oom,
    trace_subgraphs,
)
from llmcompressor.utils.dev import get_main_device
from llmcompressor.utils.helpers import DisableQuantization, calibration_forward_context
from llmcompressor.utils.pytorch.module import infer_sequential_targets

from llmcompressor_parallel.engine.calibration_hooks import firing_hooks
from llmcompressor_parallel.engine.hooks import global_hooks
from llmcompressor_parallel.engine.calibration_onload import onloaded_as_plain_modules
from llmcompressor_parallel.engine.calibration_replicas import SubgraphReplicas
from llmcompressor_parallel.engine.part_onload import (
    direct_onload_reason,
    fetch_to,
    offload_outputs,
    recorded_device,
)
from llmcompressor_parallel.engine.replicate import NotReplicable
from llmcompressor_parallel.engine.scatter_gather import split_ranges
from llmcompressor_parallel.engine.thread_context import ThreadContext
from llmcompressor_parallel.engine.worker_pool import DeviceWorkerPool

if TYPE_CHECKING:
    from llmcompressor.args.dataset_arguments import DatasetArguments

__all__ = [
    "PIPELINE_NAME",
    "ParallelCalibrationParticipant",
    "ParallelSequentialPipeline",
]

PIPELINE_NAME = "parallel_sequential"


@runtime_checkable
class ParallelCalibrationParticipant(Protocol):
    """A modifier whose calibration hooks can run on replicas and be merged exactly.

    Optional: `parallel_pass(parts, devices, calibrating) -> ContextManager`, entered
    around every data-parallel pass (calibration and propagation) once the replicas
    exist and before any per-part hook is registered, and exited before the layers
    get their offloading back. `parts[k]` maps each home module of the replicated
    layers to the module part k runs, on `devices[k]`. `ParallelGPTQExpertModifier`
    uses it to run MoE experts grouped on every part (`modifiers.gptq_grouped`).
    """

    def join_parallel_pipeline(self) -> None:
        """Called before calibration starts: this pipeline is the one in use."""

    def parallel_calibration_pool(self) -> DeviceWorkerPool | None:
        """The workers to spread batches over (None: the modifier is not parallel)."""

    def merges_hook(self, hook: Callable) -> bool:
        """Whether `hook` (as written, unwrapped) is one this modifier merges."""

    def begin_parallel_calibration(
        self, modules: Sequence[nn.Module], parts: Sequence[Mapping[nn.Module, nn.Module]]
    ) -> None:
        """Accumulate per part: `parts[k]` maps each home module to the one part k runs."""

    def end_parallel_calibration(self, merge: bool) -> None:
        """Remove the per-part hooks; merge the parts' statistics when `merge`."""

    def close_workers(self) -> None:
        """Stop the pool's threads (the run failed)."""


@CalibrationPipeline.register(PIPELINE_NAME)
class ParallelSequentialPipeline(CalibrationPipeline):
    @staticmethod
    @handle_sequential_oom
    def __call__(model: nn.Module, dataloader: DataLoader, dataset_args: "DatasetArguments"):
        """Stock `SequentialPipeline.__call__`, with each pass handed to `_PassRunner`."""
        session = active_session()
        onload_device = get_main_device()
        offload_device = torch.device(dataset_args.sequential_offload_device)
        set_onload_device(model, onload_device)

        modifiers = session.lifecycle.recipe.modifiers
        if any(type(m).__name__ == "AutoRoundModifier" for m in modifiers):
            dataset_args.propagate_error = False  # as stock decides it
        participants = [m for m in modifiers if isinstance(m, ParallelCalibrationParticipant)]
        for participant in participants:
            participant.join_parallel_pipeline()

        sequential_targets = infer_sequential_targets(model, dataset_args.sequential_targets)
        sample_input = next(iter(dataloader))
        subgraphs = trace_subgraphs(
            model,
            sample_input,
            sequential_targets,
            dataset_args.tracing_ignore,
            dataset_args.sequential_targets_per_subgraph,
        )
        num_subgraphs = len(subgraphs)

        LifecycleCallbacks.calibration_start()
        try:
            with contextlib.ExitStack() as stack:
                stack.enter_context(calibration_forward_context(model))
                stack.enter_context(DisableQuantization(model))
                activations = IntermediatesCache.from_dataloader(
                    dataloader, onload_device, offload_device
                )
                if getattr(dataset_args, "use_loss_mask", False):
                    session.state.loss_masks = [
                        activations.fetch(batch_idx, ["loss_mask"]).get("loss_mask")
                        for batch_idx in range(len(dataloader))
                    ]
                else:
                    session.state.loss_masks = None
                prefetch = getattr(dataset_args, "sequential_prefetch", False)
                session.state.sequential_prefetch = prefetch

                runner = _PassRunner(
                    model=model,
                    activations=activations,
                    participants=participants,
                    layers={m for _, m in match_named_modules(model, sequential_targets)},
                    prefetch=prefetch,
                )
                for index, subgraph in enumerate(subgraphs):
                    last = index == num_subgraphs - 1
                    calib_desc = f"({index + 1}/{num_subgraphs}): Calibrating"
                    prop_desc = f"({index + 1}/{num_subgraphs}): Propagating"
                    with disable_offloading():
                        runner.run(
                            subgraph, calib_desc, calibrating=True,
                            store=not dataset_args.propagate_error and not last,
                        )
                        LifecycleCallbacks.sequential_epoch_end(subgraph.submodules(model))
                        if dataset_args.propagate_error:
                            with HooksMixin.disable_hooks():
                                runner.run(subgraph, prop_desc, calibrating=False, store=not last)
                runner.log_summary()
                LifecycleCallbacks.calibration_end()
        except BaseException:
            for participant in participants:
                participant.close_workers()
            raise


@dataclass
class _PassCounts:
    parallel: int = 0
    total: int = 0


@dataclass
class _PassRunner:
    """Runs one pass over a subgraph's batches: data-parallel where exact, else stock's loop."""

    model: nn.Module
    activations: IntermediatesCache
    participants: list[ParallelCalibrationParticipant]
    layers: set[nn.Module]
    prefetch: bool
    counts: dict[str, _PassCounts] = field(default_factory=dict)
    _names: dict[nn.Module, str] = field(default_factory=dict)
    _logged_no_pool: bool = False
    _logged_onload: set[str] = field(default_factory=set)

    def __post_init__(self) -> None:
        self._names = {module: name for name, module in self.model.named_modules()}

    # ------------------------------------------------------------ entry
    def run(self, subgraph: Subgraph, desc: str, calibrating: bool, store: bool) -> None:
        kind = "calibration" if calibrating else "propagation"
        counts = self.counts.setdefault(kind, _PassCounts())
        counts.total += 1
        pool, active = self._pool()
        layer_names = self._layer_names(subgraph)
        reason = self._blocking_reason(subgraph, layer_names, calibrating, active, pool)
        if reason is None:
            reason = self._try_parallel(
                pool, active, subgraph, layer_names, desc, calibrating, store
            )
            if reason is None:
                counts.parallel += 1
                return
        if reason:
            logger.info("{} of {}: running serially: {}", kind, ", ".join(layer_names), reason)
        self._serial(subgraph, desc, calibrating, store)

    def _try_parallel(
        self,
        pool: DeviceWorkerPool,
        active: list[ParallelCalibrationParticipant],
        subgraph: Subgraph,
        layer_names: list[str],
        desc: str,
        calibrating: bool,
        store: bool,
    ) -> str | None:
        """Run the pass data-parallel; returns why not when the layers cannot be replicated.

        The participants merge only after the layers have their offloading back, so
        merged statistics land where stock's hook would have put them.
        """
        parts = min(len(pool.devices), len(self.activations))
        layers = [self.model.get_submodule(name) for name in layer_names]
        with onloaded_as_plain_modules(layers):
            try:
                replicas = SubgraphReplicas(self.model, layer_names, pool.devices[:parts])
            except NotReplicable as error:
                return str(error)
            merging: list[ParallelCalibrationParticipant] = []
            try:
                maps = [replicas.module_map(part) for part in range(replicas.parts)]
                with _participant_passes(active, maps, replicas.devices, calibrating):
                    if calibrating:
                        self._begin(subgraph, maps, active, merging)
                    self._parallel(pool, subgraph, replicas, desc, store)
            except BaseException:
                for participant in merging:
                    participant.end_parallel_calibration(merge=False)
                raise
            finally:
                replicas.release()
        for participant in merging:
            participant.end_parallel_calibration(merge=True)
        return None

    def log_summary(self) -> None:
        pool, _active = self._pool()
        if pool is None:
            return
        logger.info(
            "{}: data-parallel on {} devices ({}): {}",
            PIPELINE_NAME,
            len(pool.devices),
            ", ".join(str(device) for device in pool.devices),
            "; ".join(
                f"{kind} {c.parallel} of {c.total} subgraphs" for kind, c in self.counts.items()
            ),
        )

    # ------------------------------------------------------------ planning
    def _pool(self) -> tuple[DeviceWorkerPool | None, list[ParallelCalibrationParticipant]]:
        """The first participant's pool; participants without one are not parallel."""
        active = [p for p in self.participants if p.parallel_calibration_pool() is not None]
        if not active:
            if not self._logged_no_pool:
                self._logged_no_pool = True
                logger.info(
                    "{}: no modifier in the recipe has data_parallel set; every pass "
                    "runs as in llm-compressor's sequential pipeline",
                    PIPELINE_NAME,
                )
            return None, []
        return active[0].parallel_calibration_pool(), active

    def _layer_names(self, subgraph: Subgraph) -> list[str]:
        """The subgraph's sequential targets (decoder layers): what gets replicated."""
        nodes = subgraph.graph.find_nodes(op="call_module")
        return [
            node.target for node in nodes if self.model.get_submodule(node.target) in self.layers
        ]

    def _blocking_reason(
        self,
        subgraph: Subgraph,
        layer_names: list[str],
        calibrating: bool,
        active: list[ParallelCalibrationParticipant],
        pool: DeviceWorkerPool | None,
    ) -> str | None:
        """Why this pass must run serially ("" when not worth a log line), or None."""
        if pool is None or not layer_names:
            return ""
        if len(self.activations) < 2:
            return "fewer than two calibration batches"
        if pool.closed:
            return "the device workers were stopped"
        found = global_hooks()
        if found:
            return "global module hooks are registered: " + "; ".join(found)
        inside = {m for name in layer_names for m in self.model.get_submodule(name).modules()}
        named = ((self._names.get(m, ""), m) for m in subgraph.submodules(self.model))
        blocking = []
        for hook in firing_hooks(named):
            mergeable = calibrating and any(p.merges_hook(hook.target) for p in active)
            if mergeable and hook.module in inside:
                continue
            where = " (outside the replicated layers)" if mergeable else ""
            blocking.append(hook.describe() + where)
        if blocking:
            return "hooks whose effect cannot be merged across replicas: " + "; ".join(
                blocking[:5]
            ) + (f" (+{len(blocking) - 5} more)" if len(blocking) > 5 else "")
        return None

    def _begin(
        self,
        subgraph: Subgraph,
        maps: list[dict[nn.Module, nn.Module]],
        active: list[ParallelCalibrationParticipant],
        begun: list[ParallelCalibrationParticipant],
    ) -> None:
        """Hand each participant the modules whose hooks it merges, per part; `begun` lists them."""
        named = ((self._names.get(m, ""), m) for m in subgraph.submodules(self.model))
        hooks = firing_hooks(named)
        for participant in active:
            modules = list(
                dict.fromkeys(h.module for h in hooks if participant.merges_hook(h.target))
            )
            if modules:
                begun.append(participant)
                participant.begin_parallel_calibration(modules, maps)

    # ------------------------------------------------------------ the passes
    def _serial(self, subgraph: Subgraph, desc: str, calibrating: bool, store: bool) -> None:
        """Stock's loop, line for line."""
        session = active_session()
        names = subgraph.input_names
        batches = (
            self.activations.iter_prefetch(names) if self.prefetch else self.activations.iter(names)
        )
        for batch_idx, inputs in tqdm(enumerate(batches), total=len(self.activations), desc=desc):
            if calibrating:
                session.state.current_batch_idx = batch_idx
            outputs = subgraph.forward(self.model, **inputs)
            if store:
                self.activations.update(batch_idx, outputs)
                self.activations.delete(batch_idx, subgraph.consumed_names)

    def _parallel(
        self,
        pool: DeviceWorkerPool,
        subgraph: Subgraph,
        replicas: SubgraphReplicas,
        desc: str,
        store: bool,
    ) -> None:
        """Part k runs the k-th contiguous run of batches on its device, in batch order."""
        num_batches = len(self.activations)
        ranges = split_ranges(num_batches, replicas.parts)
        _compile(subgraph)
        context = ThreadContext.capture()
        lock = threading.Lock()
        progress = tqdm(total=num_batches, desc=f"{desc} on {replicas.parts} devices")
        direct = self._direct_onload(subgraph, replicas)
        cache, names = self.activations, subgraph.input_names

        def job(part: int) -> Callable[[], None]:
            view = replicas.view(part)
            own_device = replicas.devices[part] if direct and view is not self.model else None

            def run() -> None:
                with context.applied():
                    for batch_idx in range(*ranges[part]):
                        home = own_device and recorded_device(cache, batch_idx, names)
                        if home is None:
                            inputs = cache.fetch(batch_idx, names)
                        else:  # straight onto this part's device, recorded as stock would
                            inputs = fetch_to(cache, batch_idx, names, own_device)
                        outputs = subgraph.forward(view, **inputs)
                        copies = _offload_copies(outputs, cache.offload_device) if store else []
                        with lock:
                            if store:
                                _store(cache, batch_idx, outputs, copies, subgraph, home)
                            progress.update(1)

            return run

        try:
            pool.run([job(part) for part in range(replicas.parts)])
        finally:
            progress.close()
        active_session().state.current_batch_idx = num_batches - 1

    def _direct_onload(self, subgraph: Subgraph, replicas: SubgraphReplicas) -> bool:
        """Whether each part loads its batches onto its own device (`engine.part_onload`)."""
        inside = {m for layer in replicas.layers for m in layer.modules()}
        reason = direct_onload_reason(subgraph, self.model, inside)
        if reason is not None and reason not in self._logged_onload:
            self._logged_onload.add(reason)
            logger.debug("{}: batches pass through the home device: {}", PIPELINE_NAME, reason)
        return reason is None


def _offload_copies(
    values: dict, device: torch.device | None
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each output tensor and its copy on the cache's offload device, made unlocked.

    `IntermediatesCache.update` would make these copies under the cache lock, one
    part at a time; at 2048 tokens a batch they cost about as much as a decoder
    layer's forward, so the parts make them in their own threads first.
    """
    if device is None:
        return []
    device = torch.device(device)
    leaves = [v for v in tree_flatten(values)[0] if isinstance(v, torch.Tensor)]
    return [(leaf, _offload_copy(leaf, device)) for leaf in leaves if leaf.device != device]


def _offload_copy(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`tensor.to(device)`; from a GPU to host memory, into page-locked memory.

    Page-locked host memory is read and written by the GPUs' copy engines at the
    link's speed, where pageable memory goes through the driver's staging buffers at
    a fraction of it (2x H200, GPTQ on a Llama-3-8B-shape layer: ~2.5 GB/s pageable
    device-to-host per part, about half of a propagation pass).
    The next pass then loads these tensors straight from page-locked memory too. The
    copy is synchronous: the tensor is complete when the batch is stored.
    """
    if device.type != "cpu" or tensor.device.type != "cuda":
        return tensor.to(device)
    copy = torch.empty_like(tensor, device=device, pin_memory=True)
    copy.copy_(tensor)
    return copy


def _store(
    cache: IntermediatesCache,
    batch_idx: int,
    outputs: dict,
    copies: list[tuple[torch.Tensor, torch.Tensor]],
    subgraph: Subgraph,
    home: torch.device | None = None,
) -> None:
    """Stock's `update` + `delete` (call under the cache lock), reusing the copies.

    The copies enter the cache's own table of offloaded tensors, the one stock uses
    for tensors shared between batches, so `update` finds them there instead of
    copying again and records everything else exactly as it always does. `home`:
    outputs made on a part's own device are recorded as onloading to the home device.
    """
    with OverrideEqMode():
        for tensor, copy in copies:
            IntermediatesCache.offload_values[tensor] = copy
    if home is None:
        cache.update(batch_idx, outputs)
    else:
        offload_outputs(cache, batch_idx, outputs, home)
    cache.delete(batch_idx, subgraph.consumed_names)


@contextlib.contextmanager
def _participant_passes(
    active: list[ParallelCalibrationParticipant],
    maps: list[dict[nn.Module, nn.Module]],
    devices: Sequence[torch.device],
    calibrating: bool,
):
    """Enter each participant's optional `parallel_pass` context for one pass."""
    with contextlib.ExitStack() as stack:
        for participant in active:
            enter = getattr(participant, "parallel_pass", None)
            if enter is not None:
                stack.enter_context(enter(maps, devices, calibrating))
        yield


def _compile(subgraph: Subgraph) -> None:
    """Compile the subgraph's code once, here, before worker threads call it.

    `Subgraph.forward` compiles lazily and unguarded: two threads racing on the first
    call could read the other's half-initialised globals. Same steps as its own.
    """
    if subgraph._code is None:
        code = subgraph.graph.python_code("self")
        exec(code.src, code.globals)
        subgraph._code = code
