"""The home of the models that run beside the one being trained (companions).

An objective declares its companions (objectives/companion.py: a frozen copy of the model as the run
started, the model itself as it is now, or another checkpoint; and what each adds to a microbatch's
targets). Here they are built on this rank with the job's layout (FSDP, TP, CP, their own pipeline
split over the same stages), loaded sharded, and run forward-only on every microbatch before the
step: `Companions.fill(mb)` adds their outputs to `mb.targets` where the loss runs (the last pipeline
stage). The trainer asks for nothing else; the estimator counts their memory from the same
declarations (estimation/layout.py, estimation/probe.py).

Sources:
  - FROZEN_COPY: a second copy of the model, planned and parallelized like it, parameters only (no
    gradients, no optimizer state): its weights are the model's before the first update, or, in a
    resumed run, its initialization and initial load again (the run's start, as the first launch had it).
  - POLICY: the model's own parts, no copy (RL's old policy; with the converters off, DPO's reference
    as the base model without LoRA adapters).
  - CHECKPOINT: another model (a DCP checkpoint or a Hugging Face folder): build_frozen_model.

What reads the policy to generate from it (RL rollouts) takes its weights through PolicyWeights:
the module itself on one process, one gather per update under FSDP or TP.
"""

from __future__ import annotations

import contextlib
import logging
from typing import TYPE_CHECKING, Callable

import torch
import torch.nn as nn

from titanlike.objectives.base import Microbatch
from titanlike.objectives.companion import Companion, Source, Targets

if TYPE_CHECKING:
    from titanlike.train.plan import JobPlan

logger = logging.getLogger("titanlike")


class PolicyWeights:
    """The trained model's current weights as one whole module on every rank, for what reads the policy
    without training it (RL's rollouts through the generation engine, titanlike/inference).

    On one process, and wherever a rank holds whole parameters, it is the trained module itself: no
    copy. Under FSDP or TP (parameters are DTensor shards) it is a plain copy of the model on each rank,
    refreshed by one gather of the weights per update: `module(version)` gathers only when `version`
    (the caller's count of optimizer steps) moved since the last call. `gathered_bytes` counts what the
    gathers brought in (each parameter's full size minus this rank's shard)."""

    def __init__(self, plan: JobPlan, parts: list[nn.Module], device: torch.device, build_converters):
        from torch.distributed.tensor import DTensor

        self.parts, self.device = parts, device
        self.sharded = any(isinstance(p, DTensor) for part in parts for p in part.parameters())
        self._copy: nn.Module | None = None
        self._version: int | None = None
        self.gathers, self.gathered_bytes = 0, 0
        if len(parts) != 1:
            raise ValueError("the policy's weights for generation need every layer on each rank; pipeline "
                             "parallelism splits them over stages")
        if self.sharded:
            from titanlike.models.common.init import canonical_fqn

            with torch.device("meta"):
                model = plan.spec.model_cls(plan.model_args)
            build_converters().convert(model)
            model.to_empty(device=device)
            model.init_weights(seed=plan.cfg.debug.seed)  # buffers (RoPE tables); every weight is gathered
            model.requires_grad_(False)
            model.eval()
            self._copy = model
            own = dict(model.named_parameters())
            self._pairs = [(own[canonical_fqn(name)], p) for name, p in parts[0].named_parameters()]

    @torch.no_grad()
    def module(self, version: int) -> nn.Module:
        """The policy's whole module as of `version`."""
        if not self.sharded:
            return self.parts[0]
        if version != self._version:
            from torch.distributed.tensor import DTensor

            for whole, param in self._pairs:
                if isinstance(param, DTensor):
                    full = param.full_tensor()
                    self.gathered_bytes += (full.numel() - param.to_local().numel()) * full.element_size()
                else:
                    full = param
                whole.copy_(full)
            self.gathers += 1
            self._version = version
        return self._copy


