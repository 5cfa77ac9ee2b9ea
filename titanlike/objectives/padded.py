"""What masked LM (BERT) and span corruption (T5) share: samples built from sentence-split documents
and padded to their length, each a dict of fields whose `document_ids` (0 real, 1 padding) become a
bidirectional padding mask.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from titanlike.models.common.attention import DocumentMask
from titanlike.objectives.base import BatchContext, Microbatch, Objective, cut_sequence, target_count

if TYPE_CHECKING:
    from titanlike.config.schema import JobConfig
    from titanlike.models.args import LayoutDegrees


def check_fraction(option: str, value: float, *, exclusive: bool) -> None:
    """ValueError (one sentence) when `value` is not a fraction (0 < value < 1 when exclusive)."""
    ok = 0 < value < 1 if exclusive else 0 <= value <= 1
    if not ok:
        raise ValueError(f"{option} must be between 0 and 1{' (exclusive)' if exclusive else ''}, got {value}")


class PaddedSamples(Objective):
    """Base of the objectives whose samples are padded sentence-split text (subclasses build them)."""

    attention_mask = "a padding mask"
    # Fields of a sample laid out along the sequence of `inputs` (cut with it under context
    # parallelism), besides inputs and labels.
    token_fields: tuple[str, ...] = ()

    def _validate_job(self, cfg: JobConfig, dims: LayoutDegrees, *, model: str) -> None:
        self.validate_datasets(cfg)
        self.validate_packing(cfg, model=model)

    def validate_datasets(self, cfg: JobConfig) -> None:
        """The training and validation data can give sentence-split documents."""
        from titanlike.data.sentence_samples import validate_sentence_dataset

        validate_sentence_dataset(cfg.training.dataset, self.name)
        if cfg.validation.enable and cfg.validation.dataset is not None:
            validate_sentence_dataset(cfg.validation.dataset, self.name, option="validation")

    def validate_packing(self, cfg: JobConfig, *, model: str) -> None:
        """Documents and their ends are a packed token stream's; these samples carry their own masks."""
        for option in ("document_masking", "eod_mask_loss"):
            if getattr(cfg.training, option):
                raise ValueError(f"training.{option} applies to next-token models packed from documents; {model} "
                                 f"trains on {self.name} samples, which carry their own padding mask: remove "
                                 f"training.{option}")

    def build_source(self, sentences, tokenizer, **options):
        """The map-style source of this objective's samples over sentence-split documents."""
        raise NotImplementedError

    def samples(self, dataset: str, *, dataset_path, tokenizer, seq_len, seed, num_samples=None, split=None,
                split_name="train"):
        from titanlike.data.loader import GlobalSamples
        from titanlike.data.sentence_samples import sentence_documents

        sentences, split = sentence_documents(dataset, dataset_path=dataset_path, tokenizer=tokenizer, split=split,
                                              what=self.name)
        source = self.build_source(sentences, tokenizer, seq_len=seq_len, seed=seed, split=split,
                                   split_name=split_name, num_samples=num_samples)
        # The source permutes its samples every epoch itself.
        return GlobalSamples(source, shuffle=False, fields=source.fields)

    def prepare(self, batch: dict[str, torch.Tensor], ctx: BatchContext) -> Microbatch:
        """`document_ids` become a bidirectional mask (padding apart), and under context parallelism
        the inputs, labels and token fields are cut to this rank's positions."""
        fields = {name: value.to(ctx.device) for name, value in batch.items()}
        labels = cut_sequence(fields.pop("labels"), ctx)
        # Every cp rank keeps the ids of the whole sequence: its attention picks its rows.
        mask = DocumentMask.from_document_ids(fields.pop("document_ids"), ctx.mask_kernel, causal=False)
        inputs = cut_sequence(fields.pop("inputs"), ctx)
        for name in self.token_fields:
            fields[name] = cut_sequence(fields[name], ctx)
        return Microbatch(inputs, {"labels": labels}, target_count(labels), positions=ctx.cp_positions, mask=mask,
                          fields=fields)


__all__ = ["PaddedSamples", "check_fraction"]
