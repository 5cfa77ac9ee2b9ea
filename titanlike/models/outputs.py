"""What a model's forward may return besides plain logits, and losses it adds to the objective itself."""

from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

from titanlike.models import protocol

# Labels equal to this are not targets (the value torch's cross-entropy ignores by default).
IGNORE_INDEX = -100


def cross_entropy_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Next-token (or masked-token) cross-entropy of (batch, seq, vocab) logits, summed over the
    targets: the unit of the training loss and of every term a model adds to it."""
    return F.cross_entropy(
        logits.flatten(0, 1).float(), labels.flatten(0, 1), reduction="sum", ignore_index=IGNORE_INDEX
    )


@dataclass
class ModelOutput:
    """Logits and auxiliary losses (MoE router balancing, multi-token prediction, ...).

    Auxiliary losses are in the training loss's units, a sum over the microbatch's target tokens
    (the trainer divides the total by the step's global token count), so that gradient
    accumulation, data parallelism and pipeline microbatches leave them exact. The loss builder
    adds them to the main loss; the trainer never looks inside.
    """

    logits: torch.Tensor
    aux_losses: dict[str, torch.Tensor] = field(default_factory=dict)


def logits_of(output: torch.Tensor | ModelOutput) -> torch.Tensor:
    return output.logits if isinstance(output, ModelOutput) else output


# The weight backward gives the objective: 1, except under loss scaling (train/loss_scaling.py),
# where the trainer differentiates scale / tokens x the summed loss. Terms attached deep inside a
# model (attach_loss) must get the same weight as the loss the trainer backpropagates, and passing
# it down through every family's forward would change the model contract; so it reaches them the
# way autocast's dtype does, as a context the trainer sets around its forwards. attach_loss reads it
# in forward, so a backward run later (a pipeline schedule, activation-checkpoint recomputation)
# uses the weight of the forward it belongs to.
_OBJECTIVE_WEIGHT: contextvars.ContextVar[float] = contextvars.ContextVar("objective_weight", default=1.0)


@contextlib.contextmanager
def objective_weight(weight: float):
    """Inside the block the objective is differentiated with `weight`: the loss wrapped in
    `weighted_objective` and every term the block's forwards attach (`attach_loss`)."""
    token = _OBJECTIVE_WEIGHT.set(float(weight))
    try:
        yield
    finally:
        _OBJECTIVE_WEIGHT.reset(token)


class _AttachLoss(torch.autograd.Function):
    """Identity on x whose backward also gives `loss` the gradient `weight`."""

    @staticmethod
    def forward(ctx, x, loss, weight):
        ctx.loss_shape, ctx.weight = loss.shape, weight
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad, torch.full(ctx.loss_shape, ctx.weight, dtype=torch.float32, device=grad.device), None


def attach_loss(x: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:
    """x, carrying `loss` (in the training loss's summed units) into the objective: whatever
    backward reaches x also differentiates `loss` with the objective's weight (1, or the loss
    scale's under `objective_weight`). A term computed deep inside a model (a balancing loss, a
    multi-token-prediction loss on the last pipeline stage) joins the objective this way without
    changing what forward returns, which keeps the pipeline schedule and the loss function the same
    for every family."""
    return _AttachLoss.apply(x, loss, _OBJECTIVE_WEIGHT.get())


class _WeighGradient(torch.autograd.Function):
    """Identity whose backward multiplies the incoming gradient by `weight`."""

    @staticmethod
    def forward(ctx, loss, weight):
        ctx.weight = weight
        return loss.view_as(loss)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.weight, None


def weighted_objective(loss: torch.Tensor) -> torch.Tensor:
    """loss, unchanged in value, whose backward carries the objective's weight (`objective_weight`):
    the loss the trainer backpropagates, scaled for backward while still reporting the unscaled value
    (a pipeline schedule returns what it differentiates)."""
    weight = _OBJECTIVE_WEIGHT.get()
    return loss if weight == 1.0 else _WeighGradient.apply(loss, weight)


# Loss terms reported apart. A module that adds a term to the objective (attach_loss) and wants it
# logged declares `reported_loss = "<name>"` (a name listed by its args' reported_losses()) and
# keeps a float32 scalar buffer `reported_loss_sum`, to which its training forwards add the term's
# value in summed units; the trainer reads and zeroes it once per step. Eval forwards, a pipeline's
# shape inference (record_statistics off) and activation-checkpoint recomputation do not add.


def reported_loss_sums(parts: list[nn.Module], names: tuple[str, ...], device: torch.device) -> torch.Tensor:
    """(len(names),) this rank's sums since the last call, per name; the buffers are zeroed."""
    sums = torch.zeros(len(names), device=device)
    for part in parts:
        for module in part.modules():
            name = protocol.reported_loss(module)
            if name is not None:
                sums[names.index(name)] += protocol.reported_loss_sum(module).to(device)
                protocol.reported_loss_sum(module).zero_()
    return sums