class ForwardOnly:
    """Forward passes without gradients of model parts as the training step runs its own (autocast,
    loss parallelism, the pipeline schedule: a forward-only schedule of their own per set of parts),
    returning fn(output, targets) of a microbatch, its samples concatenated along the batch, on the
    ranks that hold the last pipeline stage, and None on the others (where no loss runs)."""

    def __init__(self, step, plan: JobPlan, pp_mesh, device: torch.device):
        self.step, self.plan, self.pp_mesh, self.device = step, plan, pp_mesh, device
        self._schedules: dict[int, tuple] = {}  # id(parts) -> (runner, kept outputs)

    @torch.no_grad()
    def __call__(self, parts: list[nn.Module], mb: Microbatch, fn: Callable[[object, Targets], Targets]
                 ) -> Targets | None:
        step = self.step
        loss_context = torch.distributed.tensor.parallel.loss_parallel() if step.loss_parallel \
            else contextlib.nullcontext()
        if self.plan.pipeline is None:
            with step.autocast, loss_context:
                return fn(parts[0](mb.inputs, **mb.forward_kwargs()), mb.targets)
        runner, kept = self._runner(parts, fn)
        kept.clear()
        with step.autocast, loss_context:
            runner.step(mb, step.pipeline_microbatch_size, backward=False)
        if not runner.has_last:
            return None
        return {name: torch.cat([out[name] for out in kept]) for name in kept[0]}

    def _runner(self, parts: list[nn.Module], fn):
        from titanlike.parallel.pipeline import build_schedule

        if id(parts) not in self._schedules:
            kept: list[Targets] = []
            zero = torch.zeros((), device=self.device)

            def keep(output, targets: Targets) -> torch.Tensor:
                # The schedule's "loss": the companion's outputs of this pipeline microbatch, in order.
                kept.append(fn(output, targets))
                return zero

            runner = build_schedule(parts, self.plan.pipeline, self.pp_mesh, self.device,
                                    schedule=self.plan.cfg.parallelism.pipeline_parallel_schedule,
                                    n_microbatches=self.plan.batch.pipeline_microbatches, loss_fn=keep)
            self._schedules[id(parts)] = runner, kept
        return self._schedules[id(parts)]


class Companions:
    """This rank's companions of a job, built; `fill` runs them on a microbatch."""

    def __init__(self, companions: tuple[Companion, ...], parts: list[list[nn.Module]], forward: ForwardOnly,
                 disabled: Callable[[list[nn.Module]], contextlib.AbstractContextManager]):
        """parts: each companion's model parts; disabled(parts): the converters switched off on them."""
        self.companions, self.parts, self.forward, self.disabled = companions, parts, forward, disabled

    def __bool__(self) -> bool:
        return bool(self.companions)

    def fill(self, mb: Microbatch) -> Microbatch:
        """Add every companion's outputs to the microbatch's targets (where the loss runs)."""
        for companion, parts in zip(self.companions, self.parts):
            modes = [part.training for part in parts]
            for part in parts:
                part.eval()
            try:
                with self.disabled(parts) if companion.converters_off else contextlib.nullcontext():
                    out = self.forward(parts, mb, companion.outputs)
            finally:
                for part, mode in zip(parts, modes):
                    part.train(mode)
            if out is not None:
                mb.targets.update(out)
        return mb


def frozen_copy(plan: JobPlan, source: list[nn.Module], device: torch.device, *, resumed: bool,
                load_start: Callable[[list[nn.Module]], None], build_converters) -> list[nn.Module]:
    """A frozen copy of the model being trained, planned and parallelized like it: the source's weights
    (a fresh run, before its first update), or (resumed) its initialization and the run's initial load
    again (load_start). build_converters(): the job's converters, new."""
    from titanlike.train.model_parts import build_model_parts

    seed = plan.cfg.debug.seed
    converters = build_converters()
    parts = build_model_parts(plan, converters)
    for part, own in zip(parts, source):
        part.to_empty(device=device)
        if resumed:
            part.init_weights(seed=seed)
            converters.init_weights(part, seed)
        else:
            with torch.no_grad():
                state = dict(own.named_parameters()) | dict(own.named_buffers())
                for name, tensor in [*part.named_parameters(), *part.named_buffers()]:
                    tensor.copy_(state[name])
    if resumed:
        load_start(parts)
    for part in parts:
        part.requires_grad_(False)
        part.eval()
    return parts


def build_companions(companions: tuple[Companion, ...], plan: JobPlan, policy: list[nn.Module], *,
                     forward: ForwardOnly, device: torch.device, resumed: bool,
                     load_start: Callable[[list[nn.Module]], None], build_converters, converters,
                     log: bool) -> Companions:
    """Build each companion's parts on this rank (module docstring). load_start(parts): the run's
    initial load into a fresh copy (its converters' state included); build_converters(): new converters
    of the job; converters: the policy's (their `disabled`)."""
    from titanlike.train.model_parts import build_frozen_model

    built = []
    for companion in companions:
        if companion.source is Source.POLICY:
            parts = policy
        elif companion.source is Source.FROZEN_COPY:
            parts = frozen_copy(plan, policy, device, resumed=resumed, load_start=load_start,
                                build_converters=build_converters)
        else:
            parts = build_frozen_model(plan, companion.path, device, seed=plan.cfg.debug.seed)
        built.append(parts)
        if log:
            rebuilt = " (rebuilt from its initialization and initial load)" if (
                resumed and companion.source is Source.FROZEN_COPY) else ""
            logger.info(f"{plan.objective.name} companion {companion.describe()}, sharded like the model{rebuilt}")
    return Companions(companions, built, forward, converters.disabled)


__all__ = ["Companions", "ForwardOnly", "PolicyWeights", "build_companions", "frozen_copy"]
