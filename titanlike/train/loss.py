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

from titanlike.models.outputs import IGNORE_INDEX, ModelOutput, cross_entropy_sum


LossFn = Callable[[object, torch.Tensor], torch.Tensor]


def build_cross_entropy_loss(*, compile: bool = False, backend: str = "inductor") -> LossFn:
    """loss_fn(output, labels): cross_entropy_sum of the logits plus the output's auxiliary losses.
    compile: torch.compile the cross-entropy with `backend`."""
    ce = torch.compile(cross_entropy_sum, backend=backend) if compile else cross_entropy_sum

    def loss_fn(output, labels: torch.Tensor) -> torch.Tensor:
        if isinstance(output, ModelOutput):
            loss = ce(output.logits, labels)
            for aux in output.aux_losses.values():
                loss = loss + aux
            return loss
        return ce(output, labels)

    return loss_fn


def lookahead_targets(raw_labels: torch.Tensor, labels: torch.Tensor, depth: int,
                      document_ids: torch.Tensor | None = None) -> torch.Tensor:
    """What multi-token prediction reads, (batch, seq, depth, 2) int64, from a microbatch's labels
    over the whole sequence (before any context-parallel cut: later tokens may live on another rank).

    For depth k (1-based) at position i: [..., k-1, 0] is the token t(i+k) the k-th prediction module
    embeds (raw_labels[i+k-1]: the labels before eod_mask_loss, which hides targets but not tokens;
    0 past the window), and [..., k-1, 1] the token it predicts, t(i+k+1) = labels[i+k], or
    IGNORE_INDEX past the window, where labels hides it, and (with document_ids, the documents of the
    input tokens under document masking) where t(i+k) belongs to another document than position i:
    a prediction never reaches into the next packed document.
    """
    batch, seq = labels.shape
    inputs = torch.zeros(batch, seq, depth, dtype=torch.long, device=labels.device)
    targets = torch.full((batch, seq, depth), IGNORE_INDEX, dtype=torch.long, device=labels.device)
    for k in range(1, depth + 1):
        if k - 1 < seq:
            inputs[:, : seq - k + 1, k - 1] = raw_labels[:, k - 1:]
        if k < seq:
            target = labels[:, k:]
            if document_ids is not None:
                target = target.masked_fill(document_ids[:, k:] != document_ids[:, :-k], IGNORE_INDEX)
            targets[:, : seq - k, k - 1] = target
    return torch.stack([inputs, targets], dim=-1)
