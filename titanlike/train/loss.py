"""The default objective: cross-entropy summed over target tokens, plus any auxiliary losses.

The trainer divides by the global count of target tokens of the whole step (all microbatches,
all data-parallel ranks), so gradient accumulation and the data-parallel degree leave the math
unchanged. Labels equal to IGNORE_INDEX are not targets. What the labels are is the data's
business: shifted next tokens for causal LMs, masked positions for MLM; the loss is the same.

A family with another objective sets ModelSpec.build_loss; the trainer and the pipeline loss
only ever call loss_fn(model_output, labels).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from titanlike.models.outputs import ModelOutput

IGNORE_INDEX = -100

LossFn = Callable[[object, torch.Tensor], torch.Tensor]


def cross_entropy_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(
        logits.flatten(0, 1).float(), labels.flatten(0, 1), reduction="sum", ignore_index=IGNORE_INDEX
    )


def build_cross_entropy_loss(*, compile: bool = False) -> LossFn:
    """loss_fn(output, labels): cross_entropy_sum of the logits plus the output's auxiliary losses."""
    ce = torch.compile(cross_entropy_sum) if compile else cross_entropy_sum

    def loss_fn(output, labels: torch.Tensor) -> torch.Tensor:
        if isinstance(output, ModelOutput):
            loss = ce(output.logits, labels)
            for aux in output.aux_losses.values():
                loss = loss + aux
            return loss
        return ce(output, labels)

    return loss_fn
