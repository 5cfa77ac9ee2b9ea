"""What a model's forward may return besides plain logits."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


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
