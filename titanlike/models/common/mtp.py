"""Multi-token prediction (DeepSeek-V3, section 2.2): D sequential modules after the trunk, the k-th
predicting the token k+1 places past the next one.

Module k takes, at every position i, the hidden state the previous depth produced there (the
trunk's residual stream for k = 1) and the embedding of token t(i+k), each RMS-normalized,
concatenated and projected back to the model width (eh_proj), then runs one transformer block;
its own final norm and the model's shared output head give logits for t(i+k+1). The chain keeps
the causal order: position i never sees a token past i+k, and within a packed document only
(`lookahead_targets` in titanlike/objectives/causal_lm.py ignores targets across documents).

The modules are entries of `model.layers` after the trunk (keys n_layers .. n_layers+D-1, as
DeepSeek's checkpoints number them), so tensor, expert and data parallelism, activation
checkpointing and compile treat them as blocks, and pipeline splitting puts them on the last
stage with the output head. Their loss, (weight / D) x the sum over depths of the cross-entropy
summed over targets, joins the objective through `attach_loss` on the trunk's output: the loss function,
the pipeline schedule and the trainer stay those of every family. Its unweighted mean over depths
is logged as "mtp_loss" (per target token, comparable to the loss). Evaluation skips the modules.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn as nn

from titanlike.models.common.block import TransformerBlock
from titanlike.models.common.norms import init_norm
from titanlike.models.outputs import attach_loss, cross_entropy_sum

MTP_LOSS = "mtp_loss"


class MTPBlock(TransformerBlock):
    """One prediction depth: enorm, hnorm and eh_proj in front of a transformer block, head_norm after
    it (DeepSeek's names, `shared_head.norm` for head_norm). forward returns (the hidden state the
    next depth reads, its head-normalized copy for the output head)."""

    reported_loss = MTP_LOSS

    def __init__(self, layer_id: int, *, dim: int, build_norm: Callable[[], nn.Module], **block):
        super().__init__(layer_id, **block)
        self.enorm = build_norm()
        self.hnorm = build_norm()
        self.eh_proj = nn.Linear(2 * dim, dim, bias=False)
        self.head_norm = build_norm()
        # This depth's cross-entropy, summed over targets, over this step's training forwards.
        self.register_buffer("reported_loss_sum", torch.zeros((), dtype=torch.float32), persistent=False)
        self.record_statistics = True  # off while a pipeline infers shapes on placeholder inputs

    def forward(self, h: torch.Tensor, rope: torch.Tensor | None, mask=None,
                embedded: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.eh_proj(torch.cat([self.enorm(embedded), self.hnorm(h)], dim=-1))
        out = super().forward(x, rope, mask)
        return out, self.head_norm(out)

    def init_weights(self, *, seed: int, prefix: str) -> None:
        super().init_weights(seed=seed, prefix=prefix)
        self.reported_loss_sum.zero_()  # after to_empty it holds whatever the memory held
        for norm in (self.enorm, self.hnorm, self.head_norm):
            init_norm(norm)
        self.init.fill(self.eh_proj.weight, seed=seed, fqn=f"{prefix}eh_proj.weight")


def multi_token_prediction(h: torch.Tensor, blocks: list[MTPBlock], lookahead: torch.Tensor,
                           *, embed: nn.Module, head: nn.Module, rope: torch.Tensor | None, mask,
                           weight: float, training: bool, loss_weight: torch.Tensor | None = None) -> torch.Tensor:
    """h, the trunk's residual stream (batch, seq, dim) before the final norm, carrying the
    prediction modules' weighted loss (attach_loss; the caller then computes the logits from it, so
    a model's output is never the attaching view, which FSDP's output hooks warn about).
    lookahead: (batch, seq, D, 2) embedded tokens and targets per depth (objectives/causal_lm.py
    lookahead_targets); embed / head: the model's token embedding (a tied copy on the last pipeline
    stage) and output projection; loss_weight: the calling model's `loss_weight` hook (the step's
    objective weight)."""
    depth = len(blocks)
    total = None
    x = h
    for k, block in enumerate(blocks):
        x, normed = block(x, rope, mask, embedded=embed(lookahead[..., k, 0]))
        ce = _cross_entropy_sum(head(normed), lookahead[..., k, 1])
        if training and torch.is_grad_enabled() and block.record_statistics:
            # add_, not +=: the block may be wrapped (activation checkpointing), and += would
            # re-bind the name on the wrapper.
            block.reported_loss_sum.add_(ce.detach().float() / depth)
        total = ce if total is None else total + ce
    return attach_loss(h, total * (weight / depth), loss_weight)


def _cross_entropy_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    if not isinstance(logits, DTensor):
        return cross_entropy_sum(logits, targets)
    # Vocabulary-parallel logits (TP with loss parallel): the sharded cross-entropy, as the trainer's
    # own loss (whose context also covers this term's backward). A plain tensor leaves, so that
    # attach_loss sees the same kind of value with and without TP.
    with _loss_parallel():
        loss = cross_entropy_sum(logits, targets)
    return loss.to_local() if isinstance(loss, DTensor) else loss


def _loss_parallel():
    """torch's loss_parallel(), unless it is already on. It is not re-entrant: leaving a nested one
    switches the ops off for the caller too, and pipeline schedules run the forward (this loss)
    inside the trainer's own loss-parallel context."""
    import contextlib

    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import loss as tp_loss

    ops = getattr(tp_loss, "customized_loss_ops", None)
    handlers = DTensor._op_dispatcher._custom_op_handlers
    if ops and all(op in handlers for op in ops):
        return contextlib.nullcontext()
    return tp_loss.loss_parallel()


__all__ = ["MTP_LOSS", "MTPBlock", "multi_token_prediction"]
