"""Next-token prediction on packed token windows: the objective of every decoder (GPT, Llama, ...).

Samples are windows of seq_len + 1 tokens of the dataset kind's packed documents (inputs =
window[:-1], labels = window[1:]). Its options are the [training] section's document_masking
(attend within documents, positions restart at each) and eod_mask_loss (no target after an end of
document); a model that predicts several tokens ahead (args.lookahead_tokens > 0) also gets the
lookahead targets of multi-token prediction.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from titanlike.models.common.attention import DocumentMask
from titanlike.models.outputs import IGNORE_INDEX
from titanlike.objectives.base import (BatchContext, FieldShapes, Microbatch, Objective, compile_options,
                                       cut_sequence, target_count)
from titanlike.objectives.registry import register_family_objective

if TYPE_CHECKING:
    from titanlike.config.schema import JobConfig
    from titanlike.models.args import BaseModelArgs


class CausalLM(Objective):
    name = "causal_lm"
    generation = "text"

    def __init__(self, *, document_masking: bool = False, eod_mask_loss: bool = False, **loss_options):
        super().__init__(**loss_options)
        self.document_masking = document_masking
        self.eod_mask_loss = eod_mask_loss
        self.attention_mask = "a document mask" if document_masking else None

    @classmethod
    def for_job(cls, cfg: JobConfig, args: BaseModelArgs) -> CausalLM:
        t = cfg.training
        return cls(document_masking=t.document_masking, eod_mask_loss=t.eod_mask_loss, **compile_options(cfg))

    def sample_fields(self, seq_len: int) -> FieldShapes:
        tokens = ((seq_len,), "int64")
        return {"inputs": tokens, "labels": tokens}

    def samples(self, dataset: str, **source_args):
        from titanlike.data.loader import window_samples

        return window_samples(dataset, **source_args)

    def prepare(self, batch: dict[str, torch.Tensor], ctx: BatchContext) -> Microbatch:
        inputs, labels = batch["inputs"].to(ctx.device), batch["labels"].to(ctx.device)
        raw_labels = labels
        if self.eod_mask_loss:
            labels = labels.masked_fill(inputs == ctx.eos_id, IGNORE_INDEX)
        mb = Microbatch(inputs, {"labels": labels}, target_count(labels), positions=ctx.cp_positions)
        if self.document_masking:
            mb.mask = DocumentMask.from_tokens(inputs, ctx.eos_id, ctx.mask_kernel)
            mb.positions = mb.mask.positions
        if ctx.lookahead_tokens:
            mb.lookahead = lookahead_targets(raw_labels, labels, ctx.lookahead_tokens,
                                             mb.mask.document_ids if mb.mask is not None else None)
        if ctx.cp_positions is not None:
            # Every cp rank of a data-parallel group got the same samples; each keeps its slice
            # before counting, so the token count summed over the loss mesh (which includes cp) is exact.
            labels = cut_sequence(labels, ctx)
            mb.inputs, mb.targets, mb.units = cut_sequence(inputs, ctx), {"labels": labels}, target_count(labels)
            if self.document_masking:
                mb.positions = cut_sequence(mb.positions, ctx)
            if mb.lookahead is not None:
                mb.lookahead = cut_sequence(mb.lookahead, ctx)
        return mb


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


register_family_objective(CausalLM.name, CausalLM.for_job)

__all__ = ["CausalLM", "lookahead_targets"]
