"""What a model's forward may return besides plain logits, and losses it adds to the objective itself."""

from __future__ import annotations

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
# where the step differentiates scale / tokens x the summed loss. It is a 0-d device tensor the
# training step owns and rewrites in place every step (no host value, so no host read), handed
# explicitly: to the loss the step backpropagates (weighted_objective) and, once at build time, to
# every module that attaches a loss deep inside the model (its `loss_weight` hook,
# models/protocol.py). None means 1.


class _AttachLoss(torch.autograd.Function):
    """Identity on x whose backward also gives `loss` the gradient `weight` (1 when None)."""

    @staticmethod
    def forward(ctx, x, loss, weight):
        ctx.loss_shape, ctx.weight = loss.shape, weight
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        if ctx.weight is None:
            loss_grad = torch.ones(ctx.loss_shape, dtype=torch.float32, device=grad.device)
        else:
            loss_grad = ctx.weight.detach().to(device=grad.device, dtype=torch.float32).expand(ctx.loss_shape).clone()
        return grad, loss_grad, None


def attach_loss(x: torch.Tensor, loss: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
    """x, carrying `loss` (in the training loss's summed units) into the objective: whatever
    backward reaches x also differentiates `loss` with `weight` (the calling module's `loss_weight`
    hook: the step's objective weight, or None for 1). A term computed deep inside a model (a
    balancing loss, a multi-token-prediction loss on the last pipeline stage) joins the objective
    this way without changing what forward returns, which keeps the pipeline schedule and the loss
    function the same for every family. The weight is read in backward, which happens within the
    step that wrote it (pipeline schedules and activation-checkpoint recomputation included)."""
    return _AttachLoss.apply(x, loss, weight)


class _WeighGradient(torch.autograd.Function):
    """Identity whose backward multiplies the incoming gradient by `weight`."""

    @staticmethod
    def forward(ctx, loss, weight):
        ctx.weight = weight
        return loss.view_as(loss)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.weight.detach().to(grad.dtype), None


def weighted_objective(loss: torch.Tensor, weight: torch.Tensor | None) -> torch.Tensor:
    """loss, unchanged in value, whose backward carries the objective's `weight` (None: 1): the loss
    the step backpropagates, scaled for backward while still reporting the unscaled value (a
    pipeline schedule returns what it differentiates)."""
    return loss if weight is None else _WeighGradient.apply(loss, weight)


# Loss terms reported apart. A module that adds a term to the objective (attach_loss) and wants it
# logged declares `reported_loss = "<name>"` (a name listed by its args' reported_losses()) and
# keeps a float32 scalar buffer `reported_loss_sum`, to which its training forwards add the term's
# value in summed units; the step collects and zeroes it once per step (LossReports). Eval forwards, a pipeline's
# shape inference (record_statistics off) and activation-checkpoint recomputation do not add.


class LossReports:
    """The modules whose loss terms are reported apart, found once at build time (not per step)."""

    def __init__(self, parts: list[nn.Module], names: tuple[str, ...], device: torch.device):
        self.names = names
        self.device = device
        self.modules = [(names.index(protocol.reported_loss(m)), m) for part in parts for m in part.modules()
                        if protocol.reported_loss(m) is not None]

    def collect(self) -> torch.Tensor:
        """(len(names),) this rank's sums since the last call, per name; the buffers are zeroed.
        Device work only: nothing is read back to the host."""
        sums = torch.zeros(len(self.names), device=self.device)
        for index, module in self.modules:
            total = protocol.reported_loss_sum(module)
            sums[index] += total.to(self.device)
            total.zero_()
        return sums
