"""The training step: one optimizer update over a global batch, a function of its microbatches.

`TrainStep(microbatches)` runs forward and backward of every microbatch (through the pipeline
schedule under pipeline parallelism), divides the gradients once by the global count of target
tokens, clips them, and steps the optimizer. It returns device tensors (`StepOutput`) and reads
nothing back to the host: the loop decides when to look (titanlike/train/trainer.py).

Exact arithmetic: the loss is a sum over target tokens, and the gradients are divided once, after
every backward, by the target tokens of the whole global batch (an objective may count other units:
preference pairs: Microbatch.units). That keeps gradient accumulation,
data parallelism and pipeline microbatches exact, and lets a term join the objective anywhere in
the model in the same summed units (an MoE layer's balancing losses, on any pipeline stage).

The step's one collective of its own, at its start: a sum over all ranks of [target tokens, side
values]. The token count divides the gradients; the side values are whatever the caller needs
agreed by every rank at no extra collective (the loop's stop signals). A value replicated over
tensor-parallel ranks or pipeline stages is contributed by the first of them only, so one sum over
the world counts it once.

Non-finite steps are skipped on the device. The gradient norm is global (reduced over every mesh a
gradient lives on and over the pipeline stages), and a non-finite loss anywhere makes non-finite
gradients, so `finite` is the same on every rank with no extra collective. The fused AdamW kernels
take it as their `found_inf` flag (torch's mechanism for gradient scalers): on a non-finite step
they leave parameters, moments and step counts as they were, without the host knowing. torch's
foreach and for-loop kernels have no such flag; with those (optimizer.implementation) the step
reads the flag on the host before updating, one synchronization per step. The fused kernels also
take the step's one multiplication of the gradients (the division by the token count times the
clipping coefficient), as the `grad_scale` they divide each gradient by as they read it (its
reciprocal): one pass over every gradient fewer (3.3 ms of an 85 ms Llama 3.2 1B step on an H200).

float16 loss scaling (train/loss_scaling.py): backward differentiates scale / global_tokens x the
summed loss, and the one multiplication unscaling the gradients replaces the division by the
token count. The weight is a device tensor the step rewrites in place, given explicitly to the
loss it backpropagates and, once at build time, to every module that attaches a loss
(models/outputs.py attach_loss).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from titanlike.models import protocol
from titanlike.models.outputs import LossReports, weighted_objective
from titanlike.objectives.base import BatchContext, LossTerms, Objective
from titanlike.parallel.utils import clip_grad_norm_, first_rank_of, sum_over_world


def local_value(loss: torch.Tensor) -> torch.Tensor:
    """A loss as a plain detached tensor (under loss parallel it is a DTensor replicated over tp)."""
    loss = loss.detach()
    return loss.full_tensor() if isinstance(loss, DTensor) else loss


class StepLoss:
    """What the step differentiates for one microbatch's output: the objective's summed loss
    (LossTerms.value), carrying the objective weight for backward. The pipeline schedule calls it on
    the last stage with the microbatch's named targets. The objective's loss is a pure function: the
    terms it reports apart (and, in validation, its correct counts) are summed here until `collect`.

    objective: the job's Objective; ctx: the BatchContext its microbatches were prepared with;
    weight: the objective weight (loss scaling) or None; loss_fn: objective.loss, or a function of
    the same arguments wrapping it (the estimator's, which marks where backward starts)."""

    def __init__(self, objective: Objective, ctx: BatchContext, weight: torch.Tensor | None, *,
                 loss_fn: Callable[..., LossTerms] | None = None):
        self.objective, self.ctx, self.weight = objective, ctx, weight
        self.loss_fn = loss_fn or objective.loss
        self.count_correct = False  # validation sets it: LossTerms.correct are summed into `correct`
        self.recording = True
        self.reported: torch.Tensor | None = None
        self.correct: torch.Tensor | None = None

    def __call__(self, output, targets: dict[str, torch.Tensor]) -> torch.Tensor:
        terms = self.loss_fn(output, targets, self.ctx, correct=self.count_correct)
        if self.recording:
            if terms.reported is not None:
                self.reported = terms.reported if self.reported is None else self.reported + terms.reported
            if terms.correct is not None:
                self.correct = terms.correct if self.correct is None else self.correct + terms.correct
        return weighted_objective(terms.value, self.weight)

    def unrecorded(self, output, targets: dict[str, torch.Tensor]) -> torch.Tensor:
        """The same loss, recording nothing: for a pipeline schedule's metadata inference, which runs
        it on placeholder outputs."""
        recording, self.recording = self.recording, False
        try:
            return self(output, targets)
        finally:
            self.recording = recording

    def collect(self, device: torch.device) -> torch.Tensor | None:
        """(len(reported_terms),) the reported terms' sums since the last call, then zeroed; None when
        the objective reports none. Device work only."""
        if not self.objective.reported_terms:
            return None
        reported, self.reported = self.reported, None
        return torch.zeros(len(self.objective.reported_terms), device=device) if reported is None else reported

    @contextlib.contextmanager
    def counting_correct(self):
        """Validation: the loss also counts correct units (yielded getter of their sum); the reported
        terms it sums meanwhile are dropped (those are the training steps')."""
        reported, self.count_correct, self.correct = self.reported, True, None
        try:
            yield lambda: self.correct
        finally:
            self.count_correct, self.reported, self.correct = False, reported, None


@dataclass
class StepOutput:
    """One step, on the device. loss_sum is this rank's share of the summed loss, already counted
    once per tensor-parallel group (0 on ranks without the last pipeline stage), so a sum over all
    ranks gives the global summed loss; tokens is the global target count (every rank); grad_norm the
    global norm before clipping; finite whether the update was applied; side the summed side values;
    reported this rank's share of the model's reported loss terms (LossReports), counted like
    loss_sum; expert_table the MoE bookkeeping (train/expert_balance.py), or None."""

    loss_sum: torch.Tensor
    tokens: torch.Tensor
    grad_norm: torch.Tensor
    finite: torch.Tensor
    side: torch.Tensor
    reported: torch.Tensor | None
    expert_table: torch.Tensor | None
    nonfinite_param: Callable[[], str | None]  # this rank's first non-finite gradient's name (reads the device)
    # QK-clip's largest attention logit of each layer this rank clips (train/qk_clip.py), or None.
    max_logits: torch.Tensor | None = None


class TrainStep:
    """See the module docstring. Built once by the trainer from its parts; called once per step."""

    def __init__(self, *, model_parts: list[nn.Module], step_loss: StepLoss, optimizer: torch.optim.Optimizer,
                 device: torch.device, max_norm: float, pipeline=None, pipeline_microbatch_size: int = 1,
                 tp_mesh=None, pp_mesh=None, autocast=contextlib.nullcontext(), loss_parallel: bool = False,
                 tied=None, converters=None, expert_balance=None, reported_losses: tuple[str, ...] = (),
                 loss_scaler=None, qk_clip=None):
        self.model_parts, self.step_loss, self.optimizer = model_parts, step_loss, optimizer
        self.device, self.max_norm = device, max_norm
        self.pipeline, self.pipeline_microbatch_size = pipeline, pipeline_microbatch_size
        self.pp_mesh, self.autocast, self.loss_parallel = pp_mesh, autocast, loss_parallel
        self.tied, self.converters, self.expert_balance = tied, converters, expert_balance
        self.loss_scaler, self.qk_clip = loss_scaler, qk_clip
        self.named_params = [(name, p) for part in model_parts for name, p in part.named_parameters()]
        self.params = [p for _, p in self.named_params]
        # Counted once over the world sum: tokens are seen by every tp rank and pipeline stage, the
        # loss (and reported terms) by every tp rank of the last stage.
        self.token_share = float(first_rank_of(tp_mesh, pp_mesh))
        self.loss_share = float(first_rank_of(tp_mesh))
        self.reports = LossReports(model_parts, reported_losses, device) if reported_losses else None
        # fused AdamW skips a step itself on found_inf (see the module docstring).
        self.device_skips = bool(optimizer.defaults.get("fused"))
        local = [p.to_local() if isinstance(p, DTensor) else p for p in self.params]
        self.optimizer_device = local[0].device if local else device
        if step_loss.weight is not None:
            for part in model_parts:
                for module in protocol.loss_attaching_modules(part):
                    protocol.set_loss_weight(module, step_loss.weight)

    @classmethod
    def for_plan(cls, plan, dims, *, model_parts: list[nn.Module], step_loss: StepLoss,
                 optimizer: torch.optim.Optimizer, device: torch.device, **pieces) -> TrainStep:
        """The step a JobPlan runs, the trainer's and the estimator's (on fake tensors) alike: clipping,
        the precision's autocast, the meshes, loss parallelism and the reported loss terms come from the
        plan and dims (its ParallelDims, meshes built); the pieces built beside it (pipeline schedule,
        tied-weight sync, converters, expert balance, loss scaler) are passed as given."""
        half = plan.precision.autocast_dtype
        return cls(model_parts=model_parts, step_loss=step_loss, optimizer=optimizer, device=device,
                   max_norm=plan.cfg.training.max_norm,
                   pipeline_microbatch_size=plan.cfg.parallelism.pipeline_parallel_microbatch_size,
                   tp_mesh=dims.mesh("tp"), pp_mesh=dims.mesh("pp"),
                   autocast=torch.autocast(device.type, dtype=half) if half is not None else contextlib.nullcontext(),
                   loss_parallel=dims.tp_enabled and plan.parallelize.loss_parallel,
                   reported_losses=plan.model_args.reported_losses(), **pieces)

    def __call__(self, microbatches: list, side: list[float] = ()) -> StepOutput:
        global_tokens, agreed = self.count_tokens(microbatches, side)
        loss_sum = torch.zeros((), device=self.device)
        for mb in microbatches:
            loss_sum += self.forward_backward(mb)
        return self.update(loss_sum, global_tokens, agreed)

    def count_tokens(self, microbatches: list, side: list[float] = ()) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's collective: (global target tokens, the side values summed over all ranks). Under
        loss scaling it also sets the objective weight backward will use."""
        tokens = sum(mb.units for mb in microbatches).float()
        values = torch.zeros(1 + len(side), device=self.device)
        values[0] = tokens * self.token_share
        for i, value in enumerate(side):
            values[1 + i].fill_(value)  # a kernel argument, not a host-to-device copy
        agreed = sum_over_world(values)
        if self.loss_scaler is not None:
            self.step_loss.weight.copy_(self.loss_scaler.scale / agreed[0])
        return agreed[0], agreed[1:]

    def update(self, loss_sum: torch.Tensor, global_tokens: torch.Tensor, side: torch.Tensor) -> StepOutput:
        """After every backward: divide the gradients by the global token count (or unscale them) and
        clip them, in one pass, and step the optimizer unless something is non-finite."""
        if self.tied is not None:
            self.tied.sync_gradients()
        norm = clip_grad_norm_(self.params, self.max_norm, pp_mesh=self.pp_mesh,
                               exclude=frozenset(self.tied.duplicates) if self.tied else frozenset(),
                               prescale=1.0 / self.loss_scaler.scale if self.loss_scaler is not None
                               else 1.0 / global_tokens, scale=not self.device_skips)
        finite = norm.total.isfinite()
        if self.device_skips:
            self.optimizer.found_inf = (~finite).float().to(self.optimizer_device)
            self.optimizer.grad_scale = (1.0 / norm.factor).to(self.optimizer_device)
            self.optimizer.step()
        elif bool(finite):  # torch's foreach / for-loop kernels: the host decides
            self.optimizer.step()
        # After the update, from the maxima of this step's forwards (nothing is scaled on a skipped step).
        max_logits = self.qk_clip.apply(finite) if self.qk_clip is not None else None
        if self.converters is not None:
            self.converters.post_optimizer_step(self.model_parts)
        self.optimizer.zero_grad(set_to_none=True)
        table = self.expert_balance.step_done(applied=finite) if self.expert_balance is not None else None
        reported = self.reports.collect() if self.reports is not None else None
        mine = self.step_loss.collect(self.device)  # the objective's terms, after the model's
        if mine is not None:
            reported = mine if reported is None else torch.cat([reported, mine])
        reported = reported * self.loss_share if reported is not None else None
        return StepOutput(loss_sum * self.loss_share, global_tokens, norm.total, finite, side, reported,
                          table, lambda: self._param_name(norm.nonfinite_param()), max_logits)

    def forward_backward(self, mb, *, backward: bool = True) -> torch.Tensor:
        """The summed loss of one loader microbatch (0 where this rank holds no last pipeline stage),
        with its backward unless backward=False."""
        loss_context = torch.distributed.tensor.parallel.loss_parallel() if self.loss_parallel \
            else contextlib.nullcontext()
        if self.pipeline is not None:
            # The schedule cuts the batch into pipeline microbatches; every stage gets their fields.
            with self.autocast, loss_context:
                losses = self.pipeline.step(mb, self.pipeline_microbatch_size, backward=backward)
            return sum((local_value(loss) for loss in losses), torch.zeros((), device=self.device))
        with self.autocast:
            output = self.model_parts[0](mb.inputs, **mb.forward_kwargs())
        with loss_context:
            loss = self.step_loss(output, mb.targets)
            if backward:
                loss.backward()
        return local_value(loss)

    def _param_name(self, index: int | None) -> str | None:
        return None if index is None else self.named_params[index][0]


__all__ = ["StepLoss", "StepOutput", "TrainStep", "local_value"]
