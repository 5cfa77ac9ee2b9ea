"""What a model's forward may return besides plain logits, and losses it adds to the objective itself."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

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


class _AttachLoss(torch.autograd.Function):
    """Identity on x whose backward also gives `loss` the gradient 1."""

    @staticmethod
    def forward(ctx, x, loss):
        ctx.loss_shape = loss.shape
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad, torch.ones(ctx.loss_shape, dtype=torch.float32, device=grad.device)


def attach_loss(x: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:
    """x, carrying `loss` (in the training loss's summed units) into the objective: whatever
    backward reaches x also differentiates `loss` with weight 1. A term computed deep inside a model
    (a balancing loss, a multi-token-prediction loss on the last pipeline stage) joins the
    objective this way without changing what forward returns, which keeps the pipeline schedule
    and the loss function the same for every family."""
    return _AttachLoss.apply(x, loss)


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
            name = getattr(module, "reported_loss", None)
            if name is not None:
                sums[names.index(name)] += module.reported_loss_sum.to(device)
                module.reported_loss_sum.zero_()
    return sums
